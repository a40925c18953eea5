"""Applies LTMP to timm ``VisionTransformer`` models. The only module that knows timm's internals.

``patch`` swaps the model's class for a subclass whose ``forward`` threads a token state through the blocks (no
shared mutable dict), and adds each block's learned thresholds as ``nn.Parameter``s named ``merge_threshold`` and
``prune_threshold``. The block weights and their names are untouched, so plain timm checkpoints still load.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .errors import LtmpError, UnsupportedModelError
from .flops import ViTSpec
from .reduce import (
    MERGE_GRADS,
    METHODS,
    ReduceConfig,
    StepResult,
    TokenState,
    initial_state,
    is_compiling,
    is_exporting,
    layer_rate,
    log_size,
    reduce_step,
    step_kind,
)

SUPPORTED = ("timm VisionTransformer models with standard Block/Attention and 'token' or 'avg' pooling "
             "(e.g. vit_*, deit_*, deit3_*, vit_*_reg*)")
THRESHOLD_NAMES = ("merge_threshold", "prune_threshold")


@dataclasses.dataclass
class Record:
    """The record of the last forward of a patched model, overwritten by every forward (read with ltmp.stats).

    All per-layer tensors are (B, L): one row per image, one column per block.
    """

    method: str  # the patched method
    merged: Tensor  # (B, L) tokens merged away in each block
    pruned: Tensor  # (B, L) tokens pruned in each block
    kept: Tensor  # (B, L) patch tokens left after each block
    keep_frac: Tensor  # (B, L + 1) fraction of patch tokens kept, m-bar of eq. 13 (column 0 is 1); differentiable
    padded: list[int]  # (L + 1) tokens in the tensor entering each block and leaving the last (executed compute)
    num_patches: int  # n of eq. 13
    num_prefix: int  # prefix tokens, always kept
    sources: list[Tensor] | None = None  # per block (B, N_l, n) patch membership of each token, if traced
    keeps: list[Tensor] | None = None  # per block (B, N_l) survivors, if traced


def _tname(obj) -> str:
    return type(obj).__name__


def _check_supported(model: nn.Module, cfg: ReduceConfig) -> None:
    from timm.layers import Attention
    from timm.models.vision_transformer import Block, VisionTransformer

    if not isinstance(model, VisionTransformer):
        kind = _tname(model)
        why = ""
        if "Eva" in kind or "Rope" in kind or "rope" in kind.lower():
            why = " (rotary position attention)"
        elif "RelPos" in kind or "Beit" in kind:
            why = " (relative-position attention)"
        raise UnsupportedModelError(f"ltmp.patch cannot handle {kind}{why}; it supports {SUPPORTED}")
    if getattr(model, "attn_pool", None) is not None:
        raise UnsupportedModelError(f"ltmp.patch cannot handle attention-pool heads (global_pool="
                                    f"'{model.global_pool}', MAP); it supports {SUPPORTED}")
    if model.global_pool not in ("token", "avg"):
        raise UnsupportedModelError(f"ltmp.patch cannot handle global_pool='{model.global_pool}'; "
                                    f"it supports {SUPPORTED}")
    for i, blk in enumerate(model.blocks):
        if type(blk).forward is not Block.forward:
            raise UnsupportedModelError(f"ltmp.patch cannot handle block {i} of type {_tname(blk)}; "
                                        f"it supports {SUPPORTED}")
        if type(blk.attn).forward is not Attention.forward:
            raise UnsupportedModelError(f"ltmp.patch cannot handle attention {_tname(blk.attn)} in block {i} "
                                        f"(rotary, relative-position and other attention variants are not "
                                        f"supported); it supports {SUPPORTED}")
    if cfg.importance == "cls" and cfg.needs_importance and getattr(model, "cls_token", None) is None:
        raise LtmpError("importance='cls' (class attention, eq. 16) needs a class token and this model has none; "
                        "use importance='mean'")


def _rate(value: int | Sequence[int] | None, depth: int, name: str) -> tuple[int, ...]:
    if value is None:
        raise LtmpError(f"this method needs {name}=: tokens per layer, an int or a list of {depth} ints")
    rates = (int(value),) * depth if isinstance(value, (int, float)) else tuple(int(v) for v in value)
    if len(rates) != depth or any(r < 0 for r in rates):
        raise LtmpError(f"{name}= must be a non-negative int or a list of {depth} non-negative ints, got {value}")
    return rates


def patch(
        model: nn.Module,
        method: str = "ltmp",
        *,
        tau: float = 0.1,
        importance: str = "mean",
        merge_threshold: float = 0.9,
        prune_threshold: float = 0.0,
        r: int | Sequence[int] | None = None,
        k: int | Sequence[int] | None = None,
        trace_source: bool = False,
        mask_grad: str = "secant",
        merge_grad: str = "average",
) -> nn.Module:
    """Make a timm VisionTransformer reduce its tokens with LTMP or a fixed-rate baseline, in place.

    In train mode every token stays in the tensor behind a straight-through keep mask (differentiable w.r.t. the
    thresholds, eq. 1-3, 5-7); in eval mode the same decisions really remove the tokens.

    Args:
        model: A timm ``VisionTransformer`` (also DeiT distilled, register and class-token-free variants).
        method: ``ltmp`` | ``ltpm`` | ``ltm`` | ``ltp`` (learned thresholds) or ``tome`` | ``topk-prune`` |
            ``topk-mp`` (fixed rate).
        tau: Temperature of the sigmoid surrogate gradient (eq. 2).
        importance: ``"mean"`` (mean column attention, eq. 17) or ``"cls"`` (class attention, eq. 16).
        merge_threshold: Initial merge threshold of every block (cosine similarity; ``inf`` merges nothing).
        prune_threshold: Initial prune threshold of every block (importance; ``-inf`` prunes nothing).
        r: ToMe's tokens merged per layer (int or per-layer list).
        k: Top-k baselines' tokens pruned (and merged, for ``topk-mp``) per layer.
        trace_source: Record which patches each token covers after every block (for visualization).
        mask_grad: Train mode: the bounded form of eq. 6's gradient to removed keys' masks, ``"secant"``,
            ``"clamp"`` or ``"eps"`` (the reference code's); see ``ltmp.ops.MaskedSoftmax``.
        merge_grad: Train mode: merge thresholds learn through the attention masks and the merged averages
            (``"average"``) or through the masks only (``"mask"``, as the reference code).

    Returns:
        The same model object, patched.
    """
    if method not in METHODS:
        raise LtmpError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    if importance not in ("mean", "cls"):
        raise LtmpError(f"unknown importance '{importance}'; choose 'mean' (eq. 17) or 'cls' (eq. 16)")
    if getattr(model, "ltmp_config", None) is not None:
        unpatch(model)
    depth = len(model.blocks) if hasattr(model, "blocks") else 0
    if mask_grad not in ops.MASK_GRADS:
        raise LtmpError(f"unknown mask_grad '{mask_grad}'; choose one of: {', '.join(ops.MASK_GRADS)}")
    if merge_grad not in MERGE_GRADS:
        raise LtmpError(f"unknown merge_grad '{merge_grad}'; choose one of: {', '.join(MERGE_GRADS)}")
    cfg = ReduceConfig(method=method, tau=float(tau), importance=importance,
                       num_prefix=int(getattr(model, "num_prefix_tokens", 0)), trace_source=trace_source,
                       mask_grad=mask_grad, merge_grad=merge_grad)
    _check_supported(model, cfg)
    if cfg.learned:
        if r is not None or k is not None:
            raise LtmpError(f"method '{method}' learns thresholds; r= and k= belong to tome/topk-prune/topk-mp")
    elif method == "tome":
        cfg.rate = _rate(r, depth, "r")
    else:
        cfg.rate = _rate(k, depth, "k")
    cfg.keep_one = model.global_pool == "avg" or cfg.num_prefix == 0

    ref = next(model.parameters())
    for blk in model.blocks:
        if cfg.learned and "merge" in cfg.ops:
            blk.merge_threshold = nn.Parameter(torch.tensor(float(merge_threshold), device=ref.device))
        if cfg.learned and "prune" in cfg.ops:
            blk.prune_threshold = nn.Parameter(torch.tensor(float(prune_threshold), device=ref.device))
    model.ltmp_config = cfg
    model.ltmp_record = None
    model._ltmp_hook = model.register_load_state_dict_post_hook(_allow_missing_thresholds)
    model.__class__ = _patched_class(type(model))

    does_nothing = (cfg.rate is not None and not any(cfg.rate)) or (
        cfg.learned and ("merge" not in cfg.ops or merge_threshold == math.inf)
        and ("prune" not in cfg.ops or prune_threshold == -math.inf))
    if does_nothing:
        warnings.warn(f"ltmp.patch(method='{method}') reduces no tokens with these settings "
                      f"(r/k of 0, or thresholds merge=+inf and prune=-inf)", stacklevel=2)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the plain timm model: its class, and no threshold parameters."""
    if getattr(model, "ltmp_config", None) is None:
        return model
    for blk in model.blocks:
        for name in THRESHOLD_NAMES:
            if name in blk._parameters:
                del blk._parameters[name]
    model._ltmp_hook.remove()
    for name in ("ltmp_config", "ltmp_record", "_ltmp_hook"):
        delattr(model, name)
    model.__class__ = model.__class__._ltmp_base
    return model


def _allow_missing_thresholds(module: nn.Module, incompatible) -> None:
    """A plain timm state dict (without thresholds) still loads strictly into a patched model."""
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.endswith(THRESHOLD_NAMES)]


