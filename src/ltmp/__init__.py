"""ltmp: Learned Thresholds token Merging and Pruning for timm vision transformers.

Bonnaerens & Dambre, "Learned Thresholds Token Merging and Pruning for Vision Transformers", TMLR 2023.

    import timm, ltmp
    model = timm.create_model("deit_small_patch16_224", pretrained=True)
    ltmp.patch(model, method="ltmp", tau=0.1)   # train(): masked, differentiable; eval(): tokens removed
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ._version import __version__ as __version__
from .flops import ViTSpec, budget_loss_value, dense_gmacs, gmacs, gmacs_executed, r_flops_from_fracs
from .reduce import METHODS
from .thresholds import load_thresholds, read_thresholds, save_thresholds
from .timm_patch import Record, patch, unpatch, vit_spec

__all__ = [
    "METHODS", "Record", "ViTSpec", "budget_loss", "dense_gmacs", "gmacs", "gmacs_executed", "load_thresholds",
    "patch", "r_flops", "read_thresholds", "save_thresholds", "stats", "unpatch", "vit_spec",
]


def stats(model: nn.Module) -> Record:
    """The record of the last forward of a patched model: per layer and image, tokens merged, pruned and kept.

    It is overwritten by every forward and never consumed, so it can be read any number of times.
    """
    model = getattr(model, "module", model)
    if getattr(model, "ltmp_config", None) is None:
        raise ValueError("this model is not patched; call ltmp.patch(model, ...) first")
    if model.ltmp_record is None:
        raise ValueError("no forward has run since ltmp.patch; run the model on a batch first")
    return model.ltmp_record


def r_flops(model: nn.Module) -> Tensor:
    """Per-image r_FLOPs (eq. 13) of the last forward; differentiable w.r.t. the thresholds in train mode.

    Returns:
        (B,) tensor.
    """
    rec = stats(model)
    spec_model = getattr(model, "module", model)
    return r_flops_from_fracs(rec.keep_frac, rec.num_patches, spec_model.embed_dim,
                              _mlp_hidden(spec_model))


def _mlp_hidden(model: nn.Module) -> int:
    mlp = model.blocks[0].mlp
    return int(mlp.fc1.out_features) if hasattr(mlp, "fc1") else 4 * int(model.embed_dim)


def budget_loss(model: nn.Module, r_target: float) -> Tensor:
    """The budget loss of eq. 14, ``(r_target - mean r_FLOPs)^2``, from the last forward.

    Under ``torch.distributed`` the batch mean of r_FLOPs is all-reduced (differentiably) across ranks before
    squaring, so data-parallel training optimizes the same loss as one process on the global batch.
    Add it to cross-entropy as ``loss = ce + lam * budget_loss(model, r_target)`` (eq. 15).
    """
    r = r_flops(model).mean()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            from torch.distributed.nn.functional import all_reduce

            r = all_reduce(r) / world
    return budget_loss_value(r, r_target)
