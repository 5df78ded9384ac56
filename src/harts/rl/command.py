"""``harts rl CONFIG.toml [--out DIR] [--layout tree|flat] [--steps N] [--resume]``: online RL.

Exit status: 0 when the run is done; 2 for bad input (config, a refused checkpoint: one line on
stderr, the traceback under ``harts --debug``); 1 when a step's loss or gradient is not finite;
130 after Ctrl-C, with the last complete checkpoint left as it is for ``--resume``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]

EPILOG = """\
files written under OUT:
  metrics.jsonl                       one JSON object per step (reward, loss, tokens, seconds, ...)
  metrics.png                         reward and metrics against the step (when matplotlib is installed)
  checkpoints/step-NNNNNN/            the model (AutoModelForCausalLM.from_pretrained loads it), the
                                      optimizer and schedule states, the position, the config;
                                      manifest.json (sizes, sha256) is written last
exit status: 0 done, 1 a non-finite step, 2 bad input, 130 interrupted
guide: docs/online_rl.md"""


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(
        prog="harts rl",
        usage="harts rl CONFIG.toml [--out DIR] [--layout tree|flat] [--steps N] [--resume]",
        description="Online RL on the built-in multi-turn task: tree rollouts sampled by the model, "
        "trained with every shared prefix token computed once (tree) or each trajectory alone (flat).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", metavar="CONFIG.toml", help="the run's config (docs/online_rl.md)")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="output directory (default: the config's out, else runs/<config name>-<layout>)",
    )
    parser.add_argument(
        "--layout",
        choices=("tree", "flat"),
        help="train each step's rollouts merged by "
        "common prefix (tree) or each trajectory alone (flat); overrides the "
        "config",
    )
    parser.add_argument("--steps", type=int, metavar="N", help="steps of the run; overrides the config")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in DIR (verified first)",
    )
    args = parser.parse_args(argv)

    from harts.rl.config import load_rl_config
    from harts.rl.loop import TrainingDiverged, run_rl
    from harts.runtime.verify import VerificationError

    config = load_rl_config(args.config).with_overrides(layout=args.layout, steps=args.steps)
    default = Path("runs") / f"{Path(args.config).stem}-{config.layout}"
    out = Path(args.out) if args.out else config.out or default
    try:
        return run_rl(config, out, resume=args.resume)
    except KeyboardInterrupt:
        print(
            "harts rl: interrupted; the last complete checkpoint is kept (continue with --resume)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    except TrainingDiverged as exc:
        print(f"harts rl: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except VerificationError as exc:  # [run] verify: the step's check against the stock forward
        print(f"harts rl: error: {exc}", file=sys.stderr)
        raise SystemExit(4) from None
