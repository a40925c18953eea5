"""One block's reduction step (paper section 3, Figure 2): decide, then apply.

Between a block's attention and its MLP, :func:`reduce_step` runs the method's operations in order. Each operation
first *decides*, the same way in every mode: :func:`decide_merge` (ToMe's bipartite matching of the survivors in
order, then eq. 1's threshold or a fixed rate's k best) and :func:`decide_prune` (eq. 1 on the importance scores of
eq. 16/17, or the k least important). Learned thresholds and fixed rates differ only in how they select. Then the
step *applies* the decisions:

- in train mode as straight-through masks (eq. 3): every token stays in the (B, N, C) tensor, merges are
  size-weighted averages whose weights carry the merge mask, and the keep mask carries the gradient to the
  thresholds (:func:`_apply_masks`);
- in eval mode by removing the tokens: merging and compaction are one size-weighted sum of the token rows into
  their new rows (:func:`_apply_rows`). Rows are packed image by image (:class:`Layout`), so one image is a batch
  of one, and fixed rates need no host read (their counts follow from the shapes).

Train and eval make the same decisions on the same scores; the tests hold them to the same tokens and outputs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from . import ops
from .config import ReduceConfig


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one forward runs, read once from the mode (``ltmp.engine.plan``); nothing below asks torch again."""

    train: bool  # straight-through masks, every token stays (eq. 3); else tokens are removed
    static: bool  # fixed rates in eval: every count follows from the shapes (no host read)
    symbolic: bool  # torch.export: token counts are symbolic, so no Python branch may read them
    compiling: bool  # torch.compile: a batch keeps its padding even where every image keeps the same count
    keep_one: bool  # pruning always leaves one patch token (the head reads the patch tokens, or there is no other)
    tuning: dict  # the device's speed choices (``ltmp.engine.TUNING``; the default while tracing)


class Layout:
    """Eval mode: where each image's tokens are among the rows (T, ...) of the token tensors, image by image, in
    order. ``real`` (B, N) marks a real token at each position of the padded batch and ``counts`` are each image's
    tokens on the host; both None when every image has ``length`` tokens (the rows are then the batch flattened)."""

    def __init__(self, batch: int, length: int, real: Tensor | None = None, counts: list[int] | None = None):
        self.batch = batch
        self.length = length
        self.real = real
        self.counts = counts
        # (T,) the flat position (b * N + j) of each row; None without padding
        self.index = None if real is None else torch.nonzero_static(real.view(-1), size=sum(counts)).view(-1)

    def pad(self, rows: Tensor) -> Tensor:
        """Rows (T, ...) as the padded batch (B, N, ...), 0 at padding."""
        shape = (self.batch, self.length, *rows.shape[1:])
        if self.index is None:
            return rows.view(shape)
        return rows.new_zeros(self.batch * self.length, *rows.shape[1:]).index_copy_(0, self.index, rows).view(shape)

    def take(self, flat: Tensor) -> Tensor:
        """The rows (T, ...) of a padded batch's positions, flattened (B * N, ...)."""
        return flat if self.index is None else flat.index_select(0, self.index)


@dataclasses.dataclass
class TokenState:
    """The token set between blocks, besides the tokens x themselves: in train mode (B, N, C) with every token,
    in eval mode the rows (T, C) of the surviving ones (:class:`Layout`). Prefix tokens stay at the front."""

    size: Tensor  # patches each token stands for: (B, N) in train mode, (T,) in eval mode
    layout: Layout  # eval: where the rows are (train: B and N)
    keep: Tensor | None = None  # train mode: (B, N) straight-through mask (eq. 3); eval: None (every row survives)
    source: Tensor | None = None  # patches covered by each token, (B, N, N0) or (T, N0), if traced
    merged_once: bool = False  # sizes may differ from 1 (proportional attention needed)
    track: Track | None = None  # where each token of the first block went, for dense outputs


class Track(NamedTuple):
    """Dense outputs: where each of the B * N0 tokens that entered the first block went (:func:`follow`)."""

    at: Tensor  # (B * N0,) the row (eval) or flat position b * N + j (train) of the token it is part of; -1 removed
    last: Tensor | None  # (B * N0, C) the feature it had when its token was removed (0 before); None: fill 0

    @staticmethod
    def start(x: Tensor, fill: str) -> Track:
        """Every token of x (B, N0, C) in its own row, nothing removed (``fill``: ``ReduceConfig.dense_fill``)."""
        B, N, C = x.shape
        return Track(torch.arange(B * N, device=x.device), None if fill == "zero" else x.new_zeros(B * N, C))


