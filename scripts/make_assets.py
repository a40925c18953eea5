"""Build the assets shipped in the package (src/ltmp/assets/), from ../shared.

    python scripts/make_assets.py

- vit-cifar10/: the CIFAR-10 ViT of ../shared/models/vit-cifar10, converted to fp16 safetensors (timm local-dir
  format). `ltmp pretrain` reproduces its recipe (see README, model card).
- cifar10-subset.tar.gz: 4,000 train images (400 per class) and 1,000 test images (100 per class) of the shared
  CIFAR-10 JPEG copy, in ImageFolder layout; picked with a fixed seed.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
ASSETS = ROOT / "src/ltmp/assets"
PER_CLASS = {"train": 400, "test": 100}


def model() -> None:
    src = SHARED / "models/vit-cifar10"
    dst = ASSETS / "vit-cifar10"
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")


def subset() -> None:
    rng = random.Random(0)
    with tarfile.open(SHARED / "data/cifar10/cifar10-jpeg.tar.gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jpg")]
        chosen = []
        for split, n in PER_CLASS.items():
            by_class: dict[str, list] = {}
            for m in members:
                parts = Path(m.name).parts
                if split in parts:
                    by_class.setdefault(parts[parts.index(split) + 1], []).append(m)
            for cls in sorted(by_class):
                pool = sorted(by_class[cls], key=lambda m: m.name)
                chosen += [(split, cls, m) for m in rng.sample(pool, n)]
        out = ASSETS / "cifar10-subset.tar.gz"
        with tarfile.open(out, "w:gz") as dst:
            for split, cls, m in sorted(chosen, key=lambda t: t[2].name):
                data = tar.extractfile(m).read()
                info = tarfile.TarInfo(f"{split}/{cls}/{Path(m.name).name}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                dst.addfile(info, io.BytesIO(data))
    (ASSETS / "README.md").write_text(
        "# Bundled assets\n\nBuilt by `python scripts/make_assets.py` from ../shared.\n\n"
        "- `vit-cifar10/`: the CIFAR-10 ViT of ../shared/models/vit-cifar10 in fp16 (timm local-dir format).\n"
        f"- `cifar10-subset.tar.gz`: {PER_CLASS['train']} train and {PER_CLASS['test']} test images per class "
        "of the shared CIFAR-10 JPEG copy (ImageFolder layout, seed 0).\n"
    )
    print(json.dumps({p.name: p.stat().st_size for p in ASSETS.rglob("*") if p.is_file()}, indent=1))


if __name__ == "__main__":
    model()
    subset()
