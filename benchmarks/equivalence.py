"""Largest train-vs-eval and batch-vs-single logit differences over the test model configs and all methods.

    python benchmarks/equivalence.py            # float64 (the tests assert < 1e-6)
    python benchmarks/equivalence.py --fp32
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ltmp  # noqa: E402
from conftest import CONFIGS, THRESHOLDS, images, make_model  # noqa: E402

METHODS = [(m, THRESHOLDS) for m in ("ltmp", "ltpm", "ltm", "ltp")] + [
    ("tome", dict(r=6)), ("topk-prune", dict(k=5)), ("topk-mp", dict(k=3))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp32", action="store_true")
    args = ap.parse_args()
    dtype = torch.float32 if args.fp32 else torch.float64
    worst_te = worst_bs = 0.0
    flips = 0
    for config in CONFIGS:
        for method, options in METHODS:
            model = ltmp.patch(make_model(config, dtype), method, **options)
            x = images(8, dtype)
            model.train()
            with torch.no_grad():
                t = model(x)
                kt = ltmp.stats(model).kept
                model.eval()
                e = model(x)
                ke = ltmp.stats(model).kept
                s = torch.cat([model(x[i:i + 1]) for i in range(len(x))])
            same = (kt == ke).all(1)
            flips += int((~same).sum())
            if same.any():
                worst_te = max(worst_te, float((t - e)[same].abs().max()))
            worst_bs = max(worst_bs, float((e - s).abs().max()))
    print(f"dtype {dtype}: max |train - eval| = {worst_te:.2e} (images with identical decisions), "
          f"max |batch - single| = {worst_bs:.2e}, images whose decisions differed = {flips}")


if __name__ == "__main__":
    main()
