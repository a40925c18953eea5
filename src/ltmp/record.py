"""What the last forward of a patched model did: its record (tokens merged, pruned and kept per layer and image,
:class:`Record`, which ``ltmp.engine.encode`` makes), r_FLOPs (eq. 13) and the budget loss (eq. 14)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from .adapters import adapter_for
from .errors import LtmpError
from .flops import budget_loss_value, r_flops_from_fracs


@dataclasses.dataclass
class Record:
    """The record of the last forward of a patched model, overwritten by every forward (read with ``ltmp.stats``).

    Per-layer tensors are (B, L): one row per image, one column per block. They are built on first read from the
    blocks' counts (:class:`ltmp.step.StepResult`), so that a forward nobody inspects launches no operators for it.
    """

    method: str  # the patched method
    padded: list[int]  # (L + 1) longest image's tokens entering each block and leaving the last
    num_patches: int  # n of eq. 13
    num_prefix: int  # prefix tokens, always kept
    steps: list | None  # the blocks' counts (StepResult), until the record is first read
    dtype: torch.dtype  # of keep_frac
    device: torch.device
    batch: int
    sources: list[Tensor] | None = None  # per block (B, N_l, n) patch membership of each token, if traced
    keeps: list[Tensor] | None = None  # per block (B, N_l) survivors, if traced
    built: tuple | None = None  # (merged, pruned, kept, keep_frac) once built

    def counts(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(merged, pruned, kept, keep_frac), built once."""
        if self.built is None:

            def column(v) -> Tensor:  # (B,) from an int, a host list, a (B,) tensor or a (B, K) mask
                if isinstance(v, int):
                    return torch.full((self.batch,), v, device=self.device)
                if isinstance(v, list):
                    return torch.tensor(v, device=self.device)
                return v.sum(1) if v.dim() == 2 else v

            merged, pruned, kept = (
                torch.stack([column(getattr(s, f)) for s in self.steps], 1) for f in ("merged", "pruned", "kept")
            )  # (B, L) each
            frac = torch.stack([column(s.kept_frac) for s in self.steps], 1).to(self.dtype) / self.num_patches
            keep_frac = torch.cat([torch.ones_like(frac[:, :1]), frac], 1)  # (B, L + 1)
            self.built, self.steps = (merged, pruned, kept, keep_frac), None
        return self.built

    @property
    def merged(self) -> Tensor:
        """(B, L) tokens merged away in each block."""
        return self.counts()[0]

    @property
    def pruned(self) -> Tensor:
        """(B, L) tokens pruned in each block."""
        return self.counts()[1]

    @property
    def kept(self) -> Tensor:
        """(B, L) patch tokens left after each block."""
        return self.counts()[2]

    @property
    def keep_frac(self) -> Tensor:
        """(B, L + 1) fraction of patch tokens kept, m-bar of eq. 13 (column 0 is 1); differentiable in train mode."""
        return self.counts()[3]


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


def r_flops(model: nn.Module, tokens: str = "patches", pool: str = "image") -> Tensor:
    """Per-image r_FLOPs (eq. 13) of the last forward; differentiable w.r.t. the thresholds in train mode.

    Args:
        tokens: ``"patches"``: n counts the patch tokens (the paper's footnote: the class token is left out);
            ``"all"``: n and the kept fractions count the prefix tokens too, which are always kept (the reference
            code's).
        pool: ``"image"``: each image's r_FLOPs; ``"batch"``: one r_FLOPs of the batch's mean kept fractions (the
            reference code's, over the global batch under ``torch.distributed``; eq. 13's quadratic attention
            term makes the two differ).

    Returns:
        (B,) tensor, or (1,) with ``pool="batch"``.
    """
    rec = stats(model)
    adapter, plain = adapter_for(getattr(model, "module", model)), getattr(model, "module", model)
    n, frac = rec.num_patches, rec.keep_frac  # (B, L + 1)
    if tokens == "all":
        frac, n = (frac * n + rec.num_prefix) / (n + rec.num_prefix), n + rec.num_prefix
    if pool == "batch":
        frac = _global_mean(frac.mean(0, keepdim=True))  # (1, L + 1)
    return r_flops_from_fracs(frac, n, adapter.embed_dim(plain), adapter.mlp_hidden(plain))


def mean_r_flops(model: nn.Module, tokens: str = "patches", pool: str = "image") -> Tensor:
    """The batch mean of r_FLOPs (eq. 13) of the last forward; under ``torch.distributed`` the mean over the
    global batch, all-reduced differentiably across ranks (the budget loss is not linear in it).

    Args:
        tokens, pool: as for :func:`r_flops`.

    Returns:
        () tensor.
    """
    r = r_flops(model, tokens, pool).mean()
    return r if pool == "batch" else _global_mean(r)


def _global_mean(t: Tensor) -> Tensor:
    """``t``'s mean over the ranks of ``torch.distributed`` (differentiable), or ``t``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            from torch.distributed.nn.functional import all_reduce

            return all_reduce(t) / world
    return t


def budget_loss(model: nn.Module, r_target: float) -> Tensor:
    """The budget loss of eq. 14, ``(r_target - mean r_FLOPs)^2``, from the last forward.

    Under ``torch.distributed`` the batch mean is the global batch's (:func:`mean_r_flops`), so data-parallel
    training optimizes the same loss as one process on the global batch.
    Add it to cross-entropy as ``loss = ce + lam * budget_loss(model, r_target)`` (eq. 15).
    """
    return budget_loss_value(mean_r_flops(model), r_target)
