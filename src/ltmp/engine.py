"""The forward of a patched model: the plan, the token layout, attention backends, blocks, and the record.

:func:`encode` runs the blocks of any family (its adapter's :class:`ltmp.adapters.BlockView` of each block) on the
embedded tokens. It reads the mode once into a :class:`ltmp.step.Plan` (train or eval, gradients, export,
compile, autocast, the attention backend); nothing below it asks torch again.

Token layout. Train mode keeps every token in a (B, N, C) tensor with a straight-through keep mask. Eval mode
keeps only the surviving tokens, as rows (T, C) packed image by image (:class:`ltmp.step.Layout`): norms,
projections and the MLP run on the T real tokens, not on a padded batch (a padded (B, N, C) batch took 1.49x the
time of packed rows for LTMP at r 0.5 on the DeiT-S shape, batch 32, on the 2-core CPU of docs/performance.md:
``python benchmarks/layout.py``). Without padding (fixed rates, one image) the rows are the batch flattened.

Attention runs per group of images padded to the group's longest (:func:`attend`); one group is the whole batch.
On the CPU, a padded batch is split into groups of similar token counts where that costs less (``TUNING``). The
backend is one of: explicit attention with its probabilities (the importance of eq. 16/17 needs them, and train
mode's straight-through masks need eq. 6's gradient), ``scaled_dot_product_attention`` where no importance is
needed, and a fused kernel's log-sum-exp plus one more ``q k^T`` pass for the importance (``"lse"``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .adapters import BlockView
from .config import ReduceConfig
from .export import is_exporting
from .record import Record
from .step import Layout, Plan, StepResult, TokenState, constant, reduce_step, scalar

#: Device-dependent speed choices (none changes results), with the measurement behind each value. A device type not
#: listed takes "default". ``ReduceConfig.execution`` overrides them per model.
TUNING: dict[str, dict] = {
    # group_macs: the fixed cost of one more attention group, in MACs: about 40 operator calls of ~6 us at the
    # ~50 GMAC/s attention reaches on the 2-core CPU of docs/performance.md. Groups of similar counts took 0.886 of
    # the time of one padded group at r 0.5 (DeiT-S shape, batch 32), 0.79 at r 0.7 (benchmarks/grouping.py).
    # importance_from_lse: 1.11x (DeiT-S) and 1.28x (CIFAR ViT) the time of explicit probabilities at batch 32.
    "cpu": dict(group_macs=12e6, max_buckets=4, importance_from_lse=False),
    # groups: 2 and 4 groups took 1.4x and 2x one padded group on an H100 (DeiT-S, batch 32). importance from the
    # log-sum-exp: a fused kernel instead of (B, H, N, N) probabilities in memory; not yet timed on a GPU.
    "cuda": dict(group_macs=None, max_buckets=1, importance_from_lse=True),
    "default": dict(group_macs=None, max_buckets=1, importance_from_lse=False),
}


def tracing() -> bool:
    """torch.compile, torch.export or torch.jit traces the model."""
    return bool(torch.compiler.is_compiling()) or torch.jit.is_tracing()


def plan(cfg: ReduceConfig, x: Tensor, training: bool) -> Plan:
    """The forward's plan, from the mode, the method and the device: read once, passed to every block."""
    from torch.utils import _python_dispatch

    exporting_now = is_exporting()
    traced = tracing()
    tune = dict(TUNING.get(x.device.type, TUNING["default"]))
    tune.update({k: v for k, v in vars(cfg.execution).items() if v is not None})
    grad = torch.is_grad_enabled()
    fused = not (training or grad)
    if cfg.needs_importance:
        attention = "lse" if fused and tune["importance_from_lse"] and not exporting_now else "explicit"
    else:  # learned counts are symbolic in an export, where SDPA's mask broadcasting would guard on them
        attention = "sdpa" if not (exporting_now and cfg.learned) else "explicit"
    groups = not (training or grad or traced or torch.jit.is_tracing()) and tune["group_macs"] is not None
    return Plan(
        train=training,
        grad=grad,
        symbolic=exporting_now,
        compiling=traced and not exporting_now,
        static=not training and not cfg.learned,
        amp=torch.is_autocast_enabled(x.device.type),
        attention=attention,
        group_macs=tune["group_macs"] if groups else None,
        max_buckets=tune["max_buckets"],
        cache=not traced
        and _python_dispatch._get_current_dispatch_mode() is None
        and not (x.is_cuda and torch.cuda.is_current_stream_capturing()),
        views=not (grad or traced),
    )


