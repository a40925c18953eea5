"""Applies LTMP to a vision transformer of any supported family (:mod:`ltmp.adapters`), in place.

``patch`` swaps the model's class for a subclass whose ``forward`` threads a token state through the blocks (no
shared mutable dict), and adds each block's learned thresholds as ``nn.Parameter``s named ``merge_threshold`` and
``prune_threshold``. The block weights and their names are untouched, so the family's plain checkpoints still load.
This module never learns a family's name: the model's adapter says where blocks, attention, norms and prefix
tokens are (:class:`ltmp.adapters.BlockView`).
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .adapters import Adapter, BlockView, adapter_for
from .errors import LtmpError
from .flops import ViTSpec
from .reduce import (
    MERGE_GRADS,
    METHODS,
    ReduceConfig,
    SplitCounts,
    StepResult,
    TokenState,
    initial_state,
    is_compiling,
    is_exporting,
    layer_rate,
    log_size,
    padded_tokens,
    read_splits,
    real_rows,
    reduce_step,
    size_masks_padding,
    step_kind,
)

THRESHOLD_NAMES = ("merge_threshold", "prune_threshold")


class Record:
    """The record of the last forward of a patched model, overwritten by every forward (read with ltmp.stats).

    All per-layer tensors are (B, L): one row per image, one column per block. They are built on first read, from
    the blocks' counts (on the host in eval without gradients, (B,) tensors otherwise), so that a forward nobody
    inspects launches no operators for its record.
    """

    def __init__(self, method: str, padded: list[int], num_patches: int, num_prefix: int,
                 sources: list[Tensor] | None = None, keeps: list[Tensor] | None = None,
                 host: tuple[list[tuple], int, torch.device, torch.dtype] | None = None,
                 steps: tuple[list[StepResult], torch.dtype] | None = None):
        self.method = method  # the patched method
        self.padded = padded  # (L + 1) tokens in the tensor entering each block and leaving the last (executed compute)
        self.num_patches = num_patches  # n of eq. 13
        self.num_prefix = num_prefix  # prefix tokens, always kept
        self.sources = sources  # per block (B, N_l, n) patch membership of each token, if traced
        self.keeps = keeps  # per block (B, N_l) survivors, if traced
        self._counts = None  # (merged, pruned, kept, keep_frac) once built
        self._host = host  # per block (merged, pruned, kept), ints or per-image lists; the batch size, device and
        #                    keep_frac dtype
        self._steps = steps  # or: per block the (B,) counts, and the dtype of the keep mask

    def _built(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self._counts is None:
            n = self.num_patches
            if self._host is not None:
                rows, batch, device, dtype = self._host
                splits = [row[0] for row in rows if isinstance(row[0], SplitCounts)]
                read_splits(splits)  # the merged / pruned split of compact steps of two operations, one host read
                rows = [(*row[0].merged_pruned(), row[2]) if isinstance(row[0], SplitCounts) else row
                        for row in rows]
                per_image = [[c if isinstance(c, list) else [c] * batch for c in row] for row in rows]  # (L, 3, B)
                merged, pruned, kept = torch.tensor(per_image, device=device).permute(1, 2, 0).unbind(0)  # (B, L) each
                keep_frac = torch.cat([kept.new_full((batch, 1), n), kept], 1).to(dtype) / n  # (B, L + 1)
            else:
                steps, dtype = self._steps
                merged, pruned, kept = (torch.stack([getattr(s, f) for s in steps], 1)
                                        for f in ("merged", "pruned", "kept"))  # (B, L) each
                frac = torch.stack([s.kept_frac for s in steps], 1).to(dtype) / n  # (B, L), as the host form
                keep_frac = torch.cat([torch.ones_like(frac[:, :1], dtype=dtype), frac], 1)  # (B, L + 1)
            self._counts, self._host, self._steps = (merged, pruned, kept, keep_frac), None, None
        return self._counts

    @property
    def merged(self) -> Tensor:
        """(B, L) tokens merged away in each block."""
        return self._built()[0]

    @property
    def pruned(self) -> Tensor:
        """(B, L) tokens pruned in each block."""
        return self._built()[1]

    @property
    def kept(self) -> Tensor:
        """(B, L) patch tokens left after each block."""
        return self._built()[2]

    @property
    def keep_frac(self) -> Tensor:
        """(B, L + 1) fraction of patch tokens kept, m-bar of eq. 13 (column 0 is 1); differentiable in train mode."""
        return self._built()[3]


def _rate(value: int | Sequence[int] | None, depth: int, name: str) -> tuple[int, ...]:
    if value is None:
        raise LtmpError(f"this method needs {name}=: tokens per layer, an int or a list of {depth} ints")
    rates = (int(value),) * depth if isinstance(value, (int, float)) else tuple(int(v) for v in value)
    if len(rates) != depth or any(r < 0 for r in rates):
        raise LtmpError(f"{name}= must be a non-negative int or a list of {depth} non-negative ints, got {value}")
    return rates


def blocks(model: nn.Module) -> Sequence[nn.Module]:
    """The transformer blocks of a supported model (patched or not), where its thresholds live."""
    return adapter_for(model).blocks(model)


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
    """Make a vision transformer reduce its tokens with LTMP or a fixed-rate baseline, in place.

    In train mode every token stays in the tensor behind a straight-through keep mask (differentiable w.r.t. the
    thresholds, eq. 1-3, 5-7); in eval mode the same decisions really remove the tokens.

    Args:
        model: A timm ``VisionTransformer`` (also DeiT distilled, register, class-token-free and attention-pool
            variants); a Hugging Face transformers ViT, DeiT, DINOv2, CLIP or SigLIP vision model; or OpenCLIP's
            ``VisionTransformer`` (``open_clip.create_model(...).visual``). See :mod:`ltmp.adapters`.
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
        The same model object, patched. It returns what the unpatched model returns (logits for timm, the
        family's output object for transformers, embeddings for OpenCLIP).
    """
    if method not in METHODS:
        raise LtmpError(f"unknown method '{method}'; choose one of: {', '.join(METHODS)}")
    if importance not in ("mean", "cls"):
        raise LtmpError(f"unknown importance '{importance}'; choose 'mean' (eq. 17) or 'cls' (eq. 16)")
    if getattr(model, "ltmp_config", None) is not None:
        unpatch(model)
    if mask_grad not in ops.MASK_GRADS:
        raise LtmpError(f"unknown mask_grad '{mask_grad}'; choose one of: {', '.join(ops.MASK_GRADS)}")
    if merge_grad not in MERGE_GRADS:
        raise LtmpError(f"unknown merge_grad '{merge_grad}'; choose one of: {', '.join(MERGE_GRADS)}")
    adapter = adapter_for(model, check=True)
    blks = adapter.blocks(model)
    depth = len(blks)
    cfg = ReduceConfig(method=method, tau=float(tau), importance=importance, num_prefix=adapter.num_prefix(model),
                       trace_source=trace_source, mask_grad=mask_grad, merge_grad=merge_grad)
    if cfg.importance == "cls" and cfg.needs_importance and not adapter.has_class_token(model):
        raise LtmpError("importance='cls' (class attention, eq. 16) needs a class token and this model has none; "
                        "use importance='mean'")
    if cfg.learned:
        if r is not None or k is not None:
            raise LtmpError(f"method '{method}' learns thresholds; r= and k= belong to tome/topk-prune/topk-mp")
    elif method == "tome":
        cfg.rate = _rate(r, depth, "r")
    else:
        cfg.rate = _rate(k, depth, "k")
    cfg.keep_one = adapter.pools_patches(model) or cfg.num_prefix == 0

    ref = next(model.parameters())
    for blk in blks:
        if cfg.learned and "merge" in cfg.ops:
            blk.merge_threshold = nn.Parameter(torch.tensor(float(merge_threshold), device=ref.device))
        if cfg.learned and "prune" in cfg.ops:
            blk.prune_threshold = nn.Parameter(torch.tensor(float(prune_threshold), device=ref.device))
    model.ltmp_config = cfg
    model.ltmp_record = None
    model._ltmp_hook = model.register_load_state_dict_post_hook(_allow_missing_thresholds)
    model.__class__ = _patched_class(type(model), adapter)

    does_nothing = (cfg.rate is not None and not any(cfg.rate)) or (
        cfg.learned and ("merge" not in cfg.ops or merge_threshold == math.inf)
        and ("prune" not in cfg.ops or prune_threshold == -math.inf))
    if does_nothing:
        warnings.warn(f"ltmp.patch(method='{method}') reduces no tokens with these settings "
                      f"(r/k of 0, or thresholds merge=+inf and prune=-inf)", stacklevel=2)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the plain model: its class, and no threshold parameters."""
    if getattr(model, "ltmp_config", None) is None:
        return model
    for blk in blocks(model):
        for name in THRESHOLD_NAMES:
            if name in blk._parameters:
                del blk._parameters[name]
    model._ltmp_hook.remove()
    for name in ("ltmp_config", "ltmp_record", "_ltmp_hook"):
        delattr(model, name)
    model.__class__ = model.__class__._ltmp_base
    return model


def _allow_missing_thresholds(module: nn.Module, incompatible) -> None:
    """A plain state dict (without thresholds) still loads strictly into a patched model."""
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.endswith(THRESHOLD_NAMES)]


