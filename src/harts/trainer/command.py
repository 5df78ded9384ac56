"""``harts train CONFIG.toml [--out DIR] [--resume] [--accept-changed-data]``: a run from a config file.

The whole rollout file is checked before the model loads (every line, against the model's vocabulary
and the objective's fields); a resume on a rollout file that changed since the checkpoint is refused
unless ``--accept-changed-data`` is given, which continues from the checkpoint's position on the
changed file and prints what changed.

Exit status: 0 when the run is done; 2 for bad input (config, data, a refused checkpoint: one
line on stderr, the traceback under ``harts --debug``); 1 when a step's loss or gradient is not
finite; 3 when another rank of a multi-process run failed (died, stopped, or timed out); 4 when
the step's check against the stock forward failed (``[run] verify``: before that update); 130
after Ctrl-C and 143 after SIGTERM, with the last complete checkpoint left as it is, for
``--resume`` to continue from.

Under torchrun an error every rank meets alike (bad input, a diverged step) is printed once, by
rank 0, and every rank exits with its status (:func:`~harts.trainer.processes.stop_together`);
a failed collective is printed by each rank that sees it, naming the rank.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

__all__ = ["main"]

EPILOG = """\
files written under OUT:
  metrics.jsonl                       one JSON object per optimizer step
  metrics.png                         loss and metrics against the step (when matplotlib is installed)
  checkpoints/step-NNNNNN/            the model (save_pretrained: AutoModelForCausalLM.from_pretrained
                                      loads it), optimizer, scheduler and RNG states, data position,
                                      the config; manifest.json (sizes, sha256) is written last;
                                      with [critic], the critic in critic/
several processes: torchrun --nproc_per_node=N -m harts train CONFIG.toml (section [distributed])
exit status: 0 done, 1 a non-finite step, 2 bad input, 3 another rank failed, 4 the step's check against
the stock forward failed ([run] verify), 130 interrupted (143 on SIGTERM)
config reference: docs/training.md"""


def _on_sigterm(signum, frame):
    from harts.trainer.run import Terminated

    raise Terminated()


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(
        prog="harts train",
        usage="harts train CONFIG.toml [--out DIR] [--resume] [--accept-changed-data]",
        description="Train a causal LM on a rollout file, every shared prefix token computed once.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", metavar="CONFIG.toml", help="the run's config (docs/training.md)")
    parser.add_argument(
        "--out", metavar="DIR", help="output directory (default: the config's out, else runs/<config name>)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint "
        "in DIR (verified first; starts from step 0 when there is none)",
    )
    parser.add_argument(
        "--accept-changed-data",
        action="store_true",
        help="with --resume: continue from "
        "the checkpoint's step on a rollout file that changed since it was written (what "
        "changed is printed; the run then differs from an uninterrupted one)",
    )
    args = parser.parse_args(argv)
    if args.accept_changed_data and not args.resume:
        parser.error("--accept-changed-data goes with --resume (it lets a resume continue on a changed file)")

    from harts.runtime.verify import VerificationError
    from harts.trainer.config_files import load_config
    from harts.trainer.loop import TrainingDiverged, train
    from harts.trainer.processes import RankFailure, reports, stop_together
    from harts.trainer.run import Terminated

    try:
        config = load_config(args.config)
    except (ValueError, TypeError, OSError):
        stop_together()  # under torchrun: every rank meets it; each exits with status 2
        raise
    out = Path(args.out) if args.out else config.out or Path("runs") / Path(args.config).stem
    handle = _main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if handle else None
    try:
        return train(config, out, resume=args.resume, accept_changed_data=args.accept_changed_data)
    except Terminated:
        raise SystemExit(143) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except TrainingDiverged as exc:
        if reports():  # every rank's step diverged alike: rank 0 says it
            print(f"harts train: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except VerificationError as exc:  # the ranks agreed on it before the step: rank 0 says it
        if reports():
            print(f"harts train: error: {exc}", file=sys.stderr)
        raise SystemExit(4) from None
    except RankFailure as exc:  # each rank's own (it names the rank)
        print(f"harts train: error: {exc}; resume from the last checkpoint with --resume", file=sys.stderr)
        raise SystemExit(3) from None
    finally:
        if handle and signal.getsignal(signal.SIGTERM) is _on_sigterm:  # not when stopping on ranks
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
