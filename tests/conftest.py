"""Small random timm ViTs covering the configurations ltmp must keep working."""
from __future__ import annotations

import pytest
import timm
import torch

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