_CLASSES: dict[type, type] = {}


def _patched_forward(self, *args, **kwargs):
    return type(self)._ltmp_adapter.forward(self, *args, **kwargs)


def _patched_class(base: type, adapter: Adapter) -> type:
    if base not in _CLASSES:
        body = {"_ltmp_base": base, "_ltmp_adapter": adapter, "forward": _patched_forward,
                "__module__": base.__module__, "__doc__": base.__doc__, **adapter.extra_methods()}
        _CLASSES[base] = type(f"LTMP{base.__name__}", (base,), body)
    return _CLASSES[base]


def encode(model: nn.Module, x: Tensor) -> tuple[Tensor, TokenState]:
    """The blocks of a patched model with the reduction step in each, on embedded tokens, and the record.

    Args:
        model: A patched model.
        x: (B, N, C) tokens entering the first block, prefix tokens first.

    Returns:
        The tokens leaving the last block (B, N', C), before the final norm, and their state (sizes, survivors).
    """
    cfg: ReduceConfig = model.ltmp_config
    adapter: Adapter = type(model)._ltmp_adapter
    n = x.shape[1] - cfg.num_prefix
    state = initial_state(x, cfg.num_prefix, compact=not model.training, trace_source=cfg.trace_source)
    steps: list[StepResult] = []
    padded = [x.shape[1]]
    sources, keeps = ([], []) if cfg.trace_source else (None, None)
    kind = step_kind(cfg, x.shape[0], model.training)  # the forward's execution plan, chosen once
    for i, blk in enumerate(adapter.blocks(model)):
        x, state, step = _block(blk, adapter.view(model, blk), x, state, cfg, i, layer_rate(cfg.rate, i), kind)
        steps.append(step)
        padded.append(state.keep.shape[1])
        if sources is not None:
            sources.append(state.source[:, :, cfg.num_prefix:])
            keeps.append(state.keep > 0.5)
    x = padded_tokens(x, state)  # (B, N', C)
    if is_exporting() or torch.jit.is_tracing():  # symbolic counts: exported graphs have no record
        return x, state
    rec = dict(method=cfg.method, padded=padded, num_patches=n, num_prefix=cfg.num_prefix, sources=sources,
               keeps=keeps)
    if not isinstance(steps[0].kept, Tensor):  # counts known on the host (every eval step without gradients)
        rows = [(s.merged, s.pruned, s.kept) for s in steps]
        model.ltmp_record = Record(host=(rows, x.shape[0], x.device, state.size.dtype), **rec)
    else:  # per-image counts as (B,) tensors (the step kind is the same in every block)
        model.ltmp_record = Record(steps=(steps, state.keep.dtype), **rec)
        if is_compiling() or steps[0].kept_frac.requires_grad:  # built now: inside the graph (its outputs are the
            # four tensors, not every block's counts), and with its gradients, whatever mode a first read is in
            model.ltmp_record._built()
    return x, state


