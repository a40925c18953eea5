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

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .adapters import BlockView
from .record import Record
from .step import Layout, Plan, ReduceConfig, StepResult, TokenState, reduce_step

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

_EXPORTING = False  # set by :func:`exporting` (ltmp.export) while torch.export traces a patched model


@contextlib.contextmanager
def exporting():
    """Mark a torch.export trace of a patched model for :func:`is_exporting` (``ltmp.export`` does)."""
    global _EXPORTING
    before, _EXPORTING = _EXPORTING, True
    try:
        yield
    finally:
        _EXPORTING = before


#: torch.compiler.is_exporting tells export from compile only from torch 2.14: before, Dynamo replaced the call by
#: a constant True, also under torch.compile (pytorch/pytorch#176347, fixed by #176499).
_TORCH_IS_EXPORTING_EXACT = torch.torch_version.TorchVersion(torch.__version__) >= (2, 14)


def is_exporting() -> bool:
    """True while torch.export traces the model: inside :func:`exporting`, or where
    ``torch.compiler.is_exporting`` says so on torch >= 2.14."""
    fn = getattr(torch.compiler, "is_exporting", None)
    return _EXPORTING or (_TORCH_IS_EXPORTING_EXACT and fn is not None and bool(fn()))


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
    return Plan(train=training, grad=grad, symbolic=exporting_now, compiling=traced and not exporting_now,
                static=not training and not cfg.learned, amp=torch.is_autocast_enabled(x.device.type),
                attention=attention, group_macs=tune["group_macs"] if groups else None,
                max_buckets=tune["max_buckets"],
                cache=not traced and _python_dispatch._get_current_dispatch_mode() is None
                and not (x.is_cuda and torch.cuda.is_current_stream_capturing()), views=not (grad or traced))


