"""Dense outputs (``ltmp.patch(..., dense_output=True)``): how close each block's per-patch features stay to the
unreduced model's, and what following the tokens costs.

For the bundled CIFAR-10 ViT at r_FLOPs 0.7 and 0.5: LTMP with thresholds calibrated to that budget, ToMe and
top-k pruning at LTMP's GMACs; each block's output per patch (``forward_intermediates``, NLC) against the unreduced
model's: the cosine similarity, averaged over patches and images. For a DINOv2 shape (timm
``vit_small_patch14_dinov2`` at 224x224 with 4 registers) only the time: no DINOv2 weights can be had here, and with
random weights every token is nearly the same (cosine 1.000 in every block, and thresholds calibrated on such scores
barely reduce), so ToMe and top-k pruning run at the GMACs of the r_FLOPs target. Time: ``forward_features`` at
batch 32 with and without dense outputs, paired over rounds (``ltmp.bench.paired_ratio``).

    python benchmarks/dense.py                      # both models, writes results/dense.json
    python benchmarks/dense.py --models cifar --images 64
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from torch import nn

import ltmp
from common import ROOT, at_gmacs, calibrated, device_name, load_images, load_model, mean_gmacs
from ltmp.bench import compare_models, paired_ratio
from ltmp.thresholds import write_json


class Features(nn.Module):
    """``forward_features`` as the forward, to time it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)


def per_block(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Every block's output per patch, (B, n, C) each."""
    with torch.no_grad():
        return model.forward_intermediates(x, output_fmt="NLC", intermediates_only=True)


def models_for(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The dense model, its calibration images and its test images."""
    if name == "cifar":
        dense = load_model("cifar")
        return dense, load_images(dense, "train", 64), load_images(dense, "test", 64)
    torch.manual_seed(0)
    dense = timm.create_model("vit_small_patch14_dinov2", img_size=224, reg_tokens=4, pretrained=False).eval()
    dense.pretrained_cfg = {**dense.pretrained_cfg, "input_size": (3, 224, 224), "crop_pct": 1.0}  # (its 518)
    return dense, load_images(dense, "train", 32), load_images(dense, "test", 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["cifar", "dinov2-s"], choices=["cifar", "dinov2-s"])
    ap.add_argument("--targets", nargs="+", type=float, default=[0.7, 0.5])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=str(ROOT / "results" / "dense.json"))
    args = ap.parse_args()
    rows = []
    for name in args.models:
        dense, calib, x = models_for(name)
        trained = name == "cifar"  # (the DINOv2 shape has random weights: time only)
        ref = per_block(dense, x) if trained else None
        for target in args.targets:
            mine = calibrated(dense, target, images=calib)[0] if trained else None
            gmacs = mean_gmacs(mine, x) if trained else target * ltmp.dense_gmacs(ltmp.vit_spec(dense))
            for method in ("ltmp", "tome", "topk-prune") if trained else ("tome", "topk-prune"):
                model = mine if method == "ltmp" else at_gmacs(dense, method, gmacs)
                model.ltmp_config.dense_output = True
                got = per_block(model, x) if trained else []
                cos = [float(F.cosine_similarity(g, r, dim=-1).mean()) for g, r in zip(got, ref or [])]
                plain = copy.deepcopy(model)
                plain.ltmp_config.dense_output = False
                xb = x[: args.batch_size]
                timed = compare_models({"dense": Features(model), "plain": Features(plain)}, xb, rounds=args.rounds)
                ratio = paired_ratio(timed, "dense", "plain")
                row = dict(
                    model=name,
                    r_target=target,
                    method=method,
                    gmacs=round(mean_gmacs(model, x), 4),
                    cosine=[round(c, 4) for c in cos],
                    time_ratio=ratio,
                )
                rows.append(row)
                print(
                    f"{name} r {target} {method:10s} GMACs {row['gmacs']:.4f}  cosine per block "
                    f"{' '.join(f'{c:.3f}' for c in cos) or '-'}  dense / plain time {ratio['median']:.3f} "
                    f"({ratio['p25']:.3f}-{ratio['p75']:.3f})",
                    flush=True,
                )
    out = dict(
        command="python benchmarks/dense.py",
        options=vars(args),
        machine=device_name(torch.device("cpu")),
        date=datetime.date.today().isoformat(),
        rows=rows,
    )
    write_json(Path(args.json), out)
    print(json.dumps({k: out[k] for k in ("machine", "date")}))


if __name__ == "__main__":
    main()