def plan_buckets(
    counts: list[int], pair_cost: float, group_cost: float, max_buckets: int
) -> list[tuple[list[int], int]] | None:
    """Groups of the images of a padded batch by token count, so that attention runs on less padding.

    Attention costs an image ``pair_cost * n^2`` for the ``n`` tokens of its group's longest member, and each
    group a fixed ``group_cost``. Images sorted by count are split into at most ``max_buckets`` consecutive groups
    of least total cost, by dynamic programming over the places where the count changes.

    Returns:
        ``[(image indices, group length), ...]`` or None when one group is cheapest.
    """
    B = len(counts)
    order = sorted(range(B), key=counts.__getitem__)
    c = [counts[i] for i in order]  # ascending
    pts = np.array([0] + [j for j in range(1, B) if c[j] != c[j - 1]] + [B])  # (P,) candidate group boundaries
    P = len(pts)
    if max_buckets < 2 or P < 3:
        return None
    # a group over sorted images pts[i]:pts[j] costs (pts[j] - pts[i]) * pair_cost * c[pts[j] - 1]^2 + group_cost
    last = pair_cost * np.array([0] + [c[j - 1] for j in pts[1:]], dtype=np.float64) ** 2  # (P,)
    span = (
        np.where(np.triu(np.ones((P, P), dtype=bool), k=1), (pts[None, :] - pts[:, None]) * last[None, :], np.inf)
        + group_cost
    )  # (P, P) [i, j]
    best, cut = [np.r_[0.0, np.full(P - 1, np.inf)]], [np.zeros(P, dtype=np.int64)]
    for _ in range(max_buckets):  # best[g][j]: cheapest g groups of the images before pts[j]; cut: the last start
        cost = best[-1][:, None] + span  # (P, P)
        cut.append(cost.argmin(0))
        best.append(cost[cut[-1], np.arange(P)])
    g = min(range(1, max_buckets + 1), key=lambda n: best[n][P - 1])
    if g == 1:
        return None
    groups, j = [], P - 1
    while g > 0:
        i = int(cut[g][j])
        groups.append((order[pts[i] : pts[j]], c[pts[j] - 1]))
        j, g = i, g - 1
    return groups[::-1]


def attention(
    plan: Plan,
    view: BlockView,
    cfg: ReduceConfig,
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    log_size: Tensor | None,
    weights: Tensor | None,
    metric: bool = True,
) -> tuple:
    """Attention of eq. 5-7 on a batch of images with one backend (:func:`backend_for`).

    Args:
        q, k, v: (b, H, n, D). keep: (b, n) mask of the keys that count (straight-through in train mode), or None.
        log_size: (b, n) for proportional attention (-inf at keys that do not count), or None. weights: (b, n)
            eq. 17's query row weights (``ops.row_weights``; None: all). metric: the merge metric, if one merges.

    Returns:
        The output (b, H, n, D), the importance (b, n) of eq. 16/17 if the method prunes, and the merge metric
        (b, n, D) (keys summed over heads) or None.
    """
    q, k = view.q_norm(q), view.k_norm(k)
    drop, importance, fused = view.attn_drop if view.training else 0.0, None, None
    bias = None if backend == "explicit" else ops.key_bias(keep, log_size, q.dtype)  # (b, n) or None
    bias = None if bias is None else bias.view(bias.shape[0], 1, 1, -1)  # (b, 1, 1, n)
    if backend == "lse":
        fused = ops.attention_with_lse(q, k, v, view.scale, bias)
    if fused is not None:
        o, lse = fused  # (b, H, n, D), (b, H, n)
        importance = ops.importance_from_lse(q, k, lse, view.scale, bias, weights, cfg.importance)  # (b, n)
    elif backend == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop, scale=view.scale)
    else:
        o, probs = (
            ops.soft_masked_attention(q, k, v, view.scale, keep, log_size, drop, cfg.mask_grad)
            if keep is not None and keep.requires_grad
            else ops.masked_attention(q, k, v, view.scale, keep, log_size, drop, plan.amp)
        )
        if cfg.needs_importance:
            importance = ops.importance_scores(probs, weights, cfg.importance)  # (b, n)
    return o, importance, ops.head_sum(k) if metric and cfg.needs_metric else None  # (b, H, n, D), (b, n), (b, n, D)