_CLASSES: dict[type, type] = {}


def _patched_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LTMP{base.__name__}", (_PatchedViT, base), {"_ltmp_base": base})
    return _CLASSES[base]


class _PatchedViT:
    """Mixin placed in front of the model's own class by :func:`patch`."""

    def forward_features(self, x: Tensor) -> Tensor:
        return _features(self, x)[0]

    def forward(self, x: Tensor) -> Tensor:
        x, state = _features(self, x)
        return _head(self, x, state)


def _features(model, x: Tensor) -> tuple[Tensor, TokenState]:
    cfg: ReduceConfig = model.ltmp_config
    x = model.patch_embed(x)
    x = model._pos_embed(x)
    x = model.patch_drop(x)
    x = model.norm_pre(x)  # (B, N, C)
    n = x.shape[1] - cfg.num_prefix
    state = initial_state(x, cfg.num_prefix, compact=not model.training, trace_source=cfg.trace_source)
    steps: list[StepResult] = []
    padded = [x.shape[1]]
    sources, keeps = ([], []) if cfg.trace_source else (None, None)
    kind = step_kind(cfg, x.shape[0], model.training)  # the forward's execution plan, chosen once
    for i, blk in enumerate(model.blocks):
        x, state, step = _block(blk, x, state, cfg, i, layer_rate(cfg.rate, i), kind)
        steps.append(step)
        padded.append(x.shape[1])
        if sources is not None:
            sources.append(state.source[:, :, cfg.num_prefix:])
            keeps.append(state.keep > 0.5)
    x = model.norm(x)
    if is_exporting() or torch.jit.is_tracing():  # symbolic counts: exported graphs have no record
        return x, state
    if isinstance(steps[0].kept, int):  # counts known on the host (the single-image and fixed-rate steps)
        counts = torch.tensor([[s.merged, s.pruned, s.kept] for s in steps], device=x.device).T[:, None]  # (3, 1, L)
        merged, pruned, kept = counts.repeat(1, x.shape[0], 1).unbind(0)  # (B, L) each
        keep_frac = torch.cat([kept.new_full((x.shape[0], 1), n), kept], 1).to(state.size.dtype) / n  # (B, L + 1)
    else:  # the masked step: per-image counts as tensors (the step kind is the same in every block)
        merged, pruned, kept = (torch.stack([getattr(s, f) for s in steps], 1) for f in ("merged", "pruned", "kept"))
        ones = x.new_ones(x.shape[0], dtype=state.keep.dtype)
        keep_frac = torch.stack([ones] + [s.kept_frac / n for s in steps], 1)
    model.ltmp_record = Record(
        method=cfg.method,
        merged=merged,
        pruned=pruned,
        kept=kept,
        keep_frac=keep_frac,
        padded=padded, num_patches=n, num_prefix=cfg.num_prefix, sources=sources, keeps=keeps)
    return x, state


