"""Summarize threshold-training logs: how fast r_FLOPs reaches r_target, and where the thresholds end.

python benchmarks/train_log_summary.py runs/cifar10/light-r0.5 runs/cifar10/timm-r0.5 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    print(
        "| run | r_target | r_FLOPs at step 1 | first step within 0.03 | mean r_FLOPs, last 50 steps | "
        "prune thresholds (first/last block) | merge thresholds (first/last block) |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in sys.argv[1:]:
        run = Path(run)
        cfg = json.loads((run / "config.json").read_text())
        log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        t = cfg["r_target"]
        first = next((e["step"] for e in log if abs(e["r_flops"] - t) < 0.03), None)
        tail = [e["r_flops"] for e in log[-50:]]
        prune, merge = log[-1]["prune"], log[-1]["merge"]
        fmt = (lambda v: f"{v[0]:.2e} / {v[-1]:.2e}") if prune else (lambda v: "-")
        print(
            f"| {run.name} | {t} | {log[0]['r_flops']:.3f} | {first} | {sum(tail) / len(tail):.3f} | "
            f"{fmt(prune)} | {merge[0]:.3f} / {merge[-1]:.3f} |"
        )


if __name__ == "__main__":
    main()
