"""The same model and thresholds in timm and in Hugging Face transformers: is the reduction as fast in both?

Converts the CIFAR-10 ViT (``scripts/timm_to_hf.py``), calibrates LTMP thresholds to ``--target`` on the timm model,
loads the same thresholds into the transformers model, and times all four (dense and reduced, timm and transformers)
interleaved in one process (``ltmp.bench.compare_models``). Prints whether both keep the same tokens, and paired
time ratios: reduced / dense within each library, and transformers / timm.

    python benchmarks/families.py --batch-size 32
    python benchmarks/families.py --batch-size 1
"""

from __future__ import annotations

import argparse
import copy
import importlib.util

import torch

import ltmp
from common import ROOT, calibrated, load_images, load_model
from ltmp.bench import compare_models, paired_ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=32, help="1: 8 single images per repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("timm_to_hf", ROOT / "scripts" / "timm_to_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    dense = load_model("cifar").eval()
    dense_hf = script.convert(dense)
    reduced, r = calibrated(dense, args.target, "cpu")
    reduced_hf = ltmp.patch(copy.deepcopy(dense_hf), "ltmp").eval()
    ltmp.thresholds.set_thresholds(reduced_hf, ltmp.thresholds.threshold_tensors(reduced))
    x = load_images(dense, "test", max(args.batch_size, 8))
    inputs = x[: args.batch_size] if args.batch_size > 1 else [x[i : i + 1] for i in range(8)]
    with torch.no_grad():
        reduced(x[:8])
        reduced_hf(x[:8])
        same = torch.equal(ltmp.stats(reduced).kept, ltmp.stats(reduced_hf).kept)
        print(
            f"cifar ltmp (calibrated r_FLOPs {r:.3f}), batch {args.batch_size}: timm and transformers keep the "
            f"same tokens: {same}"
        )
        timed = compare_models(
            {"timm dense": dense, "timm ltmp": reduced, "hf dense": dense_hf, "hf ltmp": reduced_hf},
            inputs,
            warmup=1,
            reps=args.reps,
            rounds=args.rounds,
        )
    for num, den in (
        ("timm ltmp", "timm dense"),
        ("hf ltmp", "hf dense"),
        ("hf dense", "timm dense"),
        ("hf ltmp", "timm ltmp"),
    ):
        v = paired_ratio(timed, num, den)
        print(f"  {num} / {den}: {v['median']:.3f} (quartiles {v['p25']:.3f}-{v['p75']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