def _head(model, x: Tensor, state: TokenState) -> Tensor:
    if model.global_pool != "avg":
        return model.forward_head(x)  # class (and distillation) tokens never move: timm's head works as is
    w = state.size * (state.keep > 0.5)  # (B, N) size-weighted mean over surviving tokens
    if not model.pool_include_prefix:
        x, w = x[:, model.num_prefix_tokens:], w[:, model.num_prefix_tokens:]
    x = (x * w[..., None].to(x.dtype)).sum(1) / w.sum(1, keepdim=True).to(x.dtype)  # (B, C)
    x = model.fc_norm(x)
    x = model.head_drop(x)
    return model.head(x)


def _packed_index(state: TokenState, cfg: ReduceConfig, always: bool = False) -> Tensor | None:
    """Flat indices of the real tokens of a padded eval batch (B * N -> T), or None when there is no padding to
    skip (or too little, ``cfg.execution.pack_above``, unless ``always``; under torch.compile always, so that no
    guard depends on the counts). Packing makes the token-wise layers (norms, qkv, proj, MLP) cost the batch's
    *mean* token count instead of its longest."""
    if not (state.compact and state.masked_once) or state.real is None or (
            not (always or is_compiling()) and state.real >= (1 - cfg.execution.pack_above) * state.keep.numel()):
        return None
    if state.packed is not None and state.packed[0] is state.keep:
        return state.packed[1]
    alive = (state.keep > 0.5).flatten()  # (B * N,)
    if hasattr(torch, "nonzero_static"):  # the count is known on the host: no synchronisation
        idx = torch.nonzero_static(alive, size=state.real).squeeze(1)  # (T,)
    else:
        idx = alive.nonzero().squeeze(1)  # (T,)
    state.packed = (state.keep, idx)
    return idx


