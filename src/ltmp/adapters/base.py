"""What every family's adapter shares: the :class:`Adapter` interface, MAC counts of common layers, and the
heads' pooling over the surviving tokens."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import ops
from ..config import BlockView, identity

__all__ = [
    "Adapter",
    "BlockView",
    "identity",
    "mean_pool",
    "pool_bias",
    "zero_padding",
    "linear_macs",
    "conv_macs",
    "norm_macs",
]


def linear_macs(*mods: nn.Module | None) -> float:
    """in * out multiply-accumulates per token of every nn.Linear inside ``mods``."""
    return float(
        sum(
            m.in_features * m.out_features
            for mod in mods
            if mod is not None
            for m in mod.modules()
            if isinstance(m, nn.Linear)
        )
    )


def conv_macs(conv: nn.Conv2d) -> float:
    """Multiply-accumulates of a patch-embedding convolution per output position (per patch)."""
    return float(conv.out_channels * (conv.in_channels // conv.groups) * math.prod(conv.kernel_size))


def norm_macs(*mods: nn.Module | None, count: bool = True) -> float:
    """fvcore's LayerNorm MACs per token inside ``mods``: 5 per element (4 without affine); 0 unless ``count``."""
    if not count:
        return 0.0
    return float(
        sum(
            (5 if m.elementwise_affine else 4) * math.prod(m.normalized_shape)
            for mod in mods
            if mod is not None
            for m in mod.modules()
            if isinstance(m, nn.LayerNorm)
        )
    )


class Adapter:
    """One model family. Subclasses answer where things are; the reduction code does the rest.

    ``forward`` replaces the model's own forward when patched (``ltmp.engine.forward`` calls it with ``encode``,
    the blocks with the reduction step): it embeds the inputs, encodes them and applies the family's head, returning
    what the unpatched model returns. Adapters import no module that runs the reduction.
    """

    family: str = ""  # recorded in threshold files
    supported: str = ""  # what it supports, for refusal messages

    def owns(self, model: nn.Module) -> bool:
        """The model belongs to this family (supported or not: :meth:`check` says why not)."""
        raise NotImplementedError

    def check(self, model: nn.Module) -> None:
        """Raise UnsupportedModelError, naming what is supported, for a model whose forward this adapter does not
        know."""

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        """The transformer blocks, in order; each holds its ``merge_threshold`` / ``prune_threshold``."""
        raise NotImplementedError

    def view(self, model: nn.Module, blk: nn.Module) -> BlockView:
        raise NotImplementedError

    def num_prefix(self, model: nn.Module) -> int:
        """Tokens in front of the patch tokens (class, distillation, registers), never reduced."""
        raise NotImplementedError

    def has_class_token(self, model: nn.Module) -> bool:
        return self.num_prefix(model) > 0

    def pools_patches(self, model: nn.Module) -> bool:
        """The head reads the patch tokens (mean or attention pool): pruning keeps at least one."""
        return self.num_prefix(model) == 0

    def embed_dim(self, model: nn.Module) -> int:
        raise NotImplementedError

    def mlp_hidden(self, model: nn.Module) -> int:
        """h of eq. 11: the width with 2 C h = the first block's MLP MACs per token (fc1's width for a plain
        two-layer MLP; for a gated MLP, the width that gives its MACs). Every family's blocks have an ``mlp``."""
        return round(linear_macs(self.blocks(model)[0].mlp) / (2 * self.embed_dim(model)))

    def patch_grid(self, model: nn.Module) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(rows, columns) of patches at the model's image size, the patch size and the image size."""
        raise NotImplementedError

    def token_macs(self, model: nn.Module, blk: nn.Module, count_norm: bool) -> tuple[float, float]:
        """Per-token MACs of a block's attention branch (norm, projections) and MLP branch (norm, MLP)."""
        raise NotImplementedError

    def embed_macs(self, model: nn.Module, count_norm: bool, n: int) -> float:
        """MACs of the embedding (the patch convolution and any norm) per image of ``n`` patches."""
        raise NotImplementedError

    def final_macs(self, model: nn.Module, count_norm: bool) -> tuple[float, float]:
        """Per-token MACs after the last block (final norm, keys of an attention pool) and per-image MACs of the
        head."""
        raise NotImplementedError

    def library_hook(self, hook: Callable) -> bool:
        """A module hook that the family's library installs itself (transformers records hidden states with
        hooks on its layers), which the patched forward replaces: the forward does not refuse it."""
        return False

    def checkpointing(self, model: nn.Module) -> bool:
        """The model asks for gradient checkpointing (timm ``set_grad_checkpointing``, transformers
        ``gradient_checkpointing_enable``): train mode recomputes each block in the backward."""
        return False

    def forward(self, model: nn.Module, encode: Callable, *args: Any, **kwargs: Any) -> Any:
        """The family's forward with ``encode(model, tokens, taps)`` (``ltmp.engine.encode``: the blocks with the
        reduction step, returning the tokens leaving them, their state and the dense outputs after the blocks
        ``taps``) in place of its blocks."""
        raise NotImplementedError

    def extra_methods(self, encode: Callable) -> dict[str, Callable]:
        """More methods of the patched class (timm's ``forward_features``), given ``encode`` as :meth:`forward`."""
        return {}


def mean_pool(x: Tensor, state, skip: int) -> Tensor:
    """The mean of the surviving tokens from position ``skip`` on, each weighted by its size (the patches it
    stands for), so that a merged token counts as the patches it replaced: (B, N, C) -> (B, C). Equal to the plain
    mean over the patch tokens of an unreduced model."""
    w = state.size if state.keep is None else state.size * (state.keep > 0.5)  # (B, N)
    w = w[:, skip:]
    return (x[:, skip:] * w[..., None].to(x.dtype)).sum(1) / w.sum(1, keepdim=True).to(x.dtype)  # (B, C)


def zero_padding(x: Tensor, state) -> Tensor:
    """(B, N, C) tokens of an eval batch with the rows past each image's last token (padding up to the longest
    image) set to 0, as a norm after the blocks made them nonzero; train-mode tokens unchanged."""
    real = state.layout.real  # (B, N) or None
    return x if real is None else x * real[..., None].to(x.dtype)


def last_tap(model: nn.Module, encode: Callable, x: Tensor) -> tuple[Tensor, Any, Tensor | None]:
    """``encode(model, x)``, with the dense output after the last block when the model was patched with
    ``dense_output=True``: (tokens (B, N', C), state, dense tokens (B, N, C) or None)."""
    if not model.ltmp_config.dense_output:
        return (*encode(model, x)[:2], None)
    x, state, dense = encode(model, x, (-1,))
    return x, state, *dense.values()


def pool_bias(state, dtype: torch.dtype) -> Tensor | None:
    """The additive key bias (B, N) of an attention-pool head over the surviving tokens: log size (a merged token
    weighs as the patches it replaced, as in proportional attention) and -inf at removed or padded tokens; None
    when no token was reduced."""
    keep = None if state.keep is None else (state.keep > 0.5).to(dtype)
    return ops.key_bias(keep, state.size.log() if state.merged_once else None, dtype)