def mean_pool(x: Tensor, state: TokenState, skip: int) -> Tensor:
    """The mean of the surviving tokens from position ``skip`` on, each weighted by its size (the patches it
    stands for), so that a merged token counts as the patches it replaced: (B, N, C) -> (B, C). Equal to the plain
    mean over the patch tokens of an unreduced model."""
    w = (state.size * (state.keep > 0.5))[:, skip:]  # (B, N - skip)
    return (x[:, skip:] * w[..., None].to(x.dtype)).sum(1) / w.sum(1, keepdim=True).to(x.dtype)  # (B, C)


def pool_bias(state: TokenState, dtype: torch.dtype) -> Tensor | None:
    """The additive key bias (B, N) of an attention-pool head over the surviving tokens: log size (so a merged
    token weighs as the patches it replaced, as in proportional attention) and -inf at removed or padded tokens;
    None when no token was reduced."""
    keep = (state.keep > 0.5).to(dtype) if state.masked_once else None
    return ops.key_bias(keep, log_size(state), dtype)


def _packed_index(state: TokenState, cfg: ReduceConfig, always: bool = False) -> ops.PackedRows | None:
    """The real tokens of a padded eval batch (their flat indices, B * N -> T), or None when there is no padding to
    skip (or too little, ``cfg.execution.pack_above``, unless ``always``; under torch.compile always, so that no
    guard depends on the counts). Packing makes the token-wise layers (norms, qkv, proj, MLP) cost the batch's
    *mean* token count instead of its longest."""
    if not (state.compact and state.masked_once) or state.real is None or (
            not (always or is_compiling()) and state.real >= (1 - cfg.execution.pack_above) * state.keep.numel()):
        return None
    return real_rows(state)


