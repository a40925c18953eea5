"""Small random timm ViTs covering the configurations ltmp must keep working, and a tiny model and image folder
on disk for the command-line tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from PIL import Image

# name -> (timm entry point, overrides). All 32x32 inputs with 4x4 patches: 64 patch tokens.
BASE = dict(img_size=32, patch_size=4, embed_dim=48, depth=3, num_heads=3, num_classes=7)
CONFIGS = {
    "cls": ("vit_tiny_patch16_224", {}),
    "distilled": ("deit_tiny_distilled_patch16_224", {}),
    "registers": ("vit_tiny_patch16_224", dict(reg_tokens=4)),
    "no-cls-avg": ("vit_tiny_patch16_224", dict(class_token=False, global_pool="avg")),
    "layerscale-qknorm": ("vit_tiny_patch16_224", dict(init_values=0.5, qk_norm=True)),
    "unfused": ("vit_tiny_patch16_224", {}),
    "map": ("vit_tiny_patch16_224", dict(class_token=False, global_pool="map")),
}
NO_CLASS_TOKEN = {"no-cls-avg", "map"}


def make_model(name: str, dtype: torch.dtype = torch.float64, seed: int = 0, **extra) -> torch.nn.Module:
    """A random model whose attention is peaked enough for merging and pruning decisions to vary (``extra``:
    further timm arguments, e.g. ``depth``)."""
    entry, overrides = CONFIGS[name]
    torch.manual_seed(seed)
    model = timm.create_model(entry, **{**BASE, **overrides, **extra})
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(6.0)
    if name == "unfused":
        for blk in model.blocks:
            blk.attn.fused_attn = False
    return model.to(dtype).eval()


def images(n: int = 4, dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # smooth images with structure, so that neighbouring patches are similar and some are merged
    base = torch.randn(n, 3, 8, 8, generator=g, dtype=dtype)
    x = torch.nn.functional.interpolate(base, size=32, mode="bilinear", align_corners=False)
    return x + 0.3 * torch.randn(n, 3, 32, 32, generator=g, dtype=dtype)


# thresholds that merge and prune a fair share of the 64 tokens of the small models in every block
THRESHOLDS = dict(merge_threshold=0.8, prune_threshold=0.9 / 65)


@pytest.fixture(params=list(CONFIGS))
def config(request) -> str:
    return request.param


TINY_ARGS = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=3)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random ViT in timm's local-dir format (config.json + model.safetensors)."""
    from timm.models._hub import save_for_hf

    folder = tmp_path_factory.mktemp("models") / "tiny"
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", **TINY_ARGS)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(5)
    save_for_hf(
        model,
        str(folder),
        model_args=TINY_ARGS,
        safe_serialization=True,
        data_config=dict(input_size=(3, 32, 32), crop_pct=1.0, mean=(0.5,) * 3, std=(0.25,) * 3),
    )
    return f"local-dir:{folder}"


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """ImageFolder with train (3 x 16) and val (3 x 6) splits of structured 32x32 images."""
    root = tmp_path_factory.mktemp("data")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 16), ("val", 6)):
        for c in range(3):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(n):
                base = torch.rand(3, 4, 4, generator=g) * 0.5 + 0.25 * c
                img = torch.nn.functional.interpolate(base[None], size=32, mode="bilinear")[0]
                arr = (img.clamp(0, 1) * 255).byte().permute(1, 2, 0).numpy()
                Image.fromarray(arr).save(d / f"{i:03d}.png")
    return root
