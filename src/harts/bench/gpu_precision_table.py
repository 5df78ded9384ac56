"""The per-family precision table of a GPU run, from the JSON report tests/test_gpu_precision.py
writes when ``HARTS_GPU_REPORT`` is set: per family and mode (fp32, bf16 autocast, bf16
parameters), stock's and harts' worst log-prob error, lowest logit cosine and gradient relative
error against the fp64 truth, and whether the bounds held. Prints a markdown table.

    HARTS_GPU_REPORT=gpu_precision.json python -m pytest -q -m gpu tests/test_gpu_precision.py
    python -m harts.bench.gpu_precision_table gpu_precision.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODES = ("fp32", "bf16-autocast", "bf16-params")
COLUMNS = (
    ("logprob_max_error", "log-prob max error", ".2e"),
    ("logit_cosine_min", "logit cosine (min)", ".6f"),
    ("grad_relative_error", "gradient relative error", ".2e"),
)


def table(data: dict) -> str:
    head = ["family", "mode"] + [f"{title}, {who}" for _, title, _ in COLUMNS for who in ("stock", "harts")]
    lines = ["| " + " | ".join(head + ["bounds"]) + " |", "|" + "---|" * (len(head) + 1)]
    for family, modes in data["families"].items():
        for mode in (m for m in MODES if m in modes):
            figures = modes[mode]
            cells = [family, mode]
            cells += [format(figures[who][key], fmt) for key, _, fmt in COLUMNS for who in ("stock", "harts")]
            cells.append("held" if not figures["failures"] else "missed: " + "; ".join(figures["failures"]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    data = json.loads(parser.parse_args().report.read_text())
    print(f"device: {data.get('device', 'cpu')}\n")
    print(table(data))


if __name__ == "__main__":
    main()