def _stream_packed() -> bool:
    """Whether the tokens may travel between layers as packed rows (T, C), the real tokens only, instead of a
    padded batch (B, N, C): in eval without gradients (the residual adds then run in place), outside tracing,
    export and torch.compile. Once packed, the norms, qkv, proj and MLP take the rows as they are and compaction
    maps rows to rows (:func:`ltmp.ops.gather_slots`): no gather before and no scatter after each token-wise
    layer, and merging sums the real tokens only."""
    return not (torch.is_grad_enabled() or is_exporting() or torch.jit.is_tracing() or is_compiling())


def _mlp(view: BlockView, x: Tensor, state: TokenState, cfg: ReduceConfig) -> Tensor:
    """The second half of a block on the tokens after the reduction step: padded (B, N, C), or packed rows
    (T, C) when the stream is packed or starts to be here (there is padding to skip)."""
    if x.dim() != 2:
        rows = _packed_index(state, cfg)
        if rows is None or not _stream_packed():
            return _tokenwise(view.mlp, x, rows, x)  # (B, N, C)
        x = rows.take(ops.flat_rows(x))  # (T, C): from here on the tokens stay packed
    return x.add_(view.mlp(x))  # (T, C), the residual add in place (no gradients)


def _tokenwise(fn, x: Tensor, rows: ops.PackedRows | None, residual: Tensor | None = None) -> Tensor:
    """``fn`` applied to the tokens of x (B, N, C), plus ``residual`` (B, N, C') if given; only at the packed
    ``rows`` if given (padding gets 0, or keeps its residual). Without gradients the residual stream of a padded
    batch gets the outputs added in place: it is the block's own tensor, never read again (this saves a copy of it
    per layer)."""
    if rows is None:
        return fn(x) if residual is None else residual + fn(x)
    B, N, _ = x.shape
    flat = ops.flat_rows(x)  # (B * N, C)
    out = fn(rows.take(flat))  # (T, C')
    if residual is not None:  # one pass: the residual stream with the real tokens' outputs added in
        res = flat if residual is x else ops.flat_rows(residual)  # (B * N, C')
        return rows.add(res, out).view(B, N, -1)  # (B, N, C')
    return rows.pad(out, B * N).view(B, N, -1)  # (B, N, C')


def _buckets(state: TokenState, view: BlockView, cfg: ReduceConfig) -> list[tuple[list[int], int]] | None:
    """Groups of a padded eval batch for attention (:func:`ltmp.ops.plan_buckets` with ``cfg.execution``'s
    ``group_macs`` and ``max_buckets``), or None to run it whole.

    Only without gradients (``torch.no_grad()``/``inference_mode``, as ``ltmp eval``/``bench`` run), and never
    while tracing, exporting or compiling (the groups depend on the image: each new plan would recompile)."""
    e = cfg.execution
    if not (state.compact and state.masked_once) or state.counts is None or is_exporting() \
            or torch.jit.is_tracing() or is_compiling() or torch.is_grad_enabled() \
            or state.keep.device.type not in e.group_macs or view.gate is not None:
        return None
    return ops.plan_buckets(state.counts, 2.0 * view.heads * view.head_dim, e.group_macs[state.keep.device.type],
                            e.max_buckets)