def _tokenwise(fn, x: Tensor, idx: Tensor | None, residual: Tensor | None = None) -> Tensor:
    """``fn`` applied to the tokens of x (B, N, C), plus ``residual`` (B, N, C') if given; only at the packed
    indices ``idx`` if given (padding gets 0, or keeps its residual)."""
    if idx is None:
        return fn(x) if residual is None else residual + fn(x)
    B, N, _ = x.shape
    out = fn(x.reshape(B * N, -1).index_select(0, idx))  # (T, C')
    if residual is not None:  # one pass: the residual stream with the real tokens' outputs added in
        return residual.reshape(B * N, -1).index_add(0, idx, out.to(residual.dtype)).view(B, N, -1)  # (B, N, C')
    return out.new_zeros(B * N, out.shape[-1]).index_copy_(0, idx, out).view(B, N, -1)  # (B, N, C')


def _identity(t: Tensor) -> Tensor:
    return t


def _buckets(state: TokenState, attn, cfg: ReduceConfig) -> list[tuple[list[int], int]] | None:
    """Groups of a padded eval batch for attention (:func:`ltmp.ops.plan_buckets` with ``cfg.execution``'s
    ``group_macs`` and ``max_buckets``), or None to run it whole.

    Only without gradients (``torch.no_grad()``/``inference_mode``, as ``ltmp eval``/``bench`` run), and never
    while tracing, exporting or compiling (the groups depend on the image: each new plan would recompile)."""
    e = cfg.execution
    if not (state.compact and state.masked_once) or state.counts is None or is_exporting() \
            or torch.jit.is_tracing() or is_compiling() or torch.is_grad_enabled() \
            or state.keep.device.type not in e.group_macs:
        return None
    return ops.plan_buckets(state.counts, 2.0 * attn.attn_dim, e.group_macs[state.keep.device.type], e.max_buckets)