def follow(track: Track, x: Tensor, to: Tensor, sparse: bool = False) -> Track:
    """Dense outputs: the track after a step that moved the rows of x (M, C) to rows ``to`` (M,) (-1: removed).
    A token removed here leaves in ``last`` the feature it had entering the step: with ``sparse`` (eval, outside
    export and compile) copied in place for those tokens alone, after one host read of which they are (a tenth of
    the time of a select over every token, ``benchmarks/dense.py``)."""
    at = track.at.clamp(min=0)  # (B * N0,)
    new = torch.where(track.at >= 0, to[at], -1)  # (B * N0,)
    last = track.last
    if last is not None:
        gone = (track.at >= 0) & (new < 0)  # (B * N0,)
        if sparse:
            rows = gone.nonzero().squeeze(1)  # (G,)
            last = last.index_copy_(0, rows, x.index_select(0, at[rows]).to(last.dtype))  # (B * N0, C)
        else:
            last = torch.where(gone[:, None], x.index_select(0, at).to(last.dtype), last)  # (B * N0, C)
    return Track(new, last)


def dense(x: Tensor, track: Track) -> Tensor:
    """Each token that entered the first block, with the feature of the token it is now part of (removed ones:
    ``track.last``): the rows (T, C) or tokens (B, N, C) of x as (B * N0, C)."""
    rows = x.reshape(-1, x.shape[-1])  # (T, C) or (B * N, C)
    kept = rows[track.at.clamp(min=0)]  # (B * N0, C)
    fill = kept.new_zeros(()) if track.last is None else track.last.to(kept.dtype)
    return torch.where((track.at >= 0)[:, None], kept, fill)  # (B * N0, C)


class Captured(NamedTuple):
    """One reduction decision's scores, handed to ``ReduceConfig.capture`` before eq. 1 compares them with the
    threshold (analysis records them; ``ltmp calibrate --mode quantile`` sets the threshold from them)."""

    layer: int
    op: str  # "merge" or "prune"
    scores: Tensor  # (B, K) similarity to the best match in set B (merge) or importance (prune)
    candidates: Tensor  # (B, K) bool: set A tokens that may merge, or the surviving patch tokens (prune)
    importance: Tensor | None  # (B, K) merge decisions: the A tokens' importance, where the method computes it
    threshold: Tensor | None  # the learned threshold the scores are compared with (fixed rates: None)

    @staticmethod
    def of(layer: int, op: str, scores: Tensor, cand: Tensor | None, imp: Tensor | None, threshold: Tensor | None):
        """The decision's tensors detached and on the host (``cand`` None: every token a candidate)."""
        cand = torch.ones_like(scores, dtype=torch.bool) if cand is None else cand
        host = [None if t is None else t.detach().cpu() for t in (scores, cand, imp)]
        return Captured(layer, op, *host, threshold)


@dataclasses.dataclass
class StepResult:
    """Per-image counts of one block's reduction: ints (the same in every image), host lists, (B,) tensors, or
    (B, K) bool masks whose row sums are the counts (summed when the record is read)."""

    merged: Tensor | int | list[int]  # tokens merged away in this block
    pruned: Tensor | int | list[int]  # tokens pruned in this block
    kept: Tensor | int | list[int]  # patch tokens surviving this block (hard count)
    kept_frac: Tensor | int | list[int]  # surviving patch tokens, differentiable in train mode (m-bar of eq. 13, x n)


class Merge(NamedTuple):
    """A merge decision: the set-A tokens at ``src`` (B, K) that ``hard`` selects join the tokens at ``dst``."""

    src: Tensor  # (B, K) positions of the set-A tokens
    dst: Tensor  # (B, K) positions of their most similar set-B tokens
    mask: Tensor | None  # (B, K) train mode: merged as straight-through 0/1 values (eq. 1-2); eval: None
    hard: Tensor | None  # (B, K) bool, merged (fixed rates in eval decide only ``stays``)
    stays: Tensor  # (B, K) bool, not merged
    cand: Tensor | None  # (B, K) bool, set-A tokens that may merge (None: every one)