def _attention(view: BlockView, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, ls: Tensor | None,
               cfg: ReduceConfig, ls_masks: bool = False):
    """Attention of eq. 5-7 on (B, H, N, D) q, k, v: the output (B, H, N, D) and, if the method prunes, the
    importance scores (B, N) of eq. 16/17, taken while the (B, H, N, N) probabilities are still in cache, or, with
    ``Execution.importance_from_lse`` in eval without gradients, from a fused kernel's log-sum-exp. ``ls_masks``:
    the log sizes ``ls`` are already -inf at every key ``keep`` removes, so ``keep`` only weighs the importance's
    query rows and the key bias is ``ls`` alone."""
    B, H, N, D = q.shape
    importance = None
    rows, keep = keep, None if ls_masks else keep  # (B, N) query rows of eq. 17; keys the bias must still mask
    e = cfg.execution
    hard = keep is None or not keep.requires_grad
    drop = view.attn_drop if view.training else 0.0
    fused = None  # (out, lse) of a fused kernel
    if cfg.needs_importance and e.importance_from_lse and e.fused_attention and hard \
            and not torch.is_grad_enabled() and not view.training and not is_exporting():
        bias = ops.key_bias(keep, ls, q.dtype)  # (B, N) or None
        bias = None if bias is None else bias.view(B, 1, 1, N)  # (B, 1, 1, N)
        fused = ops.attention_with_lse(q, k, v, view.scale, bias)
    if fused is not None:
        o, lse = fused  # (B, H, N, D), (B, H, N)
        importance = ops.importance_from_lse(q, k, lse, view.scale, bias, rows, cfg.importance)  # (B, N)
    elif cfg.needs_importance or not (view.fused and e.fused_attention) or not hard \
            or is_exporting():  # SDPA's mask broadcasting would guard on the symbolic token count
        o, probs = ops.masked_attention(q, k, v, view.scale, keep, ls, drop, cfg.mask_grad)  # (B, H, N, D)
        if cfg.needs_importance:
            importance = ops.importance_scores(probs, rows, cfg.importance)  # (B, N)
        del probs
    else:  # hard masks only: a fused kernel with an additive bias does the same
        bias = ops.key_bias(keep, ls, q.dtype)  # (B, N) or None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.view(B, 1, 1, N),
                                           dropout_p=drop, scale=view.scale)
    return o, importance  # (B, H, N, D), (B, N) or None