def _attention(attn, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, ls: Tensor | None, cfg: ReduceConfig):
    """Attention of eq. 5-7 on (B, H, N, D) q, k, v: the output (B, N, C) and, if the method prunes, the
    importance scores (B, N) of eq. 16/17, taken while the (B, H, N, N) probabilities are still in cache, or, with
    ``Execution.importance_from_lse`` in eval without gradients, from a fused kernel's log-sum-exp."""
    B, _, N, _ = q.shape
    importance = None
    e = cfg.execution
    hard = keep is None or not keep.requires_grad
    fused = None  # (out, lse) of a fused kernel
    if cfg.needs_importance and e.importance_from_lse and e.fused_attention and hard \
            and not torch.is_grad_enabled() and not attn.training and not is_exporting():
        bias = ops.key_bias(keep, ls, q.dtype)  # (B, N) or None
        bias = None if bias is None else bias[:, None, None, :]  # (B, 1, 1, N)
        fused = ops.attention_with_lse(q, k, v, attn.scale, bias)
    if fused is not None:
        o, lse = fused  # (B, H, N, D), (B, H, N)
        importance = ops.importance_from_lse(q, k, lse, attn.scale, bias, keep, cfg.importance)  # (B, N)
    elif cfg.needs_importance or not (attn.fused_attn and e.fused_attention) or not hard \
            or is_exporting():  # SDPA's mask broadcasting would guard on the symbolic token count
        o, probs = ops.masked_attention(q, k, v, attn.scale, keep, ls, attn.attn_drop, cfg.mask_grad)  # (B, H, N, D)
        if cfg.needs_importance:
            importance = ops.importance_scores(probs, keep, cfg.importance)  # (B, N)
        del probs
    else:  # hard masks only: a fused kernel with an additive bias does the same
        bias = ops.key_bias(keep, ls, q.dtype)  # (B, N) or None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias[:, None, None, :],
                                           dropout_p=attn.attn_drop.p if attn.training else 0.0)
    return o.transpose(1, 2).reshape(B, N, attn.attn_dim), importance  # (B, N, C), (B, N) or None


def _grouped_attention(blk, x: Tensor, state: TokenState, cfg: ReduceConfig, buckets) -> tuple:
    """The attention half of a block for a padded eval batch, run per group of similar token counts.

    Token-wise layers run packed (the T real tokens); each group gathers its q, k, v straight from the packed
    qkv, padded only to the group's longest image (padding rows repeat a real token and are masked), and its
    output goes straight back to the packed rows. The result of :func:`_attention` on the whole padded batch, up
    to rounding (a group without padding may run another kernel). The per-group index tensors are built from
    host lists (a blocking copy on GPUs, where grouping is off; see ``Execution.group_macs``).

    Returns:
        x after the attention residual (B, N, C), importance (B, N) or None, and the merge metric (B, N, D).
    """
    attn = blk.attn
    B, N, C = x.shape
    H, D = attn.num_heads, attn.head_dim
    dev = x.device
    idx = _packed_index(state, cfg, always=True)  # (T,)
    T = idx.shape[0]
    qkv = attn.qkv(blk.norm1(x.reshape(B * N, C).index_select(0, idx)))  # (T, 3 * H * D)
    ls = log_size(state)
    starts = [0]
    for c in state.counts[:-1]:
        starts.append(starts[-1] + c)
    o = qkv.new_empty(T + 1, H * D)  # (T + 1, H * D); row T takes the padding rows' outputs
    importance = None  # (B, N) once a group has scores
    metric = qkv.new_zeros(B, N, D) if cfg.needs_metric else None  # (B, N, D)
    for rows, n in buckets:
        sel = torch.tensor(rows, device=dev)  # (b,)
        count = torch.tensor([state.counts[i] for i in rows], device=dev)  # (b,)
        start = torch.tensor([starts[i] for i in rows], device=dev)  # (b,)
        pos = torch.arange(n, device=dev)  # (n,)
        real = pos < count[:, None]  # (b, n)
        at = start[:, None] + torch.minimum(pos, count[:, None] - 1)  # (b, n) packed row of each position
        g = qkv.index_select(0, at.flatten()).view(len(rows), n, 3, H, D).permute(2, 0, 3, 1, 4)  # (3, b, H, n, D)
        q, k, v = g.unbind(0)  # (b, H, n, D) each
        q, k = attn.q_norm(q), attn.k_norm(k)
        padded = not all(state.counts[i] == n for i in rows)
        og, ig = _attention(attn, q, k, v, real.to(state.keep.dtype) if padded else None,
                            None if ls is None else ls[sel, :n], cfg)  # (b, n, H * D), (b, n)
        o.index_copy_(0, torch.where(real, at, T).flatten(), og.reshape(-1, H * D).to(o.dtype))
        if ig is not None:
            if importance is None:
                importance = ig.new_zeros(B, N)  # (B, N)
            importance[sel, :n] = ig.to(importance.dtype)
        if cfg.needs_metric:
            metric[sel, :n] = k.mean(1).to(metric.dtype)  # (b, n, D)
    norm = getattr(attn, "norm", None) or _identity
    out = blk.drop_path1(blk.ls1(attn.proj_drop(attn.proj(norm(o[:T])))))  # (T, C)
    x = x.reshape(B * N, C).index_add(0, idx, out.to(x.dtype)).view(B, N, C)  # (B, N, C)
    return x, importance, metric


