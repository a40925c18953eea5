"""What the last forward of a patched model did: its record (tokens merged, pruned and kept per layer and image),
r_FLOPs (eq. 13) and the budget loss (eq. 14)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .errors import LtmpError
from .flops import budget_loss_value, r_flops_from_fracs
from .patching import Record, embed_dim, mlp_hidden


def stats(model: nn.Module) -> Record:
    """The record of the last forward of a patched model: per layer and image, tokens merged, pruned and kept.

    It is overwritten by every forward and never consumed, so it can be read any number of times.
    """
    model = getattr(model, "module", model)
    if getattr(model, "ltmp_config", None) is None:
        raise LtmpError("this model is not patched; call ltmp.patch(model, ...) first")
    if model.ltmp_record is None:
        raise LtmpError("no forward has run since ltmp.patch; run the model on a batch first")
    return model.ltmp_record


def r_flops(model: nn.Module) -> Tensor:
    """Per-image r_FLOPs (eq. 13) of the last forward; differentiable w.r.t. the thresholds in train mode.

    Returns:
        (B,) tensor.
    """
    rec = stats(model)
    spec_model = getattr(model, "module", model)
    return r_flops_from_fracs(rec.keep_frac, rec.num_patches, embed_dim(spec_model), mlp_hidden(spec_model))


def mean_r_flops(model: nn.Module) -> Tensor:
    """The batch mean of r_FLOPs (eq. 13) of the last forward; under ``torch.distributed`` the mean over the
    global batch, all-reduced differentiably across ranks (the budget loss is not linear in it).

    Returns:
        () tensor.
    """
    r = r_flops(model).mean()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            from torch.distributed.nn.functional import all_reduce

            r = all_reduce(r) / world
    return r


def budget_loss(model: nn.Module, r_target: float) -> Tensor:
    """The budget loss of eq. 14, ``(r_target - mean r_FLOPs)^2``, from the last forward.

    Under ``torch.distributed`` the batch mean is the global batch's (:func:`mean_r_flops`), so data-parallel
    training optimizes the same loss as one process on the global batch.
    Add it to cross-entropy as ``loss = ce + lam * budget_loss(model, r_target)`` (eq. 15).
    """
    return budget_loss_value(mean_r_flops(model), r_target)