def _grouped_attention(view: BlockView, x: Tensor, state: TokenState, cfg: ReduceConfig, buckets) -> tuple:
    """The attention half of a block for a padded eval batch (or its packed rows), run per group of similar
    token counts.

    Token-wise layers run packed (the T real tokens); each group gathers its q, k, v straight from the packed
    qkv, padded only to the group's longest image (padding rows repeat a real token and are masked), and its
    output goes straight back to the packed rows. The result of :func:`_attention` on the whole padded batch, up
    to rounding (a group without padding may run another kernel). The per-group index tensors are built from
    host lists (a blocking copy on GPUs, where grouping is off; see ``Execution.group_macs``).

    Returns:
        The real tokens after the attention residual as packed rows (T, C) (:func:`_stream_packed`), importance
        (B, N) or None, and the merge metric (B, N, D).
    """
    B, N = state.keep.shape
    H, D = view.heads, view.head_dim
    dev = x.device
    packed = _packed_index(state, cfg, always=True)
    T = packed.idx.shape[0]
    xp = x if x.dim() == 2 else packed.take(ops.flat_rows(x))  # (T, C) the real tokens
    qkv = view.qkv(view.norm1(xp))  # (T, 3 * H * D)
    ls = log_size(state)
    starts = [0]
    for c in state.counts[:-1]:
        starts.append(starts[-1] + c)
    o = qkv.new_empty(T + 1, H * D)  # (T + 1, H * D); row T takes the padding rows' outputs
    importance = None  # (B, N) once a group has scores
    metric = None  # (B, N, D): the keys of the real tokens summed over heads, once for all groups; 0 at padding
    if cfg.needs_metric:
        keys = view.k_norm(ops.reshaped(qkv, T, 3, H, D)[:, 1])  # (T, H, D)
        metric = packed.pad(ops.head_sum(keys), B * N).view(B, N, D)  # (B, N, D)
    # rows of D values: each head's in a token's (3, H, D) qkv and in its (H, D) output
    head_qkv, head_out = ops.positions(3 * H, dev).view(3, 1, H, 1), ops.positions(H, dev).view(1, H, 1)
    for rows, n in buckets:
        b = len(rows)
        sel = torch.tensor(rows, device=dev)  # (b,)
        count = torch.tensor([state.counts[i] for i in rows], device=dev).view(b, 1)  # (b, 1)
        start = torch.tensor([starts[i] for i in rows], device=dev).view(b, 1)  # (b, 1)
        pos = ops.positions(n, dev)  # (n,)
        real = pos < count  # (b, n)
        at = start + torch.minimum(pos, count - 1)  # (b, n) packed row of each position
        if cfg.needs_importance:  # explicit attention: q, k and v gathered head by head, contiguous
            g = ops.reshaped(qkv, T * 3 * H, D).index_select(0, (at.view(1, b, 1, n) * (3 * H) + head_qkv).view(-1))
            q, k, v = g.view(3, b, H, n, D).unbind(0)  # (b, H, n, D) each
        else:  # timm's split of the group's qkv rows
            q, k, v = ops.qkv_heads(qkv.index_select(0, at.view(-1)).view(b, n, -1), H)  # (b, H, n, D) each
        q, k = view.q_norm(q), view.k_norm(k)
        padded = not all(state.counts[i] == n for i in rows)
        og, ig = _attention(view, q, k, v, ops.cast(real, state.keep.dtype) if padded else None,
                            None if ls is None else ls[sel, :n], cfg)  # (b, H, n, D), (b, n)
        at = at.masked_fill_(~real, T)  # (b, n) padding rows go to the spare row T
        if og.is_contiguous():  # (explicit attention) head by head into o's rows of D: no transposed copy
            o.view(-1, D).index_copy_(0, (at.view(b, 1, n) * H + head_out).view(-1), ops.cast(og.view(-1, D), o.dtype))
        else:
            o.index_copy_(0, at.view(-1), ops.cast(ops.flat_rows(ops.heads_merged(og)), o.dtype))
        if ig is not None:
            if importance is None:
                importance = ig.new_zeros(B, N)  # (B, N)
            importance[:, :n].index_copy_(0, sel, ops.cast(ig, importance.dtype))  # (B, N)
    # packed rows from here on (no gradients: in place, xp is the block's own tensor)
    return xp.add_(view.out(view.head_norm(o[:T]))), importance, metric  # (T, C), (B, N) or None, (B, N, D)


def _block(blk: nn.Module, view: BlockView, x: Tensor, state: TokenState, cfg: ReduceConfig, layer: int, rate: int,
           kind: str):
    """A pre-norm block with the reduction step between attention and MLP (paper Figure 2); ``rate`` is the
    fixed-rate methods' tokens for this block (0 for learned thresholds), ``kind`` the forward's step kind."""
    buckets = _buckets(state, view, cfg)
    if buckets is not None:
        x, importance, metric = _grouped_attention(view, x, state, cfg, buckets)
    else:
        x, importance, metric = _whole_attention(view, x, state, cfg)
    x, state, step = reduce_step(x, state, cfg, layer, importance, metric, getattr(blk, "merge_threshold", None),
                                 getattr(blk, "prune_threshold", None), rate, kind)
    return _mlp(view, x, state, cfg), state, step  # (B, N', C) or packed (T', C)