def decide_merge(
    cfg: ReduceConfig,
    plan: Plan,
    layer: int,
    metric: Tensor,
    alive: Tensor | None,
    in_order: bool,
    threshold: Tensor | None,
    rate: int,
    importance: Tensor | None,
) -> Merge:
    """ToMe's matching over the survivors in order (A/B alternate over them, prefix tokens never merge or receive),
    then eq. 1: an A token merges into its most similar B token where the similarity passes the threshold, or for
    fixed rates where it is among the ``rate`` best matched (ties to the earlier position; eval: every image's).

    Args:
        metric: (B, N, D) keys summed over heads. alive: (B, N) bool, the survivors (None: every token).
        in_order: the survivors are the first positions of each row (eval), so no reordering is needed.
    """
    B, N, _ = metric.shape
    first = cfg.set_starts  # sets A and B start past the prefix
    order = blocked = cand = None
    if alive is not None:
        if not in_order:  # the survivors first, in order (any sort of these distinct keys gives this order)
            pos = torch.arange(N, device=alive.device)
            order = torch.where(alive, pos, pos + N).topk(N, dim=1, largest=False).indices  # (B, N)
            metric, alive = metric.gather(1, order[..., None].expand(metric.shape)), alive.gather(1, order)
        blocked = ops.blocked_pairs(alive, first)  # (B, Na, Nb)
        cand = alive[:, first[0] :: 2]  # (B, Na)
    score, j = ops.match(metric, blocked, first, pad=plan.symbolic)  # (B, Na) each
    src = torch.arange(N, device=metric.device)[first[0] :: 2].expand(B, -1)  # (B, Na) set A's positions
    dst = (first[1] + 2 * j).clamp(max=N - 1)  # (B, Na) their B tokens' (match's padding column: never selected)
    if order is not None:
        src, dst = order.gather(1, src), order.gather(1, dst)
    if cfg.capture is not None:
        imp = None if importance is None else importance.gather(1, src)
        cfg.capture(Captured.of(layer, "merge", score, cand, imp, threshold))
    if cfg.learned:
        hard, mask = ops.threshold_mask(score, threshold, cfg.tau, soft=plan.train)  # (B, Na) eq. 1-2 (0 outside cand)
    else:  # the k best matched, k = min(rate, |A|, |B|) per image
        rank = ops.rank(score, largest=True)  # (B, Na)
        if plan.static:  # eval: ``rate`` is what every image merges (static_counts)
            return Merge(src, dst, None, None, rank >= rate, cand)
        k = torch.minimum(cand.sum(1), alive[:, first[1] :: 2].sum(1)).clamp(max=rate)[:, None]  # (B, 1) train
        hard = rank < k  # (B, Na)
        mask = hard.to(torch.float32)
    return Merge(src, dst, mask, hard, ~hard, cand)