def plan_buckets(counts: list[int], pair_cost: float, group_cost: float, max_buckets: int
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
    span = np.where(np.triu(np.ones((P, P), dtype=bool), k=1), (pts[None, :] - pts[:, None]) * last[None, :],
                    np.inf) + group_cost  # (P, P) [i, j]
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
        groups.append((order[pts[i]:pts[j]], c[pts[j] - 1]))
        j, g = i, g - 1
    return groups[::-1]


def attention(plan: Plan, view: BlockView, cfg: ReduceConfig, qkv: Tensor, keep: Tensor | None,
              log_size: Tensor | None, rows: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention of eq. 5-7 on a batch of images, with the backend of the plan.

    Args:
        qkv: (b, n, 3 * H * D) the projections. keep: (b, n) mask of the keys that count (straight-through in
            train mode), or None. log_size: (b, n) for proportional attention (-inf at keys that do not count),
            or None. rows: (b, n) the query rows that eq. 17 averages over (None: all).

    Returns:
        The output (b, n, H * D), the importance (b, n) of eq. 16/17 if the method prunes, and the merge metric
        (b, n, D) (keys summed over heads) if it merges.
    """
    b, n, _ = qkv.shape
    H, D = view.heads, view.head_dim
    soft = keep is not None and keep.requires_grad  # the mask needs eq. 6's gradient
    backend = plan.attention if view.fused and not soft else "explicit"
    if plan.views and qkv.stride(2) == 1:  # timm's reshape and permute as one strided view
        t = qkv.as_strided((3, b, H, n, D), (H * D, qkv.stride(0), D, qkv.stride(1), 1), qkv.storage_offset())
    else:
        t = qkv.view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)  # (3, b, H, n, D)
    q, k, v = (t.contiguous() if backend == "explicit" else t).unbind(0)  # (b, H, n, D) each
    q, k = view.q_norm(q), view.k_norm(k)
    importance = fused = None
    bias = None if backend == "explicit" else ops.key_bias(keep, log_size, q.dtype)  # (b, n) or None
    bias = None if bias is None else bias.view(b, 1, 1, n)
    if backend == "lse":
        fused = ops.attention_with_lse(q, k, v, view.scale, bias)
    if fused is not None:
        o, lse = fused  # (b, H, n, D), (b, H, n)
        importance = ops.importance_from_lse(q, k, lse, view.scale, bias, rows, cfg.importance)  # (b, n)
    elif backend == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=view.attn_drop if view.training
                                           else 0.0, scale=view.scale)  # (b, H, n, D)
    else:
        o, probs = ops.masked_attention(q, k, v, view.scale, keep, log_size, soft,
                                        view.attn_drop if view.training else 0.0, cfg.mask_grad, plan.amp)
        if cfg.needs_importance:
            importance = ops.importance_scores(probs, rows, cfg.importance)  # (b, n)
    metric = ops.head_sum(k) if cfg.needs_metric else None  # (b, n, D)
    if plan.views and o.stride() == (n * H * D, D, H * D, 1):  # a fused kernel's (b, n, H, D) layout: a view
        return o.as_strided((b, n, H * D), (n * H * D, H * D, 1), o.storage_offset()), importance, metric
    return o.transpose(1, 2).reshape(b, n, H * D), importance, metric


def attend(plan: Plan, view: BlockView, cfg: ReduceConfig, qkv: Tensor, state: TokenState
           ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Attention on the token layout: train mode's (B, N, ...) batch, or eval's rows (T, ...) as a padded batch
    (a view when nothing is padded), in groups of images of similar token counts where the plan says so.

    Returns:
        The output like qkv, (B, N, H * D) or (T, H * D); the importance (B, N) and the metric (B, N, D), padded.
    """
    L = state.layout
    if plan.train:
        ls = state.size.log() if state.merged_once else None
        return attention(plan, view, cfg, qkv, state.keep, ls, state.keep)
    qkv = L.pad(qkv)  # (B, N, 3 * H * D)
    ls = L.pad(state.size).log() if state.merged_once else None  # (B, N); -inf at padding (size 0)
    real = L.real  # (B, N) or None
    keep = None if real is None or ls is not None else real.to(state.size.dtype)  # keys to mask (padding)
    groups = None
    if plan.group_macs is not None and L.counts is not None:
        groups = plan_buckets(L.counts, 2.0 * view.heads * view.head_dim, plan.group_macs, plan.max_buckets)
    if groups is None:
        o, importance, metric = attention(plan, view, cfg, qkv, keep, ls, real)
        return L.take(o), importance, metric
    B, N = L.batch, L.length
    o = qkv.new_zeros(B, N, view.heads * view.head_dim)  # (B, N, H * D)
    importance = qkv.new_zeros(B, N, dtype=state.size.dtype) if cfg.needs_importance else None
    metric = qkv.new_zeros(B, N, view.head_dim) if cfg.needs_metric else None
    for sel, n in groups:
        idx = torch.tensor(sel, device=qkv.device)  # (b,)
        full = all(L.counts[i] == n for i in sel)  # no padding in this group
        r = None if full else real.index_select(0, idx)[:, :n]  # (b, n)
        og, ig, mg = attention(plan, view, cfg, qkv.index_select(0, idx)[:, :n],
                               None if keep is None or full else r.to(keep.dtype),
                               None if ls is None else ls.index_select(0, idx)[:, :n], r)
        for whole, part in ((o, og), (importance, ig), (metric, mg)):
            if part is not None:
                whole[:, :n].index_copy_(0, idx, ops.cast(part, whole.dtype))
    return L.take(o), importance, metric


def block(plan: Plan, view: BlockView, blk: nn.Module, x: Tensor, state: TokenState, cfg: ReduceConfig,
          layer: int, rate: int) -> tuple[Tensor, TokenState, StepResult]:
    """A pre-norm block with the reduction step between attention and MLP (the paper's Figure 2)."""
    y = view.norm1(x)  # (B, N, C) or (T, C)
    o, importance, metric = attend(plan, view, cfg, view.qkv(y), state)  # (..., H * D)
    o = view.head_norm(o)
    x = x + view.out(o if view.gate is None else o * view.gate(y))
    x, state, step = reduce_step(x, state, cfg, plan, layer, importance, metric,
                                 getattr(blk, "merge_threshold", None), getattr(blk, "prune_threshold", None), rate)
    return x + view.mlp(x), state, step


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
        state = TokenState(size=size.view(-1), layout=Layout(B, N),
                           source=None if source is None else source.reshape(B * N, N))
    steps, padded = [], [N]
    sources, keeps = ([], []) if cfg.trace_source else (None, None)
    for i, blk in enumerate(adapter.blocks(model)):
        x, state, step = block(p, adapter.view(model, blk), blk, x, state, cfg, i, 0 if cfg.rate is None else
                               cfg.rate[i])
        steps.append(step)
        padded.append(state.layout.length)
        if sources is not None:
            out = _padded(state, p)
            sources.append((state.source if p.train else state.layout.pad(state.source))[:, :, cfg.num_prefix:])
            keeps.append(out.size > 0 if out.keep is None else out.keep > 0.5)
    out = _padded(state, p)
    x = x if p.train else state.layout.pad(x)  # (B, N', C)
    if p.symbolic or torch.jit.is_tracing():  # symbolic counts: exported graphs have no record
        return x, out
    model.ltmp_record = Record(cfg.method, padded, N - cfg.num_prefix, cfg.num_prefix, steps, out.size.dtype,
                               x.device, B, sources, keeps)
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


def log_size(state: TokenState) -> Tensor | None:
    """log of the (B, N) token sizes for proportional attention (ToMe), or None while all sizes are 1."""
    return state.size.log() if state.merged_once else None


def mean_pool(x: Tensor, state: TokenState, skip: int) -> Tensor:
    """The mean of the surviving tokens from position ``skip`` on, each weighted by its size (the patches it
    stands for), so that a merged token counts as the patches it replaced: (B, N, C) -> (B, C). Equal to the plain
    mean over the patch tokens of an unreduced model."""
    w = state.size if state.keep is None else state.size * (state.keep > 0.5)  # (B, N)
    w = w[:, skip:]
    return (x[:, skip:] * w[..., None].to(x.dtype)).sum(1) / w.sum(1, keepdim=True).to(x.dtype)  # (B, C)


def pool_bias(state: TokenState, dtype: torch.dtype) -> Tensor | None:
    """The additive key bias (B, N) of an attention-pool head over the surviving tokens: log size (a merged token
    weighs as the patches it replaced, as in proportional attention) and -inf at removed or padded tokens; None
    when no token was reduced."""
    keep = None if state.keep is None else (state.keep > 0.5).to(dtype)
    return ops.key_bias(keep, log_size(state), dtype)

