"""ltmp: Learned Thresholds token Merging and Pruning for vision transformers (timm, transformers, OpenCLIP).

Bonnaerens & Dambre, "Learned Thresholds Token Merging and Pruning for Vision Transformers", TMLR 2023.

    import timm, ltmp
    model = timm.create_model("deit_small_patch16_224", pretrained=True)
    ltmp.patch(model, method="ltmp", tau=0.1)   # train(): masked, differentiable; eval(): tokens removed
"""

from __future__ import annotations

from ._version import __version__ as __version__
from .config import METHODS
from .errors import LtmpError
from .flops import ViTSpec, dense_gmacs, gmacs, gmacs_executed, vit_spec
from .patching import patch, unpatch
from .record import Record, budget_loss, mean_r_flops, r_flops, stats
from .thresholds import load_thresholds, read_thresholds, save_thresholds

__all__ = [
    "METHODS",
    "LtmpError",
    "Record",
    "ViTSpec",
    "budget_loss",
    "dense_gmacs",
    "gmacs",
    "gmacs_executed",
    "load_thresholds",
    "mean_r_flops",
    "patch",
    "r_flops",
    "read_thresholds",
    "save_thresholds",
    "stats",
    "unpatch",
    "vit_spec",
]
