"""The ``harts`` command: ``harts train``, ``harts rl``, ``harts demo``, ``harts analyze``, ``harts bench``.

Each subcommand hands its remaining arguments to the module's own ``main`` (``harts.demo``,
``harts.trainer.command``, ``harts.rl.command``, ``harts.bench.run``), so ``harts train --help``
lists the training run's options. An error in the input is one line on stderr and exit status 2
(``harts --debug ...`` shows the traceback); under torchrun, rank 0 prints it.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

COMMANDS = {
    "train": "a training run from a TOML config, with checkpoints and resume (harts.trainer.command)",
    "rl": "online RL with tree rollouts on a built-in multi-turn task, tree or flat (harts.rl.command)",
    "demo": "a small Ling 3 model: the tree step against stock HF, then speed and memory (harts.demo)",
    "analyze": "how much a rollout file shares, the ideal speedup, a picture (harts.analyze)",
    "bench": "tree vs flat vs stock per-trajectory training on rollout-forest shapes (harts.bench.run)",
    "bench-overhead": "time outside model compute in a budgeted step, 1M-token forest (harts.bench.overhead)",
    "bench-checkpointing": "memory and time with gradient checkpointing (harts.bench.checkpointing)",
    "bench-gui": "GUI-agent forests, a screenshot per turn: multimodal tree vs flat (harts.bench.gui_agent)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="harts", description="harts: exact training on rollout forests")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        from harts.trainer.command import main as run
    elif args.command == "rl":
        from harts.rl.command import main as run
    elif args.command == "demo":
        from harts.demo import main as run
    elif args.command == "analyze":
        from harts.analyze import main as run
    elif args.command == "bench":
        from harts.bench.run import main as run
    elif args.command == "bench-overhead":
        from harts.bench.overhead import main as run
    elif args.command == "bench-gui":
        from harts.bench.gui_agent import main as run
    else:
        from harts.bench.checkpointing import main as run
    try:
        run(rest)
    except (ValueError, TypeError, OSError, ImportError) as exc:
        if args.debug:
            raise
        # one line naming what is wrong; --debug shows where. Under torchrun every rank meets the
        # same bad input: rank 0 says it
        if os.environ.get("RANK", "0") == "0":
            print(f"harts {args.command}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
