"""Why a deployed LTMP model's logits differ from eager on an image: how near that image's scores lie to a threshold.

Exports the DeiT-S shape (or the CIFAR-10 ViT) with LTMP calibrated to r_FLOPs 0.5 as in benchmarks/deployed.py,
runs ``--images`` bundled test images in ONNX Runtime and in eager PyTorch, and prints, for every image whose
logits differ by more than ``--tol``, the smallest |score - threshold| over its merge and prune candidates
(``ReduceConfig.capture``); 0 means a score sits exactly on a threshold, where float rounding decides eq. 1.

    python benchmarks/deployed_diff.py --model deit-s --images 60
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from common import calibrated, load_images, load_model
from ltmp.export import deploy, load_deployed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deit-s", choices=["deit-s", "cifar"])
    ap.add_argument("--images", type=int, default=60)
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    dense = load_model(args.model)
    images = load_images(dense, "test", args.images)
    model, _ = calibrated(dense, 0.5)
    thresholds = {k: float(v) for k, v in model.state_dict().items() if k.endswith("_threshold")}
    cfg = model.ltmp_config
    with tempfile.TemporaryDirectory() as tmp:
        deployed = load_deployed(deploy(model, images[:1], "onnx", tmp, "ltmp"), "onnx", threads=1)
        for i in range(len(images)):
            x = images[i : i + 1]
            captured = []
            cfg.capture = captured.append
            with torch.no_grad():
                diff = float((deployed(x) - model(x)).abs().max())
            nearest = min(
                float((c.scores[c.candidates] - thresholds[f"blocks.{c.layer}.{c.op}_threshold"]).abs().min())
                for c in captured
                if c.candidates.any()
            )
            cfg.capture = None
            if diff > args.tol:
                print(f"image {i}: |logit difference| {diff:.2e}; nearest score to a threshold {nearest:.2e}")
    print(f"{args.images} images checked")


if __name__ == "__main__":
    main()