def _block(blk, x: Tensor, state: TokenState, cfg: ReduceConfig, layer: int, rate: int, kind: str):
    """timm ``Block.forward`` with the reduction step between attention and MLP (paper Figure 2); ``rate`` is the
    fixed-rate methods' tokens for this block (0 for learned thresholds), ``kind`` the forward's step kind."""
    attn = blk.attn
    B, N, _ = x.shape
    buckets = _buckets(state, attn, cfg) if getattr(attn, "gate", None) is None else None
    if buckets is not None:
        x, importance, metric = _grouped_attention(blk, x, state, cfg, buckets)
    else:
        x, importance, metric = _whole_attention(blk, x, state, cfg)
    x, state, step = reduce_step(x, state, cfg, layer, importance, metric, getattr(blk, "merge_threshold", None),
                                 getattr(blk, "prune_threshold", None), rate, kind)
    x = _tokenwise(lambda t: blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(t)))), x, _packed_index(state, cfg),
                   x)  # (B, N', C)
    return x, state, step


def _whole_attention(blk, x: Tensor, state: TokenState, cfg: ReduceConfig) -> tuple:
    """The attention half of a block on the whole (padded) batch: x after the attention residual (B, N, C), the
    importance (B, N) or None, and the merge metric (B, N, D) or None."""
    attn = blk.attn
    B, N, _ = x.shape
    gate = None
    if getattr(attn, "gate", None) is not None:
        y = blk.norm1(x)  # (B, N, C)
        gate, qkv = attn.gate(y).sigmoid(), attn.qkv(y)  # (B, N, C), (B, N, 3C)
        idx = None
    else:
        idx = _packed_index(state, cfg)
        qkv = _tokenwise(lambda t: attn.qkv(blk.norm1(t)), x, idx)  # (B, N, 3C)
    qkv = qkv.reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, D)
    if cfg.needs_importance:  # explicit attention (or the lse pass): one copy of q, k and v, not one each
        qkv = qkv.contiguous()
    q, k, v = qkv.unbind(0)  # (B, H, N, D) each
    q, k = attn.q_norm(q), attn.k_norm(k)
    keep = state.keep if state.masked_once else None
    o, importance = _attention(attn, q, k, v, keep, log_size(state), cfg)  # (B, N, C), (B, N) or None
    norm = getattr(attn, "norm", None) or _identity
    if gate is not None:
        x = x + blk.drop_path1(blk.ls1(attn.proj_drop(attn.proj(norm(o) * gate))))  # (B, N, C)
    else:
        x = _tokenwise(lambda t: blk.drop_path1(blk.ls1(attn.proj_drop(attn.proj(norm(t))))), o, idx, x)  # (B, N, C)
    return x, importance, k.mean(1) if cfg.needs_metric else None  # (B, N, C), (B, N), (B, N, D)


