"""FLOPs of (reduced) vision transformers: paper section 3.4, eq. 8-15.

Two kinds of numbers:

- **GMACs** in the paper's convention (multiply-adds as fvcore counts them, LayerNorm included): exact, per image,
  from the actual per-layer token counts of a forward (:func:`gmacs`), or from the padded counts a batched eval
  really executed (:func:`gmacs_executed`).
- **r_FLOPs** of eq. 13, the differentiable FLOPs reduction factor used by the budget loss (eq. 14); it is the
  paper's approximation (blocks only, eq. 9) written for any MLP width: ``phi_MSA(n, d) = 4nd^2 + 2n^2d`` (eq. 10)
  and ``phi_MLP(n, d) = 2ndh`` (eq. 11 with h = 4d gives 8nd^2).

The reduction step's own overhead (similarities, scores) is not counted, as in the paper and in ToMe.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .adapters import adapter_for
from .config import METHODS
from .errors import LtmpError
from .step import static_counts


@dataclasses.dataclass
class ViTSpec:
    """What a ViT costs, per token and per attention pair (built by :func:`vit_spec`)."""

    num_patches: int  # n: patch tokens entering the first block
    num_prefix: int  # class/distillation/register tokens, never reduced
    embed_dim: int  # d of eq. 10-13
    mlp_hidden: int  # h: MLP hidden width (4d in the paper)
    macs_embed: float  # patch embedding, per image
    macs_attn_token: list[float]  # per block: norm1 + qkv + proj (+ qk-norm) MACs per token
    macs_attn_pair: list[float]  # per block: QK^T and SV MACs per (query, key) pair
    macs_mlp_token: list[float]  # per block: norm2 + MLP MACs per token
    macs_final_token: float  # final norm, per token
    macs_head: float  # pooling norm and classifier, per image

    @property
    def depth(self) -> int:
        return len(self.macs_attn_token)


def vit_spec(model: nn.Module, count_norm: bool = True, image_size: tuple[int, int] | None = None) -> ViTSpec:
    """Per-token and per-pair multiply-accumulate counts of a supported ViT, in fvcore's convention.

    Linear layers count in*out MACs per token, the patch-embedding convolution its kernel MACs per patch, the two
    attention matmuls ``H * D`` MACs per (query, key) pair each, and LayerNorm 5 (4 without affine) per element,
    as fvcore does. Element-wise ops, softmax and GELU count nothing.

    Args:
        model: A supported ViT (patched or not).
        count_norm: Count LayerNorms (fvcore does; ``torch.utils.flop_counter`` does not).
        image_size: (height, width) of the images: the patches they make. None: the patches of the last forward
            of a patched model (timm ``dynamic_img_size`` runs at any size), else of the model's image size.
    """
    adapter = adapter_for(model)
    attn_token, mlp_token, pair = [], [], []
    for blk in adapter.blocks(model):
        a, m = adapter.token_macs(model, blk, count_norm)
        view = adapter.view(model, blk)
        attn_token.append(a)
        mlp_token.append(m)
        pair.append(2.0 * view.heads * view.head_dim)
    (gh, gw), (ph, pw), _ = adapter.patch_grid(model)
    n = gh * gw
    if image_size is not None:
        n = (image_size[0] // ph) * (image_size[1] // pw)
    elif getattr(model, "ltmp_record", None) is not None:
        n = model.ltmp_record.num_patches
    final, head = adapter.final_macs(model, count_norm)
    return ViTSpec(
        num_patches=n,
        num_prefix=adapter.num_prefix(model),
        embed_dim=adapter.embed_dim(model),
        mlp_hidden=adapter.mlp_hidden(model),
        macs_embed=adapter.embed_macs(model, count_norm, n),
        macs_attn_token=attn_token,
        macs_attn_pair=pair,
        macs_mlp_token=mlp_token,
        macs_final_token=final,
        macs_head=head,
    )


def macs_from_counts(spec: ViTSpec, tokens: Tensor) -> Tensor:
    """MACs of a forward whose block l sees ``tokens[..., l]`` tokens at attention and ``tokens[..., l+1]`` at MLP.

    Args:
        spec: The model's costs.
        tokens: (..., L + 1) token counts *including prefix tokens*: column 0 enters block 1, column l leaves
            block l (after its reduction).

    Returns:
        (...) MACs.
    """
    t = tokens.double()
    macs = torch.full(t.shape[:-1], spec.macs_embed + spec.macs_head, dtype=torch.float64, device=t.device)
    for layer in range(spec.depth):
        n_attn, n_mlp = t[..., layer], t[..., layer + 1]
        macs = macs + spec.macs_attn_token[layer] * n_attn + spec.macs_attn_pair[layer] * n_attn**2
        macs = macs + spec.macs_mlp_token[layer] * n_mlp
    return macs + spec.macs_final_token * t[..., -1]


def dense_gmacs(spec: ViTSpec) -> float:
    """GMACs of the unreduced model (DeiT-T/S/B: 1.258 / 4.608 / 17.583, fvcore)."""
    tokens = torch.full((spec.depth + 1,), spec.num_patches + spec.num_prefix, dtype=torch.float64)
    return float(macs_from_counts(spec, tokens)) / 1e9


def gmacs(spec: ViTSpec, kept: Tensor) -> Tensor:
    """Per-image GMACs of a reduced forward from its actual token counts.

    Args:
        spec: The model's costs.
        kept: (B, L) patch tokens left after each block (``ltmp.stats(model).kept``).

    Returns:
        (B,) GMACs.
    """
    first = torch.full_like(kept[:, :1], spec.num_patches)
    tokens = torch.cat([first, kept], dim=1) + spec.num_prefix  # (B, L + 1)
    return macs_from_counts(spec, tokens) / 1e9


def gmacs_executed(spec: ViTSpec, padded: list[int]) -> float:
    """GMACs per image that a batched eval really executed: every image runs at the padded length of its batch.

    Args:
        spec: The model's costs.
        padded: (L + 1) tokens in the tensor entering each block and leaving the last (``ltmp.stats(model).padded``).
    """
    return float(macs_from_counts(spec, torch.tensor(padded, dtype=torch.float64))) / 1e9


def r_flops_from_fracs(keep_frac: Tensor, num_patches: int, embed_dim: int, mlp_hidden: int) -> Tensor:
    """The FLOPs reduction factor of eq. 13, per image.

    ``r = 1/L sum_l (phi_MSA(m^(l-1) n) + phi_MLP(m^l n)) / phi_BLK(n)`` with eq. 10-12, where
    ``m^l`` is the fraction of the n patch tokens kept after block l (``m^0 = 1``).

    Args:
        keep_frac: (B, L + 1) kept fractions, differentiable (straight-through masks) in train mode.
        num_patches: n.
        embed_dim: d.
        mlp_hidden: h (4d gives the paper's eq. 13 exactly).

    Returns:
        (B,) r_FLOPs.
    """
    n, d, h = float(num_patches), float(embed_dim), float(mlp_hidden)

    def msa(m: Tensor) -> Tensor:  # eq. 10
        return 4 * m * n * d * d + 2 * (m * n) ** 2 * d

    def mlp(m: Tensor) -> Tensor:  # eq. 11
        return 2 * m * n * d * h

    blk = msa(torch.ones(())) + mlp(torch.ones(()))  # eq. 12
    depth = keep_frac.shape[1] - 1
    per_block = (msa(keep_frac[:, :-1]) + mlp(keep_frac[:, 1:])) / blk  # (B, L)
    return per_block.sum(1) / depth


def budget_loss_value(r_flops: Tensor, r_target: float) -> Tensor:
    """The budget-aware regularizer of eq. 14: ``(r_target - r_FLOPs)^2`` on the batch mean of r_FLOPs.

    It is combined with cross-entropy as ``L = L_CE + lambda L_reg`` (eq. 15).
    """
    if not 0.0 < r_target <= 1.0:
        raise LtmpError(f"r_target must lie in (0, 1], got {r_target}")
    return (r_target - r_flops) ** 2


def schedule_counts(method: str, schedule: Sequence[int], num_patches: int, keep_one: bool = False) -> list[int]:
    """Patch tokens left after each block under a fixed-rate method's per-layer schedule, by the counts the
    forward itself uses (``ltmp.step.static_counts``): ToMe merges ``min(r, t // 2)``; top-k pruning removes
    ``min(k, t)`` (``min(k, t - 1)`` for models that keep one patch token, see ``ltmp.patching.keeps_one``);
    ``topk-mp`` merges, then prunes, ``k`` each.
    """
    t, counts = num_patches, []
    for r in schedule:
        t -= sum(static_counts(METHODS[method][0], t, r, keep_one))
        counts.append(t)
    return counts


def rate_schedule(spec, target_gmacs: float, method: str = "tome", shape: Sequence[float] | None = None) -> list[int]:
    """A per-layer schedule of a fixed-rate method (``tome``, ``topk-prune``, ``topk-mp``) whose GMACs come
    closest to ``target_gmacs``.

    Their token counts are deterministic (:func:`schedule_counts`), so GMACs follow from the schedule. Schedules
    spread a fractional rate rho over the layers in proportion to ``shape`` (default: evenly; e.g. a learned
    model's mean tokens removed per layer, to hold its allocation fixed): ``r_l = floor(rho C_l) - floor(rho
    C_(l-1))`` with ``C_l`` the running sum of the shape, scaled so that it ends at L; rho is searched on a fine
    grid.
    """
    n, L = spec.num_patches, spec.depth
    weights = [1.0] * L if shape is None else [max(float(v), 0.0) for v in shape]
    if len(weights) != L:
        raise LtmpError(f"a schedule shape needs one weight per layer ({L}), got {len(weights)}")
    if sum(weights) <= 0:
        return [0] * L
    cum = [sum(weights[: l + 1]) * (L / sum(weights)) for l in range(L)]  # (l + 1 for the even shape)
    steps = 4000
    scheds = []
    for i in range(steps + 1):
        rho = n * i / steps
        ends = [math.floor(rho * c) for c in cum]
        scheds.append([e - (ends[l - 1] if l else 0) for l, e in enumerate(ends)])
    counts = torch.tensor([schedule_counts(method, s, n) for s in scheds], dtype=torch.float64)  # (S, L)
    err = (gmacs(spec, counts) - target_gmacs).abs()  # (S,)
    return scheds[int(err.argmin())]
