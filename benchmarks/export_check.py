"""Exported models decide as the eager model on real images: ``.pt2`` (torch.export) against eager, per image.

The CIFAR-10 ViT (the shared model, or the bundled one) is patched with ToMe (r 4), top-k pruning (k 3) and LTMP
(thresholds calibrated to r_FLOPs 0.5 on training images), exported at batch 1 (``ltmp export``'s path), and run
on the first ``--images`` test images of the bundled CIFAR-10 subset (1,000), or of ``--data-dir`` (a folder or
archive in ImageFolder layout, e.g. all of CIFAR-10). An image whose largest |logit difference| exceeds 1e-4 took
another decision (the same decisions give the same logits up to float32 rounding, ~1e-6). Prints, per method, the
images that differ and the largest difference.

    python benchmarks/export_check.py --images 10000 --data-dir ../shared/data/cifar10/cifar10-jpeg.tar.gz
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

import ltmp
from common import calibrated, load_model
from ltmp import data as ldata
from ltmp.demo import BUNDLED_DATA
from ltmp.export import export_model, load_exported


def test_images(model: torch.nn.Module, n: int, data_dir: str) -> torch.Tensor:
    """The first ``n`` test images of ``data_dir``, in order, with the model's eval transform."""
    _, tf, _ = ldata.transforms_for(model, "none")
    ds = ldata.ImageFolder(ldata.split_dir(ldata.resolve_root(data_dir), "test"), tf)
    return torch.stack([ds[i][0] for i in range(min(n, len(ds)))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--methods", nargs="+", default=["tome", "topk-prune", "ltmp"])
    ap.add_argument("--data-dir", default=str(BUNDLED_DATA), help="ImageFolder folder or archive with test/")
    args = ap.parse_args()
    dense = load_model("cifar").eval()
    x = test_images(dense, args.images, args.data_dir)
    for method in args.methods:
        if method == "ltmp":
            model, _ = calibrated(dense, 0.5)
        else:
            model = ltmp.patch(copy.deepcopy(dense), method, **({"r": 4} if method == "tome" else {"k": 3})).eval()
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            exported = load_exported(export_model(model, x[:1], "export", Path(tmp) / "m.pt2"))
            took = time.perf_counter() - t0
            worst, differ = 0.0, []
            with torch.no_grad():
                for i in range(len(x)):
                    d = float((exported(x[i : i + 1]) - model(x[i : i + 1])).abs().max())
                    worst = max(worst, d)
                    if d > 1e-4:
                        differ.append(i)
        print(
            f"{method}: {len(differ)} of {len(x)} test images differ from eager (> 1e-4), largest |logit "
            f"difference| {worst:.1e}{'; images ' + str(differ[:10]) if differ else ''} (export {took:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