@torch.no_grad()
def forward_cut(model: nn.Module, x: Tensor, counts: Sequence[int]) -> Tensor:
    """An unpatched timm ViT whose tokens are simply cut to ``counts[l]`` after block l's attention: the same
    token counts as a reduction, with no reduction step. Not a useful model (it drops the last tokens); it times
    what the counts alone cost, the zero-overhead bound of a reduced model (``benchmarks/speed.py``).

    Args:
        model: An unpatched timm VisionTransformer.
        x: (B, 3, H, W) images.
        counts: Tokens (prefix included) leaving each block.
    """
    if len(counts) != len(model.blocks):
        raise LtmpError(f"forward_cut needs one token count per block ({len(model.blocks)}), got {len(counts)}")
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))  # (B, N, C)
    for blk, n in zip(model.blocks, counts):
        x = x + blk.drop_path1(blk.ls1(blk.attn(blk.norm1(x))))  # (B, N, C)
        x = x[:, :n]  # (B, n, C)
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    return model.forward_head(model.norm(x))


def score_ranges(model: nn.Module) -> dict[str, tuple[float, float]]:
    """The range of the scores each kind of threshold compares: cosine similarities in [-1, 1] for merge
    thresholds; importance in [0, 1] (mean column attention, eq. 17) or [0, heads] (class attention summed over
    heads, eq. 16) for prune thresholds."""
    heads = float(model.blocks[0].attn.num_heads) if model.ltmp_config.importance == "cls" else 1.0
    return {"merge_threshold": (-1.0, 1.0), "prune_threshold": (0.0, heads)}


def mlp_hidden(model: nn.Module) -> int:
    """h of eq. 11: the MLP's hidden width (timm's ``Mlp.fc1``; 4d otherwise)."""
    mlp = model.blocks[0].mlp
    return int(mlp.fc1.out_features) if hasattr(mlp, "fc1") else 4 * int(model.embed_dim)


def vit_spec(model: nn.Module, count_norm: bool = True) -> ViTSpec:
    """Per-token and per-pair multiply-accumulate counts of a timm ViT, in fvcore's convention.

    Linear layers count in*out MACs per token, the patch-embedding convolution its kernel MACs per patch, the two
    attention matmuls ``attn_dim`` MACs per (query, key) pair each, and LayerNorm 5 (4 without affine) per element,
    as fvcore does. Element-wise ops, softmax and GELU count nothing.

    Args:
        model: A timm VisionTransformer (patched or not).
        count_norm: Count LayerNorms (fvcore does; ``torch.utils.flop_counter`` does not).
    """

    def linear_macs(mod: nn.Module) -> float:
        return float(sum(m.in_features * m.out_features for m in mod.modules() if isinstance(m, nn.Linear)))

    def norm_macs(mod: nn.Module) -> float:
        if not count_norm:
            return 0.0
        total = 0.0
        for m in mod.modules():
            if isinstance(m, nn.LayerNorm):
                total += (5 if m.elementwise_affine else 4) * math.prod(m.normalized_shape)
        return total

    blocks = list(model.blocks)
    pe = model.patch_embed.proj
    n = model.patch_embed.num_patches
    embed = n * pe.out_channels * (pe.in_channels // pe.groups) * math.prod(pe.kernel_size)
    embed += n * norm_macs(model.patch_embed)
    attn_token, mlp_token, pair = [], [], []
    for blk in blocks:
        a = blk.attn
        heads_norm = a.num_heads * (norm_macs(a.q_norm) + norm_macs(a.k_norm))
        other = norm_macs(getattr(a, "norm", nn.Identity()))
        attn_token.append(norm_macs(blk.norm1) + linear_macs(a) + heads_norm + other)
        pair.append(2.0 * a.attn_dim)
        mlp_token.append(norm_macs(blk.norm2) + linear_macs(blk.mlp) + norm_macs(blk.mlp))
    num_classes = getattr(model, "num_classes", 0)
    heads = linear_macs(model.head) + linear_macs(getattr(model, "head_dist", nn.Identity()))
    return ViTSpec(
        num_patches=n,
        num_prefix=int(model.num_prefix_tokens),
        embed_dim=int(model.embed_dim),
        mlp_hidden=int(blocks[0].mlp.fc1.out_features) if hasattr(blocks[0].mlp, "fc1") else 4 * model.embed_dim,
        macs_embed=float(embed),
        macs_attn_token=attn_token,
        macs_attn_pair=pair,
        macs_mlp_token=mlp_token,
        macs_final_token=norm_macs(model.norm),
        macs_head=norm_macs(model.fc_norm) + heads if num_classes else norm_macs(model.fc_norm),
    )