def backend_for(plan: Plan, view: BlockView, keep: Tensor | None) -> str:
    """The plan's attention backend, or explicit attention where the family forbids fused kernels or the mask
    needs eq. 6's gradient."""
    return plan.attention if view.fused and not (keep is not None and keep.requires_grad) else "explicit"


def split_heads(plan: Plan, qkv: Tensor, b: int, n: int, heads: int, contiguous: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v (b, H, n, D) from the projections of b images' n tokens, (b, n, 3 * H * D) or their rows
    (b * n, 3 * H * D), as timm splits them (reshape and permute; one strided view of the rows where the plan
    allows); ``contiguous``: one copy of all three (explicit attention reads them whole)."""
    C3 = qkv.shape[-1]
    D = C3 // (3 * heads)
    if plan.views and qkv.is_contiguous():
        t = qkv.as_strided((3, b, heads, n, D), (heads * D, n * C3, D, C3, 1), qkv.storage_offset())
    else:
        t = qkv.view(b, n, 3, heads, D).permute(2, 0, 3, 1, 4)  # (3, b, H, n, D)
    return (t.contiguous() if contiguous else t).unbind(0)


def merge_heads(plan: Plan, o: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Attention output (b, H, n, D) as token rows of ``shape``, (b, n, H * D) or (b * n, H * D); a fused kernel's
    (b, n, H, D) layout as a view."""
    b, H, n, D = o.shape
    if plan.views and o.stride() == (n * H * D, D, H * D, 1):
        return o.as_strided(shape, (H * D, 1) if len(shape) == 2 else (n * H * D, H * D, 1), o.storage_offset())
    return o.transpose(1, 2).reshape(shape)


def attend(
    plan: Plan, view: BlockView, cfg: ReduceConfig, qkv: Tensor, state: TokenState
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention on the token layout: train mode's (B, N, ...) batch, eval's rows (T, ...) as the batch when
    nothing is padded, else gathered into padded groups of images (:func:`attention_in_groups`).

    Returns:
        The output like qkv, (B, N, H * D) or (T, H * D); the importance (B, N) and the metric (B, N, D), padded.
    """
    L = state.layout
    if plan.train or L.counts is None:  # the rows are the batch
        B, N = L.batch, L.length
        keep = state.keep if plan.train else None
        ls = state.size.view(B, N).log() if state.merged_once else None
        backend = backend_for(plan, view, keep)
        q, k, v = split_heads(plan, qkv, B, N, view.heads, backend == "explicit")  # (B, H, N, D) each
        rows = keep if cfg.importance_rows == "survivors" else None  # eq. 17's query rows ("all": every row)
        w = ops.row_weights(rows, view.heads, ops.wide(qkv.dtype)) if cfg.needs_importance else None  # (B, N)
        o, importance, metric = attention(plan, view, cfg, backend, q, k, v, keep, ls, w)
        return merge_heads(plan, o, (*qkv.shape[:-1], o.shape[1] * o.shape[3])), importance, metric
    ls = L.pad(state.size).log() if state.merged_once else None  # (B, N); -inf at padding (size 0)
    keep = None if ls is not None else L.real.to(state.size.dtype)  # padding keys to mask
    groups = None
    if plan.group_macs is not None:
        groups = plan_buckets(L.counts, 2.0 * view.heads * view.head_dim, plan.group_macs, plan.max_buckets)
    return attention_in_groups(plan, view, cfg, qkv, keep, ls, L, groups or [(None, L.length)])


def attention_in_groups(
    plan: Plan,
    view: BlockView,
    cfg: ReduceConfig,
    qkv: Tensor,
    keep: Tensor | None,
    log_size: Tensor | None,
    layout: Layout,
    groups: list,
) -> tuple:
    """Attention on the rows (T, 3 * H * D) of a padded eval batch, in groups of images ``[(image indices or None
    for all, length), ...]`` (:func:`plan_buckets`), each padded to its longest image: a padding position repeats
    the image's last row and is masked. q, k and v are gathered head by head, and the output put back, straight
    between the rows and the (b, H, n, D) heads.

    Returns:
        The output rows (T, H * D), the importance (B, N) and the metric (B, N, D).
    """
    (B, N), (T, _), H, D = (layout.batch, layout.length), qkv.shape, view.heads, view.head_dim
    out = qkv.new_empty((T + 1) * H, D)  # each row's heads; row T takes the padding's outputs
    heads_in = constant(
        plan, ("heads", 3, H, qkv.device), lambda: torch.arange(3 * H, device=qkv.device).view(3, 1, H, 1)
    )  # (3, 1, H, 1) the heads of a row's q | k | v
    heads_out = constant(
        plan, ("heads", 1, H, qkv.device), lambda: torch.arange(H, device=qkv.device).view(1, H, 1)
    )  # (1, H, 1)
    backend, importance, metric = backend_for(plan, view, keep), None, None
    if cfg.needs_metric and len(groups) > 1:  # (B, N, D) from the rows, once for all groups
        metric = layout.pad(ops.head_sum(view.k_norm(qkv.view(T, 3, H, D)[:, 1])))
    # once for all groups, (B, N) each: the first of each position's q | k | v rows of (T * 3 H, D) (padding repeats
    # the image's last row), of its output's rows of ((T + 1) * H, D) (padding's: row T's), its query row's weight
    at, real, dev = layout.at(), layout.real, qkv.device
    first, to = at * scalar(plan, 3 * H, dev), torch.where(real, at, scalar(plan, T, dev)) * scalar(plan, H, dev)
    weights = ops.row_weights(real, H, ops.wide(qkv.dtype)) if cfg.needs_importance else None
    for sel, n in groups:
        a, t, ls, kp, w = first, to, log_size, keep, weights  # (B, N) each
        if sel is not None:  # the group's positions (b * n,) in the flat batch (B * N)
            pos = torch.from_numpy((np.array(sel)[:, None] * N + np.arange(n)).ravel()).to(dev)
            a, t, ls, kp, w = (
                None if u is None else u.view(-1).index_select(0, pos).view(-1, n) for u in (a, t, ls, kp, w)
            )  # (b, n) each
        full = sel is not None and all(layout.counts[i] == n for i in sel)  # a group without padding
        rows = a.view(1, -1, 1, n) + heads_in  # (3, b, H, n) rows of (T * 3 H, D)
        q, k, v = qkv.view(-1, D).index_select(0, rows.view(-1)).view(3, *rows.shape[1:], D).unbind(0)
        o, imp, met = attention(
            plan, view, cfg, backend, q, k, v, None if full else kp, ls, None if full else w, metric=sel is None
        )  # (b, H, n, D), (b, n), (b, n, D) or None
        if o.is_contiguous():  # head by head into the rows
            out.index_copy_(0, (t.view(-1, 1, n) + heads_out).view(-1), o.view(-1, D))
        else:  # a fused kernel's (b, n, H, D) layout
            out.index_copy_(0, (t.view(-1, n, 1) + heads_out.view(1, 1, H)).view(-1), o.transpose(1, 2).reshape(-1, D))
        if sel is None:
            importance, metric = imp, met
        elif imp is not None:
            importance = imp.new_zeros(B, N) if importance is None else importance
            importance.view(-1).index_copy_(0, pos, imp.view(-1))
    return out.view(T + 1, H * D)[:T], importance, metric


def block(
    plan: Plan, view: BlockView, blk: nn.Module, x: Tensor, state: TokenState, cfg: ReduceConfig, layer: int, rate: int
) -> tuple[Tensor, TokenState, StepResult]:
    """A pre-norm block with the reduction step between attention and MLP (the paper's Figure 2)."""
    y = view.norm1(x)  # (B, N, C) or (T, C)
    o, importance, metric = attend(plan, view, cfg, view.qkv(y), state)  # (..., H * D)
    o = view.head_norm(o)
    o = view.out(o if view.gate is None else o * view.gate(y))
    # in place in eager without gradients (x is the block's own); exported, in place on a slice would copy it whole
    add = torch.add if plan.grad or plan.symbolic else Tensor.add_
    x = add(x, o)
    x, state, step = reduce_step(
        x,
        state,
        cfg,
        plan,
        layer,
        importance,
        metric,
        getattr(blk, "merge_threshold", None),
        getattr(blk, "prune_threshold", None),
        rate,
    )
    return add(x, view.mlp(x)), state, step


def encode(model: nn.Module, x: Tensor) -> tuple[Tensor, TokenState]:
    """The blocks of a patched model with the reduction step in each, on embedded tokens; sets the record.

    Args:
        model: A patched model. x: (B, N, C) tokens entering the first block, prefix tokens first.

    Returns:
        The tokens leaving the last block as a padded batch (B, N', C), before the final norm, and their state
        with padded (B, N') sizes and keep mask (0 at removed and padding tokens), for the heads (:func:`mean_pool`,
        :func:`pool_bias`).
    """
    cfg: ReduceConfig = model.ltmp_config
    adapter = type(model)._ltmp_adapter
    B, N, C = x.shape
    p = plan(cfg, x, model.training)
    size = torch.ones(B, N, dtype=ops.wide(x.dtype), device=x.device)  # (B, N)
    source = torch.eye(N, dtype=size.dtype, device=x.device).expand(B, N, N) if cfg.trace_source else None
    if p.train:
        state = TokenState(size=size, layout=Layout(B, N), source=source)
    else:  # rows (T, C)
        x = x.reshape(B * N, C)
        state = TokenState(
            size=size.view(-1), layout=Layout(B, N), source=None if source is None else source.reshape(B * N, N)
        )
    steps, padded = [], [N]
    sources, keeps = ([], []) if cfg.trace_source else (None, None)
    for i, blk in enumerate(adapter.blocks(model)):
        x, state, step = block(
            p, adapter.view(model, blk), blk, x, state, cfg, i, 0 if cfg.rate is None else cfg.rate[i]
        )
        steps.append(step)
        padded.append(state.layout.length)
        if sources is not None:
            out = _padded(state, p)
            sources.append((state.source if p.train else state.layout.pad(state.source))[:, :, cfg.num_prefix :])
            keeps.append(out.size > 0 if out.keep is None else out.keep > 0.5)
    out = _padded(state, p)
    x = x if p.train else state.layout.pad(x)  # (B, N', C)
    if p.symbolic or torch.jit.is_tracing():  # symbolic counts: exported graphs have no record
        return x, out
    model.ltmp_record = Record(
        cfg.method, padded, N - cfg.num_prefix, cfg.num_prefix, steps, out.size.dtype, x.device, B, sources, keeps
    )
    if p.train and steps[0].kept_frac.requires_grad:
        model.ltmp_record.counts()  # built now, with its gradients, whatever mode a first read is in
    return x, out


def _padded(state: TokenState, p: Plan) -> TokenState:
    """The state with (B, N) sizes and keep mask (1 surviving, 0 removed or padding; None if neither exists)."""
    if p.train:
        return state
    L = state.layout
    keep = None if L.real is None else L.real.to(state.size.dtype)
    return TokenState(size=L.pad(state.size), layout=L, keep=keep, merged_once=state.merged_once)
