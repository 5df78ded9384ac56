"""``harts train`` on one rank of several, that dies or hangs inside an FSDP2 layer unit's gather.

    python tests/fault_worker.py die|hang K train CONFIG --out DIR

The K-th gather of a decoder-layer unit on this process (counted from the start, ``FSDPModule.unshard``
on a module whose class name ends in ``DecoderLayer``) kills the process (SIGKILL: nothing is
flushed, as when a machine fails) or blocks it forever (a hung rank), before its share of the
all-gather starts. Everything else is the real command on the real FSDP2 model; the other
ranks run plain ``harts train`` and must fail within ``distributed.timeout_s`` saying why.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _phase() -> str:
    """The phase of the step this gather belongs to: "forward" or "backward" (its ShardedStep method)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("layer", "backward") and "sharded" in frame.f_code.co_filename:
            return "forward" if frame.f_code.co_name == "layer" else "backward"
        frame = frame.f_back
    return "outside the step"


def main() -> None:
    mode, count, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if mode not in ("die", "hang"):
        raise SystemExit(f"fault_worker: mode must be die or hang, got {mode!r}")
    from torch.distributed.fsdp import FSDPModule

    stock_unshard = FSDPModule.unshard
    seen = 0

    def unshard(self, *args, **kwargs):
        nonlocal seen
        if type(self).__name__.endswith("DecoderLayer"):
            seen += 1
            if seen == count:
                print(f"fault_worker: {mode} at layer gather {seen} ({type(self).__name__}, {_phase()})",
                      file=sys.stderr, flush=True)  # fmt: skip
                if mode == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Event().wait()  # hang: never returns
        return stock_unshard(self, *args, **kwargs)

    FSDPModule.unshard = unshard
    from harts.cli import main as harts_main

    harts_main(argv)


if __name__ == "__main__":
    main()
