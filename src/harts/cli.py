"""The ``harts`` command: ``harts demo`` and ``harts bench``.

Each subcommand hands its remaining arguments to the module's own ``main`` (``harts.demo``,
``harts.bench.run``), so ``harts bench --help`` lists the benchmark's options. Nothing else lives here.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]

COMMANDS = {
    "demo": "one tree step vs one flat step on a small Ling 3 model (harts.demo)",
    "bench": "tree vs flat vs stock per-trajectory training on rollout-forest shapes (harts.bench.run)",
    "bench-overhead": "time outside model compute in a budgeted step, 1M-token forest (harts.bench.overhead)",
    "bench-checkpointing": "memory and time with gradient checkpointing (harts.bench.checkpointing)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="harts", description="harts: exact training on rollout forests")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from harts.demo import main as run
    elif args.command == "bench":
        from harts.bench.run import main as run
    elif args.command == "bench-overhead":
        from harts.bench.overhead import main as run
    else:
        from harts.bench.checkpointing import main as run
    run(rest)


if __name__ == "__main__":
    main()