def decide_prune(
    cfg: ReduceConfig,
    plan: Plan,
    layer: int,
    importance: Tensor,
    alive: Tensor | None,
    threshold: Tensor | None,
    rate: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Which surviving patch tokens ``alive`` (B, N) (None: every token) are pruned: those whose importance does not
    pass the threshold (eq. 1), or for fixed rates the ``rate`` least important (ties to the earlier position; in
    eval ``rate`` is the count every image prunes, :func:`static_counts`). With ``keep_one`` an image's most
    important candidate is spared when every candidate would go.

    Returns:
        The pruned tokens (B, N) bool (among the survivors), the candidates (B, N) bool, and in train mode the
        candidates' keep mask (B, N) with straight-through values (eq. 2; else None).
    """
    B, N = importance.shape
    cand = (torch.arange(N, device=importance.device) >= cfg.num_prefix).expand(B, N)  # (B, N) patch tokens
    cand = cand if alive is None else alive & cand  # the surviving ones
    if cfg.capture is not None:
        cfg.capture(Captured.of(layer, "prune", importance, cand, None, threshold))
    if not cfg.learned:  # the k least important candidates; with keep_one, k leaves one
        rank = ops.rank(torch.where(cand, importance, float("inf")), largest=False)  # (B, N)
        if plan.static:  # k is at most the candidates: the others rank after them
            return rank < rate, cand, None
        drop = rank < (cand.sum(1, keepdim=True) - int(plan.keep_one)).clamp(0, rate)  # (B, N)
        return drop, cand, (~drop).to(importance.dtype)
    kept, soft = ops.threshold_mask(importance, threshold, cfg.tau, soft=plan.train)  # (B, N) each, eq. 1-2
    drop = cand & ~kept  # (B, N)
    if plan.keep_one:  # never prune an image's last patch token: spare its most important one
        top = importance.detach().masked_fill(~cand, float("-inf")).argmax(1, keepdim=True)  # (B, 1)
        everything = drop.sum(1, keepdim=True) == cand.sum(1, keepdim=True)  # (B, 1)
        spare = torch.zeros_like(cand).scatter_(1, top, True) & everything & drop  # (B, N)
        soft = None if soft is None else soft + spare.to(soft.dtype)
        drop = drop & ~spare
    return drop, cand, soft


def static_counts(ops_: tuple[str, ...], t: int, rate: int, keep_one: bool) -> tuple[int, int]:
    """The tokens a fixed rate merges and prunes in every image from the ``t`` patch tokens entering a block (eval:
    static shapes; ``ltmp.flops.schedule_counts``): ToMe's matching pairs at most ``t // 2`` (set A and set B
    alternate over the patch tokens, ``ReduceConfig.set_starts``), then the ``rate`` least important of the rest
    go, one always left with ``keep_one``."""
    merged = min(rate, t // 2) if "merge" in ops_ else 0
    pruned = max(0, min(rate, t - merged - int(keep_one))) if "prune" in ops_ else 0
    return merged, pruned


def reduce_step(
    x: Tensor,
    state: TokenState,
    cfg: ReduceConfig,
    plan: Plan,
    layer: int,
    importance: Tensor | None,
    metric: Tensor | None,
    merge_threshold: Tensor | None,
    prune_threshold: Tensor | None,
    rate: int,
) -> tuple[Tensor, TokenState, StepResult]:
    """Merge and/or prune one block's tokens, between its attention and its MLP: decide, then apply.

    Args:
        x: (B, N, C) tokens (train) or their rows (T, C) (eval), after the attention residual.
        importance: (B, N) scores of eq. 16/17 from this block's attention, if the method prunes (padded in eval).
        metric: (B, N, D) keys summed over heads, if the method merges (padded in eval).
        merge_threshold, prune_threshold: learned thresholds (scalars); rate: a fixed rate's tokens here.
    """
    L = state.layout
    B, N = L.batch, L.length
    if plan.train:  # the survivors (B, N): train mode's kept tokens, eval's real rows (None: every position)
        alive = torch.ones(B, N, dtype=torch.bool, device=x.device) if state.keep is None else state.keep > 0.5
    else:
        alive = L.real
    in_order = not plan.train or cfg.train_order == "reference"  # (reference order: A/B over all positions)
    # (merge, prune) rates; fixed rates in eval: the exact counts
    rates = static_counts(cfg.ops, N - cfg.num_prefix, rate, plan.keep_one) if plan.static else (rate, rate)
    decisions = {}  # op -> its decision, in the method's order
    for op in cfg.ops:
        if op == "merge":
            m = decide_merge(
                cfg,
                plan,
                layer,
                metric,
                alive,
                in_order,
                merge_threshold,
                rates[0],
                importance,
            )
            stays = m.stays if alive is None else alive.gather(1, m.src) & m.stays  # (B, Na)
            alive = torch.ones(B, N, dtype=torch.bool, device=x.device) if alive is None else alive
            alive = alive.scatter(1, m.src, stays)  # (B, N)
            if cfg.ops[-1] == "prune":  # a merged group's importance, for pruning
                importance = ops.group_max(importance, m.src, m.dst, m.stays)  # (B, N)
            decisions[op] = m
        else:
            drop, cand, soft = decide_prune(cfg, plan, layer, importance, alive, prune_threshold, rates[1])
            alive = ~drop if alive is None else alive & ~drop  # (B, N)
            # (ltpm) a merge after pruning splits A/B over the survivors, not the positions
            in_order = plan.train and cfg.train_order == "reference"
            decisions[op] = (drop, cand, soft)
    if not plan.train:
        return _apply_rows(x, state, cfg, plan, decisions, alive, rates)
    out, state, result = _apply_masks(x, state, cfg, decisions)  # (B, N, C)
    if state.track is not None:  # dense outputs: where each token of x went
        state = _follow_masks(x, state, decisions)
    if cfg.train_order == "reference" and "merge" in cfg.ops:
        out, state = _reorder(out, state, cfg)
    return out, state, result


def _apply_masks(x: Tensor, state: TokenState, cfg: ReduceConfig, decisions: dict) -> tuple:
    """Train mode: the decisions as straight-through masks, every token kept in place.

    A merge adds each A token's size-weighted value into its B token with the merge mask as its weight (the
    merged averages pass the gradient to the merge threshold, ``merge_grad="average"``); tokens that receive
    nothing are returned bit-identical. The keep mask follows eq. 3's case rule: a surviving candidate takes this
    block's masks (``1 - M_merge``, ``M_prune``, their product for a candidate of both, or the later one's with
    ``combine="overwrite"``); every other token keeps the mask it entered with (a removed one its old value, with
    the gradient path to the threshold that removed it)."""
    B, N, C = x.shape
    size, source = state.size, state.source
    entering = torch.ones_like(size) if state.keep is None else state.keep  # (B, N)
    factor = touched = None
    merged = pruned = 0
    for op, d in decisions.items():
        if op == "merge":
            w = d.mask if cfg.merge_grad == "average" else d.mask.detach()  # (B, K)
            K = d.src.shape[1]
            # every token stays in its row; each A token also joins its target's row with weight w
            offsets = (torch.arange(B, device=x.device) * N)[:, None]  # (B, 1)
            rows = torch.cat([torch.arange(B * N, device=x.device), (d.dst + offsets).view(-1)])  # (B N + B K,)
            moved = d.src[..., None]  # (B, K, 1)
            xs = torch.cat([x.reshape(B * N, C), x.gather(1, moved.expand(-1, -1, C)).reshape(B * K, C)])
            s = torch.cat([size.view(-1), (size.gather(1, d.src) * w).view(-1)])  # (B N + B K,)
            extra = None
            if source is not None:
                extra = source.gather(1, moved.expand(-1, -1, source.shape[2])) * d.hard[..., None]  # (B, K, N0)
                extra = torch.cat([source.reshape(B * N, -1), extra.reshape(B * K, -1)])
            out, den, extra = ops.merge_rows(xs, s, rows, B * N, extra)
            received = torch.zeros_like(size).scatter_add(1, d.dst, d.hard.to(size.dtype)) > 0  # (B, N)
            x = torch.where(received[..., None], out.view(B, N, C), x)  # (B, N, C)
            size = den.view(B, N)
            source = None if extra is None else extra.view(B, N, -1)
            m = torch.ones_like(size).scatter(1, d.src, 1 - d.mask.to(size.dtype))  # (B, N) 1 - M_merge at set A
            cand = torch.zeros(B, N, dtype=torch.bool, device=x.device).scatter(1, d.src, d.cand)  # (B, N)
            merged = d.hard.sum(1)
        else:
            drop, cand, m = d
            m = torch.where(cand, m, torch.ones_like(m))  # (B, N)
            pruned = drop.sum(1)
        if factor is None:
            factor = m
        else:  # a token both modules decide on: the product of their masks, or the later one's alone
            factor = torch.where(cand, m, factor) if cfg.combine == "overwrite" else factor * m
        touched = cand if touched is None else touched | cand
    keep = torch.where(touched, factor, entering)  # (B, N) eq. 3
    patch_keep = keep[:, cfg.num_prefix :]  # (B, N - P)
    result = StepResult(merged=merged, pruned=pruned, kept=(patch_keep > 0.5).sum(1), kept_frac=patch_keep.sum(1))
    state = dataclasses.replace(
        state, size=size, keep=keep, source=source, merged_once=state.merged_once or "merge" in cfg.ops
    )
    return x, state, result


def _reorder(x: Tensor, state: TokenState, cfg: ReduceConfig) -> tuple[Tensor, TokenState]:
    """Train mode with ``train_order="reference"``: the tokens (B, N, C) and their state in the order the reference
    code leaves them after a block that merges (its ``cat([src, dst])``): the prefix tokens, then set A's
    positions, then set B's."""
    pos = torch.arange(x.shape[1], device=x.device)  # (N,)
    a, b = cfg.set_starts
    order = torch.cat([pos[: cfg.num_prefix], pos[a::2], pos[b::2]])  # (N,)

    def put(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[:, order]

    track = state.track
    if track is not None:  # flat positions b * N + j -> b * N + (j's new position)
        N = x.shape[1]
        at = track.at.clamp(min=0)  # (B * N0,)
        track = Track(torch.where(track.at >= 0, at - at % N + order.argsort()[at % N], -1), track.last)
    return put(x), dataclasses.replace(
        state, size=put(state.size), keep=put(state.keep), source=put(state.source), track=track
    )


def _follow_masks(x: Tensor, state: TokenState, decisions: dict) -> TokenState:
    """Train mode's dense-output track after a step on x (B, N, C) (the tokens entering it): each position's token
    is now its own, or its merge target's, if that is kept."""
    B, N, _ = x.shape
    target = torch.arange(N, device=x.device).expand(B, N)  # (B, N)
    m = decisions.get("merge")
    if m is not None:
        target = target.scatter(1, m.src, torch.where(m.hard, m.dst, m.src))  # (B, N)
    kept = (state.keep > 0.5).gather(1, target)  # (B, N)
    to = torch.where(kept, target + torch.arange(B, device=x.device)[:, None] * N, -1)  # (B, N) flat, -1 removed
    return dataclasses.replace(state, track=follow(state.track, x.reshape(B * N, -1), to.view(-1)))


def _apply_rows(
    x: Tensor,
    state: TokenState,
    cfg: ReduceConfig,
    plan: Plan,
    decisions: dict,
    alive: Tensor,
    rates: tuple[int, int],
) -> tuple:
    """Eval mode: the survivors ``alive`` (B, N) keep their order and become the new rows, image by image; a merged
    token joins its target's row, and each new row is the size-weighted average of the rows it receives (a target
    pruned in the same block takes its group along). One sum of rows into rows does the merging and the
    compaction. For fixed rates the counts are the ``rates`` (:func:`static_counts`); for learned thresholds they
    are read back from the device, the step's one host synchronisation."""
    L = state.layout
    B, N = L.batch, L.length
    P = cfg.num_prefix
    merge, prune = decisions.get("merge"), decisions.get("prune")
    if plan.static:  # fixed rates: every image removes the same number of tokens
        n_new = N - sum(rates)
        counts = None
        result = StepResult(*rates, kept=n_new - P, kept_frac=n_new - P)
    else:
        count_t = alive.sum(1)  # (B,)
        counts = count_t.tolist()  # the host read
        for c in counts if plan.symbolic else ():  # an export's symbolic counts: bounds for its slices
            torch._check(c >= 0)
            torch._check(c <= N)
        kept = [c - P for c in counts]
        merged = 0 if merge is None else merge.hard
        pruned = 0 if prune is None else prune[0]
        result = StepResult(merged, pruned, kept=kept, kept_frac=kept)
        n_new = max(counts)
    flat = alive.view(-1)  # (B * N,)
    slot = flat.cumsum(0) * flat  # (B * N,) survivors' new rows from 1, 0 (cut) the others
    if merge is not None:  # a merged token joins its target's row (row 0 if the target was pruned)
        at = slot.view(B, N)
        at.scatter_add_(1, merge.src, at.gather(1, merge.dst).masked_fill(merge.stays, 0))
    T_new = B * n_new if counts is None else sum(counts)
    rows = L.take(slot)  # (T,) each row's new row, from 1
    track = None if state.track is None else follow(state.track, x, rows - 1, not (plan.symbolic or plan.compiling))
    x, size, source = ops.merge_rows(x, state.size, rows, T_new + 1, state.source)
    if counts is None or B == 1 or (not plan.compiling and all(c == n_new for c in counts)):
        layout = Layout(B, n_new)
    else:  # (under torch.compile a padded layout always: a check of equal counts would guard on the counts)
        layout = Layout(B, n_new, torch.arange(n_new, device=x.device) < count_t[:, None], counts)
    merged_once = state.merged_once or merge is not None
    return x[1:], TokenState(size[1:], layout, None, None if source is None else source[1:], merged_once, track), result
