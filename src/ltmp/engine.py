"""The forward of a patched model: the plan, attention on the token layout, the blocks, and the record.

:func:`forward` is the patched model's ``forward``: the model's adapter (:mod:`ltmp.adapters`) embeds the inputs,
:func:`encode` runs the blocks with the reduction step in each, and the adapter applies the family's head. The mode
is read once into a :class:`ltmp.step.Plan` (train or eval, fixed rates, export, compile); nothing below asks torch
again.

Token layout. Train mode keeps every token in a (B, N, C) tensor with a straight-through keep mask. Eval mode keeps
only the surviving tokens, as rows (T, C) packed image by image (:class:`ltmp.step.Layout`): norms, projections and
the MLP run on the T real tokens, not on a padded batch (a padded batch took 1.49x the time of packed rows for LTMP
at r 0.5 on the DeiT-S shape, batch 32, on the 2-core CPU of docs/performance.md: ``python benchmarks/layout.py``).
Attention runs on the batch padded to its longest image, padding keys masked. Its backend is explicit attention
with its probabilities where the method needs them (the importance of eq. 16/17) or train mode's straight-through
masks need eq. 6's gradient, else ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import ops
from .config import BlockView, ReduceConfig
from .errors import LtmpError
from .record import Record
from .step import Layout, Plan, StepResult, TokenState, Track, dense, reduce_step

#: torch.compiler.is_exporting tells export from compile only from torch 2.14: before, Dynamo replaced the call by
#: a constant True, also under torch.compile (pytorch/pytorch#176347, fixed by #176499); ``ltmp.export`` sets
#: ``ReduceConfig.exporting`` whatever the version.
_TORCH_IS_EXPORTING_EXACT = torch.torch_version.TorchVersion(torch.__version__) >= (2, 14)


def plan(cfg: ReduceConfig, training: bool, device: str, keep_one: bool) -> Plan:
    """The forward's plan, from the mode, the method, the device type and whether the head reads the patch tokens
    (``keep_one``): read once, passed to every block."""
    symbolic = cfg.exporting or (_TORCH_IS_EXPORTING_EXACT and torch.compiler.is_exporting())
    tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    return Plan(
        train=training,
        static=not (training or cfg.learned),
        symbolic=symbolic,
        compiling=tracing and not symbolic,
        keep_one=keep_one,
        tuning=TUNING.get("default" if tracing else device, TUNING["default"]),
    )


#: Device-dependent speed choices (none changes results), with the measurement behind each. A device type not
#: listed takes "default".
TUNING: dict[str, dict] = {
    # Attention of a padded eval batch in groups of images of similar token counts (:func:`attend_in_groups`), at
    # most ``max_groups``, each costing ``group_macs`` multiply-accumulates more (about 40 operator calls of ~6 us
    # at the ~50 GMAC/s attention reaches on this project's 2-core CPU). LTMP at r 0.5 on the DeiT-S shape, batch
    # 32: 1.009 s against 1.150 s in one padded group (0.877; ``python benchmarks/grouping.py``).
    "cpu": dict(group_macs=12e6, max_groups=4),
    "default": dict(group_macs=None, max_groups=1),
}


def attention(
    plan: Plan,
    view: BlockView,
    cfg: ReduceConfig,
    qkv: Tensor,
    size: Tensor,
    keep: Tensor | None,
    rows: Tensor | None,
    merged: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention of eq. 5-7 on a (padded) batch: ``qkv`` (b, n, 3 * H * D), token sizes (b, n) (0 at padding),
    ``keep`` (b, n) the keys that count (straight-through in train mode; None: all with a size), ``rows`` (b, n)
    eq. 17's query rows (None: all), ``merged``: sizes may differ from 1 (proportional attention).

    Returns:
        The heads' output (b, n, H * D), the importance (b, n) of eq. 16/17 if the method prunes and the merge
        metric (b, n, D) (keys summed over heads) if it merges.
    """
    b, n = qkv.shape[:2]
    q, k, v = qkv.view(b, n, 3, view.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # (b, H, n, D) each
    q, k = view.q_norm(q), view.k_norm(k)
    log_size = size.log() if merged else None  # (b, n); -inf at padding: masked
    prunes = "prune" in cfg.ops
    soft = keep is not None and keep.requires_grad  # eq. 6's gradient to the straight-through mask
    if soft or prunes or not view.fused or (plan.symbolic and cfg.learned):  # (SDPA's mask would guard on counts)
        o, probs = ops.masked_attention(q, k, v, view.scale, keep, log_size, view.attn_drop, cfg.mask_grad)
    else:
        bias = ops.key_bias(keep, log_size, q.dtype)  # (b, n) or None
        mask = None if bias is None else bias[:, None, None, :]  # (b, 1, 1, n)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=view.attn_drop, scale=view.scale)
    importance = ops.importance(probs, rows, cfg.importance) if prunes else None  # (b, n)
    metric = k.sum(1) if "merge" in cfg.ops else None  # (b, n, D)
    return o.transpose(1, 2).reshape(b, n, -1), importance, metric


def attend(
    plan: Plan, view: BlockView, cfg: ReduceConfig, y: Tensor, state: TokenState
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`attention` on the token layout: train mode's (B, N, C) batch with its keep mask, or eval's rows
    (T, C) as the batch padded to its longest image (padding keys masked; on the CPU in groups of images of
    similar counts where that pays, :func:`attend_in_groups`).

    Returns:
        The output like y, (B, N, H * D) or (T, H * D); the importance (B, N) and the merge metric (B, N, D), padded.
    """
    L = state.layout
    qkv = view.qkv(y)  # (..., 3 * H * D)
    if plan.train:
        rows = state.keep if cfg.importance_rows == "survivors" else None  # eq. 17's query rows
        return attention(plan, view, cfg, qkv, state.size, state.keep, rows, state.merged_once)
    B, N = L.batch, L.length
    tune = plan.tuning
    if L.counts is not None and tune["group_macs"] is not None:  # can groups save more than one group costs?
        pair = 2.0 * view.heads * view.head_dim  # MACs of a (query, key) pair
        if pair * (B * N * N - sum(c * c for c in L.counts)) > tune["group_macs"]:
            groups = plan_groups(L.counts, pair, tune["group_macs"], tune["max_groups"])
            if groups is not None:
                return attend_in_groups(plan, view, cfg, qkv, state, groups)
    keep = None if state.merged_once else L.real  # padding keys (size 0 masks them if merged)
    o, importance, metric = attention(plan, view, cfg, L.pad(qkv), L.pad(state.size), keep, L.real, state.merged_once)
    return L.take(o.view(B * N, -1)), importance, metric


def plan_groups(
    counts: list[int], pair_cost: float, group_cost: float, max_groups: int
) -> list[tuple[list[int], int]] | None:
    """Groups of the images of a padded batch by token count, so that attention runs on less padding: images
    sorted by count, split into at most ``max_groups`` consecutive groups of least total cost, an image costing
    ``pair_cost * n^2`` for the ``n`` tokens of its group's longest image and each group ``group_cost``.

    Returns:
        ``[(image indices, group length), ...]``, or None when one group is cheapest.
    """
    order = sorted(range(len(counts)), key=counts.__getitem__)
    c = [counts[i] for i in order]  # ascending
    ends = [e for e in range(1, len(c)) if c[e] != c[e - 1]] + [len(c)]  # a group ends where the count changes
    best = {(0, 0): (0.0, 0)}  # (groups, end) -> (least cost of that many groups of the images before end, start)
    for g in range(1, max_groups + 1):
        for e in ends:
            costs = [
                (best[g - 1, s][0] + (e - s) * pair_cost * c[e - 1] ** 2 + group_cost, s)
                for s in [0, *ends]
                if s < e and (g - 1, s) in best
            ]
            if costs:
                best[g, e] = min(costs)
    g = min(range(1, max_groups + 1), key=lambda g: best.get((g, len(c)), (np.inf,))[0])
    groups, e = [], len(c)
    while g > 0:
        s = best[g, e][1]
        groups.append((order[s:e], c[e - 1]))
        e, g = s, g - 1
    return groups[::-1] if len(groups) > 1 else None


def attend_in_groups(
    plan: Plan, view: BlockView, cfg: ReduceConfig, qkv: Tensor, state: TokenState, groups: list[tuple[list[int], int]]
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Eval on the CPU (``TUNING``): :func:`attention` of the rows (T, 3 * H * D) in groups of images
    ``[(image indices, length), ...]`` (:func:`plan_groups`), each padded to its longest image.

    Returns:
        As :func:`attend`.
    """
    L = state.layout
    starts = torch.tensor(np.cumsum([0, *L.counts]))  # (B + 1,) each image's first row
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)  # (T, H * D)
    importance = metric = None
    for images, n in groups:
        counts = torch.tensor([L.counts[i] for i in images])[:, None]  # (b, 1)
        real = torch.arange(n) < counts  # (b, n)
        # each position's row, padding repeating its image's last row: one gather pads, and masked keys (and the
        # padded queries, whose outputs are dropped) make what padding holds irrelevant
        at = starts[images][:, None] + torch.minimum(torch.arange(n), counts - 1)  # (b, n)
        keep = None if state.merged_once else real
        size = state.size[at].masked_fill(~real, 0)  # (b, n), 0 at padding
        o, imp, met = attention(plan, view, cfg, qkv[at], size, keep, real, state.merged_once)  # o (b, n, H * D)
        out[at[real]] = o[real]
        sel = torch.tensor(images)[:, None]  # (b, 1)
        if imp is not None:
            importance = imp.new_zeros(L.batch, L.length) if importance is None else importance
            importance[sel, torch.arange(n)] = imp  # (b, n) into (B, N)
        if met is not None:
            metric = met.new_zeros(L.batch, L.length, met.shape[2]) if metric is None else metric
            metric[sel, torch.arange(n)] = met
    return out, importance, metric


def block(
    plan: Plan, view: BlockView, blk: nn.Module, x: Tensor, state: TokenState, cfg: ReduceConfig, layer: int, rate: int
) -> tuple[Tensor, TokenState, StepResult]:
    """A pre-norm block with the reduction step between attention and MLP (the paper's Figure 2)."""
    y = view.norm1(x)  # (B, N, C) or (T, C)
    o, importance, metric = attend(plan, view, cfg, y, state)
    x = x + view.out(o, y)
    merge, prune = getattr(blk, "merge_threshold", None), getattr(blk, "prune_threshold", None)
    x, state, step = reduce_step(x, state, cfg, plan, layer, importance, metric, merge, prune, rate)
    return x + view.mlp(x), state, step


def encode(model: nn.Module, x: Tensor, taps: Sequence[int] = ()) -> tuple[Tensor, TokenState, dict[int, Tensor]]:
    """The blocks of a patched model with the reduction step in each, on embedded tokens; sets the record.

    Args:
        model: A patched model. x: (B, N, C) tokens entering the first block, prefix tokens first.
        taps: blocks after which to return dense outputs (negative: from the end): each token of x with the
            feature of the token it went into, or if removed the feature it had then (:class:`ltmp.step.Track`; 0
            with ``dense_fill="zero"``).

    Returns:
        The tokens leaving the last block as a padded batch (B, N', C), before the final norm, and their state
        with padded (B, N') sizes and keep mask (0 at removed and padding tokens; None if neither exists), for the
        family's head (``ltmp.adapters.mean_pool``, ``ltmp.adapters.pool_bias``); the dense outputs (B, N, C) after
        the blocks ``taps``, by block index from 0, in block order.
    """
    cfg: ReduceConfig = model.ltmp_config
    adapter = type(model)._ltmp_adapter
    blocks = adapter.blocks(model)
    if any(model._ltmp_hooks):  # hooks inside the blocks (dicts of them, listed at patch time)
        refuse_hooks(model, blocks)
    B, N, C = x.shape
    p = plan(cfg, model.training, x.device.type, adapter.pools_patches(model) or cfg.num_prefix == 0)
    size = torch.ones(B, N, dtype=ops.wide(x.dtype), device=x.device)  # (B, N)
    source = torch.eye(N, dtype=size.dtype, device=x.device).expand(B, N, N) if cfg.trace_source else None
    track = Track.start(x, cfg.dense_fill) if taps else None
    if not p.train:  # rows (T, C), (T,), (T, N)
        x, size = x.reshape(B * N, C), size.view(-1)
        source = None if source is None else source.reshape(B * N, N)
    state = TokenState(size, Layout(B, N), source=source, track=track)
    run = partial(checkpoint, block, use_reentrant=False) if p.train and adapter.checkpointing(model) else block
    steps = []  # each block's StepResult
    padded = [N]  # the padded token count entering each block, and leaving the last
    traced = []  # each block's state, with trace_source
    tapped = {}  # block -> dense output, for taps
    for i, blk in enumerate(blocks):
        rate = 0 if cfg.rate is None else cfg.rate[i]
        x, state, step = run(p, adapter.view(model, blk), blk, x, state, cfg, i, rate)  # checkpoint: recomputed
        steps.append(step)
        padded.append(state.layout.length)
        if cfg.trace_source:
            traced.append(_padded(state, p))
        if i in taps or i - len(blocks) in taps:
            tapped[i] = dense(x, state.track).view(B, N, C)  # (B, N, C)
    out = _padded(state, p)
    x = x if p.train else state.layout.pad(x)  # (B, N', C)
    if not (p.symbolic or torch.jit.is_tracing()):  # exported graphs have no record (their counts are symbolic)
        model.ltmp_record = Record(
            cfg.method,
            padded,
            N - cfg.num_prefix,
            cfg.num_prefix,
            steps,
            size.dtype,
            x.device,
            B,
            *(_traced(traced, cfg.num_prefix) if traced else ()),
        )
        if p.train and steps[0].kept_frac.requires_grad:
            model.ltmp_record.counts()  # built now, with its gradients, whatever mode a first read is in
    return x, out, tapped


def refuse_hooks(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """A patched block runs as one reduction step, on packed rows in eval: hooks on it or inside it would never fire
    or see other shapes than timm documents, so the forward refuses them (hooks on the model itself fire; the
    family's own hooks, ``Adapter.library_hook``, are left alone)."""
    adapter = type(model)._ltmp_adapter
    for i, blk in enumerate(blocks):
        for name, m in blk.named_modules():
            dicts = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
            if all(adapter.library_hook(h) for d in dicts for h in d.values()):
                continue  # none, or the family's own (transformers' output recorders), replaced by the forward
            raise LtmpError(
                f"blocks[{i}]{'.' + name if name else ''} has a hook, which a patched model would not run on its "
                f"tokens (a block is one reduction step on packed rows); remove it, and read per-block outputs with "
                f"forward_intermediates (dense), counts with ltmp.stats(model) or patch memberships with "
                f"trace_source=True"
            )


def _traced(states: list[TokenState], num_prefix: int) -> tuple[list[Tensor], list[Tensor]]:
    """Which patches each token covers after each block (B, N_l, n), and which tokens survive (B, N_l)."""
    sources = [s.source[:, :, num_prefix:] for s in states]
    return sources, [s.size > 0 if s.keep is None else s.keep > 0.5 for s in states]


def _padded(state: TokenState, p: Plan) -> TokenState:
    """The state as a padded batch: (B, N) sizes and keep mask (1 surviving, 0 removed or padding; None if
    neither exists), and (B, N, N0) sources if traced."""
    if p.train:
        return state
    L = state.layout
    keep = None if L.real is None else L.real.to(state.size.dtype)  # (B, N)
    source = None if state.source is None else L.pad(state.source)  # (B, N, N0)
    return TokenState(L.pad(state.size), L, keep, source, state.merged_once)


def forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` of a patched model: its adapter's, with :func:`encode` for the blocks."""
    return type(model)._ltmp_adapter.forward(model, encode, *args, **kwargs)