def _whole_attention(view: BlockView, x: Tensor, state: TokenState, cfg: ReduceConfig) -> tuple:
    """The attention half of a block on the whole (padded) batch: x after the attention residual (B, N, C), or
    packed rows (T, C) if x came packed, the importance (B, N) or None, and the merge metric (B, N, D) or None."""
    B, N = state.keep.shape
    gate = None
    if view.gate is not None:
        x = padded_tokens(x, state)  # (B, N, C)
        y = view.norm1(x)  # (B, N, C)
        gate, qkv = view.gate(y), view.qkv(y)  # (B, N, H * D), (B, N, 3 * H * D)
        rows = None
    elif x.dim() == 2:  # packed rows (T, C)
        rows = _packed_index(state, cfg, always=True)
        qkv = rows.pad(view.qkv(view.norm1(x)), B * N).view(B, N, -1)  # (B, N, 3 * H * D)
    else:
        rows = _packed_index(state, cfg)
        qkv = _tokenwise(lambda t: view.qkv(view.norm1(t)), x, rows)  # (B, N, 3 * H * D)
    # explicit attention (or the lse pass): one contiguous copy of q, k and v, not one each
    q, k, v = ops.qkv_heads(qkv, view.heads, contiguous=cfg.needs_importance)  # (B, H, N, D) each
    q, k = view.q_norm(q), view.k_norm(k)
    keep = state.keep if state.masked_once else None
    o, importance = _attention(view, q, k, v, keep, log_size(state), cfg,
                               size_masks_padding(state))  # (B, H, N, D), (B, N) or None
    o = ops.heads_merged(o)  # (B, N, H * D)
    if gate is not None:
        x = x + view.out(view.head_norm(o) * gate)  # (B, N, C)
    elif x.dim() == 2:  # packed rows, in place (no gradients)
        x = x.add_(view.out(view.head_norm(rows.take(ops.flat_rows(o)))))  # (T, C)
    else:
        x = _tokenwise(lambda t: view.out(view.head_norm(t)), o, rows, x)  # (B, N, C)
    return x, importance, ops.head_sum(k) if cfg.needs_metric else None  # (B, N, C) or (T, C), (B, N), (B, N, D)


def score_ranges(model: nn.Module) -> dict[str, tuple[float, float]]:
    """The range of the scores each kind of threshold compares: cosine similarities in [-1, 1] for merge
    thresholds; importance in [0, 1] (mean column attention, eq. 17) or [0, heads] (class attention summed over
    heads, eq. 16) for prune thresholds."""
    heads = float(num_heads(model)) if model.ltmp_config.importance == "cls" else 1.0
    return {"merge_threshold": (-1.0, 1.0), "prune_threshold": (0.0, heads)}


def num_heads(model: nn.Module) -> int:
    """Attention heads of the first block."""
    return adapter_for(model).view(model, blocks(model)[0]).heads


def mlp_hidden(model: nn.Module) -> int:
    """h of eq. 11: the MLP's hidden width."""
    return adapter_for(model).mlp_hidden(model)


def embed_dim(model: nn.Module) -> int:
    """d of eq. 11: the model width."""
    return adapter_for(model).embed_dim(model)


def vit_spec(model: nn.Module, count_norm: bool = True) -> ViTSpec:
    """Per-token and per-pair multiply-accumulate counts of a supported ViT, in fvcore's convention.

    Linear layers count in*out MACs per token, the patch-embedding convolution its kernel MACs per patch, the two
    attention matmuls ``H * D`` MACs per (query, key) pair each, and LayerNorm 5 (4 without affine) per element,
    as fvcore does. Element-wise ops, softmax and GELU count nothing.

    Args:
        model: A supported ViT (patched or not).
        count_norm: Count LayerNorms (fvcore does; ``torch.utils.flop_counter`` does not).
    """
    adapter = adapter_for(model)
    attn_token, mlp_token, pair = [], [], []
    for blk in adapter.blocks(model):
        a, m = adapter.token_macs(model, blk, count_norm)
        view = adapter.view(model, blk)
        attn_token.append(a)
        mlp_token.append(m)
        pair.append(2.0 * view.heads * view.head_dim)
    (gh, gw), _, _ = adapter.patch_grid(model)
    final, head = adapter.final_macs(model, count_norm)
    return ViTSpec(
        num_patches=gh * gw,
        num_prefix=adapter.num_prefix(model),
        embed_dim=adapter.embed_dim(model),
        mlp_hidden=adapter.mlp_hidden(model),
        macs_embed=adapter.embed_macs(model, count_norm),
        macs_attn_token=attn_token,
        macs_attn_pair=pair,
        macs_mlp_token=mlp_token,
        macs_final_token=final,
        macs_head=head,
    )
