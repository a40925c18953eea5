"""The per-block reduction step of LTMP (paper section 3.3), one definition for every method and both modes.

A block runs attention on the surviving tokens, then this step merges and/or prunes (in the method's order), then
the MLP. Train mode keeps every token in the tensor and carries a straight-through keep mask that follows eq. 3's
case rule: a surviving candidate takes this block's masks (``1 - M_merge``, ``M_prune``, their product for a
candidate of both), a token removed earlier keeps its earlier mask (value 0, with the gradient path to the
threshold that removed it); eval mode removes the tokens. Both run the masked step :func:`reduce_step`, so they
make the same decisions. :func:`step_kind` picks, once per forward, faster forms of the same step for eval without
gradients, which the tests hold to the same decisions: fixed rates run :func:`_reduce_fixed` (static shapes, no
host reads); learned thresholds run :func:`_reduce_compact` on a batch (the masked step's decisions as hard masks,
then merging and compaction in one scatter, one host read per block: the survivor counts) and
:func:`_reduce_single` on one image (index lists, fewer operator calls). Under ``torch.compile`` the host read is
the one graph break per block.
:class:`Execution` holds these choices and the other speed settings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import ops

#: The order of reduction operations of each method, and whether they use learned thresholds or a fixed rate.
METHODS: dict[str, tuple[tuple[str, ...], str]] = {
    "ltmp": (("merge", "prune"), "threshold"),  # learned thresholds, merge then prune (the paper's default)
    "ltpm": (("prune", "merge"), "threshold"),  # learned thresholds, prune then merge (Table 4)
    "ltm": (("merge",), "threshold"),  # learned thresholds, merging only (Table 5)
    "ltp": (("prune",), "threshold"),  # learned thresholds, pruning only (Table 5)
    "tome": (("merge",), "topk"),  # ToMe: r tokens merged per layer
    "topk-prune": (("prune",), "topk"),  # k least important tokens pruned per layer
    "topk-mp": (("merge", "prune"), "topk"),  # k merged and k pruned per layer
}

#: Methods with learned thresholds (``ltmp train`` trains them; their thresholds files load them).
LEARNED = tuple(m for m, (_, kind) in METHODS.items() if kind == "threshold")
#: Fixed-rate methods (ToMe's ``r``, the top-k baselines' ``k``).
FIXED_RATE = tuple(m for m, (_, kind) in METHODS.items() if kind == "topk")

#: How merge thresholds learn in train mode (``ReduceConfig.merge_grad``).
MERGE_GRADS = ("average", "mask")


@dataclasses.dataclass
class Execution:
    """How a patched model runs its forwards: every choice that changes speed but not results, in one place.

    :func:`step_kind` picks the reduction step once per forward from these fields, the mode, the method and the
    batch size. Set them on a patched model's ``ltmp_config.execution`` (a benchmark or a user on another device
    may); the defaults were tuned on the 2-core CPU of docs/performance.md.
    """

    static_rates: bool = True  # fixed rates in eval: the static-shape step without host reads (_reduce_fixed)
    single_image: bool = True  # one image in eval: the index-list step (_reduce_single), fewer operator calls
    fused_attention: bool = True  # scaled_dot_product_attention where no probabilities are needed
    #: pruning in eval without gradients: attention from a fused kernel that returns its log-sum-exp, and the
    #: importance scores from one more q k^T pass (ops.importance_from_lse) instead of explicit fp32
    #: probabilities. Off: on the 2-core CPU it is slower (docs/performance.md); not yet measured on a GPU.
    importance_from_lse: bool = False
    #: padded eval batches run token-wise layers packed above this share of padding; without gradients the
    #: tokens then stay packed rows to the end of the blocks, and grouped attention (max_buckets) always packs
    pack_above: float = 0.05
    max_buckets: int = 4  # padded eval batches run attention in at most this many groups (1: never group)
    #: fixed cost of one more attention group in multiply-accumulates, per device type; a device not listed never
    #: groups. CPU: about 40 operator calls of ~6 us each, at the ~50 GMAC/s attention reaches on the 2-core CPU
    #: of docs/performance.md (benchmarks/speed.py). No CUDA entry: on an H100 (DeiT-S, batch 32) 2 or 4 groups
    #: made the forward 1.4x / 2x slower than the whole padded batch (benchmarks/grouping.py).
    group_macs: dict[str, float] = dataclasses.field(default_factory=lambda: {"cpu": 12e6})


@dataclasses.dataclass
class ReduceConfig:
    """What one reduction step does; shared by all blocks of a patched model."""

    method: str = "ltmp"  # a key of METHODS
    tau: float = 0.1  # temperature of the sigmoid surrogate, eq. 2
    importance: str = "mean"  # "mean": mean column attention (eq. 17); "cls": class attention (eq. 16)
    num_prefix: int = 1  # prefix tokens (class, distillation, registers) at the front; never reduced
    keep_one: bool = False  # pruning always leaves one patch token (models that pool patch tokens)
    rate: tuple[int, ...] | None = None  # fixed-rate methods: tokens per layer (r for ToMe, k for top-k)
    mask_grad: str = "secant"  # train mode: bounded form of eq. 6's gradient to removed keys' masks (ops.MASK_GRADS)
    merge_grad: str = "average"  # train mode: merge thresholds learn through the masks of eq. 5-7 and the merged
    #                              averages ("average"), or through the masks only ("mask", the reference code)
    trace_source: bool = False  # carry a (B, N, N0) map of which patches each token covers (for viz)
    capture: list | None = None  # analysis: each decision appends its scores and candidates (a Captured)
    fit: tuple[float, float] | None = None  # calibration: set each threshold to the batch quantile that merges /
    #                                         prunes these fractions of the block's candidates (see fit_threshold)
    execution: Execution = dataclasses.field(default_factory=Execution)  # speed choices, not results

    @property
    def ops(self) -> tuple[str, ...]:
        return METHODS[self.method][0]

    @property
    def learned(self) -> bool:
        return METHODS[self.method][1] == "threshold"

    @property
    def needs_importance(self) -> bool:
        return "prune" in self.ops

    @property
    def needs_metric(self) -> bool:
        return "merge" in self.ops


class Captured(NamedTuple):
    """One reduction decision's scores, recorded for analysis (``ReduceConfig.capture``; eval on the masked step)."""

    layer: int
    op: str  # "merge" or "prune"
    scores: Tensor  # (B, N) similarity to the best match in set B (merge) or importance (prune)
    candidates: Tensor  # (B, N) bool: set A (merge) or the surviving patch tokens (prune)
    importance: Tensor | None  # (B, N) merge decisions: the tokens' importance, where the method computes it


@dataclasses.dataclass
class TokenState:
    """The token set travelling between blocks, besides the tokens x themselves: (B, N, C), or in eval without
    gradients the packed rows (T, C) of the real ones (:func:`real_rows`).

    Prefix tokens always sit at positions ``0 .. num_prefix - 1``.
    """

    size: Tensor  # (B, N) patches each token stands for; 0 for padding
    keep: Tensor  # (B, N) 1 surviving, 0 removed or padding; straight-through values in train mode
    compact: bool  # eval representation: removed tokens are gathered out after each block
    source: Tensor | None = None  # (B, N, N0) patches covered by each token, if traced
    merged_once: bool = False  # sizes may differ from 1 (proportional attention needed)
    masked_once: bool = False  # some token is masked or padded (masked attention needed)
    counts: list[int] | None = None  # eval: each image's real (not padding) tokens, on the host after compaction
    packed: tuple[Tensor, ops.PackedRows] | None = None  # eval: (keep, its real tokens), reused by the MLP and
    #                                                      the next block's attention while keep is the same
    #                                                      tensor; the order of packed rows x (T, C) (real_rows)

    @property
    def real(self) -> int | None:
        """Real tokens in the batch (eval, after compaction)."""
        return None if self.counts is None else sum(self.counts)


@dataclasses.dataclass
class StepResult:
    """Per-image counts of one block's reduction."""

    # each (B,): a tensor, or on the host (eval without gradients) an int for every image or a list of B ints;
    # merged and pruned of a compact step of two operations: one SplitCounts, read when a record is read
    merged: Tensor | int | list[int] | SplitCounts  # tokens merged away in this block
    pruned: Tensor | int | list[int] | SplitCounts  # tokens pruned in this block
    kept: Tensor | int | list[int]  # patch tokens surviving this block (hard count)
    kept_frac: Tensor | int | list[int]  # surviving patch tokens, differentiable in train mode (m-bar of eq. 13, x n)


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
    ``torch.compiler.is_exporting`` says so on torch >= 2.14 (older versions: only through :func:`exporting`)."""
    if _EXPORTING:
        return True
    fn = getattr(torch.compiler, "is_exporting", None)
    return _TORCH_IS_EXPORTING_EXACT and fn is not None and bool(fn())


def is_compiling() -> bool:
    """True while torch.compile traces the model (``torch.compiler.is_compiling``, torch >= 2.3), but not while
    torch.export does (which that function also reports: exports take the branch-free batch-1 path instead)."""
    return ops.tracing() and not is_exporting()


def step_kind(cfg: ReduceConfig, batch: int, training: bool) -> str:
    """Which reduction step a forward runs in every block, chosen once per forward (the batched and the
    single-image forward go through this one decision):

    - ``"static"``: fixed rates in eval (:func:`_reduce_fixed`): static shapes, no host reads;
    - ``"single"``: one image in eval without gradients, outside torch.compile (:func:`_reduce_single`);
    - ``"compact"``: learned thresholds in eval without gradients otherwise (:func:`_reduce_compact`);
    - ``"masked"``: everything else (:func:`reduce_step`'s masked step): train mode, eval with gradients,
      calibration (``fit``) and analysis (``capture``), which read the masks.
    """
    e = cfg.execution
    if training or cfg.fit is not None or cfg.capture is not None:
        return "masked"
    if not cfg.learned and e.static_rates:
        return "static"
    if batch == 1 and e.single_image and not torch.is_grad_enabled() and not is_compiling():
        return "single"
    if cfg.learned and not torch.is_grad_enabled():
        return "compact"
    return "masked"


def layer_rate(rate: Sequence[int] | None, layer: int) -> int:
    return 0 if rate is None else int(rate[layer])


def reduce_step(
        x: Tensor,
        state: TokenState,
        cfg: ReduceConfig,
        layer: int,
        importance: Tensor | None,
        metric: Tensor | None,
        merge_threshold: Tensor | None,
        prune_threshold: Tensor | None,
        rate: int | None = None,
        kind: str | None = None,
) -> tuple[Tensor, TokenState, StepResult]:
    """Merge and/or prune the tokens of one block, between attention and MLP.

    Every decision is defined on the surviving tokens only: the A/B split alternates over survivors in order
    (:func:`ltmp.ops.bipartite_sets`), merge targets are surviving B tokens, and importance averages over surviving
    query rows. In ``ltmp`` a token that just received merges can be pruned in the same block (its importance is
    its group's max); in ``ltpm`` the split runs over the tokens left after pruning.

    Args:
        x: (B, N, C) tokens after the attention residual, or (eval) the packed rows (T, C) of the real ones
            (:func:`real_rows`); the compact step then returns packed rows too (or (B, N', C) without padding).
        state: The token state (sizes, keep mask).
        cfg: The reduction config.
        layer: Block index (for per-layer fixed rates).
        importance: (B, N) importance scores (:func:`ltmp.ops.importance_scores` of this block's attention), if
            the method prunes.
        metric: (B, N, D) keys summed over heads (ops.head_sum; any scale), if the method merges.
        merge_threshold, prune_threshold: Learned thresholds (scalars), for the threshold methods.
        rate: The fixed-rate methods' tokens for this block, if already looked up (``cfg.rate[layer]``); the
            patched forward passes it so that compiled blocks guard on the rate, not on the block index.
        kind: The forward's :func:`step_kind` (computed here if not given).

    Returns:
        The new x, the new state, and the step's counts.
    """
    B, N = state.keep.shape
    rate = layer_rate(cfg.rate, layer) if rate is None else rate
    kind = step_kind(cfg, B, not state.compact) if kind is None else kind
    if kind != "compact":  # only compaction takes packed rows (T, C)
        x = padded_tokens(x, state)  # (B, N, C)
    if kind == "static":
        return _reduce_fixed(x, state, cfg, importance, metric, rate)
    if kind == "single":
        return _reduce_single(x, state, cfg, importance, metric, merge_threshold, prune_threshold, rate)
    if kind == "compact":
        return _reduce_compact(x, state, cfg, layer, importance, metric, merge_threshold, prune_threshold)
    P = cfg.num_prefix
    keep, size, source = state.keep, state.size, state.source
    # eq. 3: the tokens this block's modules consider take this block's masks, (1 - M_merge) * M_prune for a token
    # that is a candidate of both; every other token keeps the mask it entered with (removed ones their old one)
    entering, factor, touched = keep, None, None
    merged = pruned = x.new_zeros(B, dtype=torch.long)
    for op in cfg.ops:
        if op == "merge":
            merge, dst, is_a = _merge_decision(cfg, layer, keep, state.compact and keep is state.keep, importance,
                                               metric, merge_threshold, rate, x.dtype)  # (B, N) each
            hard = merge.detach() > 0.5  # (B, N)
            # no host check of whether anything merged: a merge of nothing returns the tokens bit-identical
            weights = merge if cfg.merge_grad == "average" else merge.detach()  # (B, N)
            x, size, source = ops.merge_tokens(x, size, weights.to(size.dtype), dst, source)
            if importance is not None:
                importance = ops.group_max(importance, merge, dst)
            factor = 1 - merge if factor is None else factor * (1 - merge)  # (B, N); 1 outside set A
            touched = is_a if touched is None else touched | is_a
            keep = torch.where(touched, factor, entering)
            state = dataclasses.replace(state, merged_once=True, masked_once=True)
            merged = hard.sum(1)
        else:
            pm, drop, cand = _prune_decision(cfg, keep, importance, prune_threshold, rate, x.dtype)  # (B, N) each
            if cfg.capture is not None:
                cfg.capture.append(Captured(layer, "prune", importance.detach().cpu(), cand.cpu(), None))
            pm = torch.where(cand, pm, torch.ones_like(pm))  # (B, N)
            factor = pm if factor is None else factor * pm
            touched = cand if touched is None else touched | cand
            keep = torch.where(touched, factor, entering)
            state = dataclasses.replace(state, masked_once=True)
            pruned = drop.sum(1)
    patch_keep = keep[:, P:]  # (B, N - P)
    result = StepResult(merged=merged, pruned=pruned, kept=(patch_keep > 0.5).sum(1), kept_frac=patch_keep.sum(1))
    if state.compact:  # eval: gather the survivors; the one host synchronisation of a block (the counts)
        x, size, source, keep, counts = ops.contract(keep > 0.5, x, size, source)
        # without padding (e.g. equal counts) the next block needs no mask at all
        state = dataclasses.replace(state, masked_once=sum(counts) < keep.numel(), counts=counts)
    return x, dataclasses.replace(state, size=size, keep=keep, source=source), result


def _merge_decision(cfg: ReduceConfig, layer: int, keep: Tensor, contiguous: bool, importance: Tensor | None,
                    metric: Tensor, merge_threshold: Tensor | None, rate: int, dtype: torch.dtype,
                    hard: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Which tokens merge, and into which: the one merge decision of the masked and the compact step (the
    merge-first compact step takes the same decision in set-A rows, :func:`_reduce_compact_merge_first`).

    Set A and B alternate over the survivors (ToMe's even/odd split when they are ``contiguous``, as after
    compaction); an A token merges into its most similar B token where the similarity passes the learned threshold
    (eq. 1), or for fixed rates where it is among the ``rate`` best matched (ties to the earlier position).

    Returns:
        The merge mask (B, N) in ``dtype`` (straight-through in train mode, eq. 2; bool if ``hard``), the
        destinations (B, N) and set A (B, N).
    """
    P = cfg.num_prefix
    is_b = None
    if contiguous:  # survivors at the front of each row: ToMe's even/odd split
        score, dst, is_a = ops.best_match_contiguous(metric, keep, P)  # (B, N) each
    else:
        is_a, is_b = ops.bipartite_sets(keep, P)  # (B, N) each
        score, dst = ops.best_match(metric, is_a, is_b)  # (B, N) each
    if cfg.capture is not None:
        cfg.capture.append(Captured(layer, "merge", score.detach().cpu(), is_a.cpu(),
                                    None if importance is None else importance.detach().cpu()))
    if cfg.learned:
        if cfg.fit is not None:
            fit_threshold(merge_threshold, score[is_a], cfg.fit[0], largest=True)
        if hard:
            return (score > merge_threshold) & is_a, dst, is_a  # (B, N) eq. 1
        return ops.threshold_mask(score, merge_threshold, cfg.tau) * is_a, dst, is_a  # (B, N) eq. 1-2
    # B tokens past the prefix: odd positions when contiguous
    n_b = (keep > 0.5).sum(1) // 2 - P // 2 if is_b is None else is_b.sum(1)  # (B,)
    k = torch.minimum(is_a.sum(1), n_b).clamp(max=rate)  # (B,)
    merge = ops.topk_mask(score, is_a, k, largest=True)  # (B, N)
    return (merge if hard else merge.to(dtype)), dst, is_a


def _prune_decision(cfg: ReduceConfig, keep: Tensor, importance: Tensor, prune_threshold: Tensor | None, rate: int,
                    dtype: torch.dtype, hard: bool = False) -> tuple[Tensor | None, Tensor, Tensor]:
    """Which surviving patch tokens are pruned: the one prune decision of the masked and the compact step.

    A candidate is kept where its importance passes the learned threshold (eq. 1), or for fixed rates unless it
    is among the ``rate`` least important (ties to the earlier position); with ``keep_one`` an image's most
    important candidate is spared when every candidate would go.

    Returns:
        The keep mask of the candidates (B, N) in ``dtype`` (straight-through in train mode; None if ``hard``),
        the pruned tokens (B, N) bool and the candidates (B, N) bool.
    """
    cand = (keep if keep.dtype == torch.bool else keep > 0.5) & ops.patch_tokens(keep.shape[1], cfg.num_prefix,
                                                                                keep.device)  # (B, N)
    pm = None
    if cfg.learned:
        if cfg.fit is not None:
            fit_threshold(prune_threshold, importance[cand], cfg.fit[1], largest=False)
        if hard:
            drop = cand & ~(importance > prune_threshold)  # (B, N) eq. 1: kept where importance > threshold
        else:
            pm = ops.threshold_mask(importance, prune_threshold, cfg.tau)  # (B, N) 1 = keep, eq. 1-2
            drop = cand & (pm.detach() <= 0.5)
    else:
        drop = ops.topk_mask(importance, cand, cand.new_full(cand.shape[:1], rate, dtype=torch.long), largest=False)
        pm = None if hard else (~drop).to(dtype)
    if cfg.keep_one:  # never prune an image's last patch token: spare its most important one
        top = importance.detach().float().masked_fill(~cand, float("-inf")).argmax(1, keepdim=True)  # (B, 1)
        spare = torch.zeros_like(cand).scatter_(1, top, True) & (drop & cand).sum(1, keepdim=True).eq(
            cand.sum(1, keepdim=True))  # (B, N)
        if pm is not None:
            pm = pm + (spare & drop).to(pm.dtype)
        drop = drop & ~spare
    return pm, drop, cand


def _reduce_compact(
        x: Tensor,
        state: TokenState,
        cfg: ReduceConfig,
        layer: int,
        importance: Tensor | None,
        metric: Tensor | None,
        merge_threshold: Tensor | None,
        prune_threshold: Tensor | None,
) -> tuple[Tensor, TokenState, StepResult]:
    """:func:`reduce_step` for learned thresholds in eval mode without gradients: the masked step's decisions
    (eq. 1 on the same scores, the same A/B split, group-max importance and ``keep_one`` rule), taken as hard
    masks, then merging and compaction in one scatter (:func:`ltmp.ops.contract`) instead of a merge pass, a
    mask bookkeeping pass and a compaction. One host synchronisation: the survivor counts.
    """
    if cfg.ops[0] == "merge" and state.keep.shape[1] > 1:
        return _reduce_compact_merge_first(x, state, cfg, importance, metric, merge_threshold, prune_threshold)
    alive = state.keep > 0.5  # (B, N) survivors, at the front of each row
    merge = dst = None
    masks = []  # the survivors after each operation
    for op in cfg.ops:
        if op == "merge":  # ltpm merges after pruning: the split alternates over the survivors of pruning
            merge, dst, _ = _merge_decision(cfg, layer, alive, cfg.ops[0] == "merge", importance, metric,
                                            merge_threshold, 0, x.dtype, hard=True)  # (B, N) each
            if importance is not None:
                importance = ops.group_max(importance, merge, dst)  # (B, N)
            alive = alive & ~merge
        else:
            _, drop, _ = _prune_decision(cfg, alive, importance, prune_threshold, 0, x.dtype, hard=True)  # (B, N)
            alive = alive & ~drop
        masks.append(alive)
    rank, counts = _survivor_counts(masks)
    x, size, source, keep, counts = ops.contract(alive, x, state.size, state.source, merge, dst, counts, rank,
                                                 _rows_of(x, state))
    state_out = dataclasses.replace(state, size=size, keep=keep, source=source, counts=counts,
                                    merged_once=state.merged_once or merge is not None,
                                    masked_once=sum(counts) < keep.numel())
    return x, state_out, _host_result(cfg, state, masks, counts)


def _rows_of(x: Tensor, state: TokenState) -> Tensor | None:
    """The flat positions (T,) of packed rows x (T, C) in the state's (B * N) batch; None for a padded x."""
    return real_rows(state).idx if x.dim() == 2 else None


def _survivor_counts(masks: list[Tensor]) -> tuple[Tensor, list[int]]:
    """The compact steps' one host synchronisation: from the survivor masks (B, N) after each operation of a step,
    the last one's rank of each token among the survivors (B, N) (``alive.cumsum(1)``, for :func:`ltmp.ops.slots`)
    and each image's survivor count, read back."""
    rank = masks[-1].cumsum(1)  # (B, N) survivors up to each position
    return rank, rank[:, -1].tolist()  # (B, N), (B,)


class SplitCounts:
    """The tokens a compact step of two operations merged and pruned in each image: the step reads back only the
    survivors after both (:func:`_survivor_counts`); how many the first operation removed is read from its
    survivor mask when a record is read (:func:`read_splits`, one host read for the whole forward)."""

    def __init__(self, ops: tuple[str, ...], first: Tensor, before: list[int], after: list[int]):
        self.ops = ops  # the step's two operations, in order ("merge", "prune" or "prune", "merge")
        self.first = first  # (B, N) bool, the survivors after the first operation
        self.before, self.after = before, after  # each image's real tokens entering and leaving the step
        self.mid: list[int] | None = None  # each image's survivors after the first operation, once read

    def merged_pruned(self) -> tuple[list[int], list[int]]:
        """Per image, the tokens merged away and the tokens pruned."""
        read_splits([self])  # (a no-op once read)
        first = [b - m for b, m in zip(self.before, self.mid)]
        second = [m - a for m, a in zip(self.mid, self.after)]
        return (first, second) if self.ops[0] == "merge" else (second, first)


def read_splits(splits: list[SplitCounts]) -> None:
    """Read every unread :class:`SplitCounts` of a forward in one host synchronisation."""
    todo = [s for s in splits if s.mid is None]
    if todo:
        mids = torch.stack([s.first.sum(1) for s in todo]).tolist()  # (S, B)
        for s, mid in zip(todo, mids):
            s.mid = mid


def _host_result(cfg: ReduceConfig, state: TokenState, masks: list[Tensor], after: list[int]) -> StepResult:
    """A compact step's per-image counts on the host, from each image's survivors after the step (``after``);
    with two operations, their split is read later from the survivors after the first (:class:`SplitCounts`)."""
    B = len(after)
    before = state.counts if state.counts is not None else [state.keep.shape[1]] * B  # real tokens entering
    kept = [c - cfg.num_prefix for c in after]
    if len(cfg.ops) == 2:
        split = SplitCounts(cfg.ops, masks[0], before, after)
        return StepResult(merged=split, pruned=split, kept=kept, kept_frac=kept)
    removed = [b - c for b, c in zip(before, after)]
    none = [0] * B
    merged, pruned = (removed, none) if cfg.ops[0] == "merge" else (none, removed)
    return StepResult(merged=merged, pruned=pruned, kept=kept, kept_frac=kept)


def _reduce_compact_merge_first(
        x: Tensor,
        state: TokenState,
        cfg: ReduceConfig,
        importance: Tensor | None,
        metric: Tensor,
        merge_threshold: Tensor,
        prune_threshold: Tensor | None,
) -> tuple[Tensor, TokenState, StepResult]:
    """:func:`_reduce_compact` for the methods that merge first (``ltmp``, ``ltm``), in fewer operator calls: the
    survivors sit at the front of each row, so set A is the even positions and set B the odd ones past the prefix
    (ToMe's split, as :func:`ltmp.ops.best_match_contiguous`), and the merge decision stays in set-A rows. The same
    decisions as :func:`_merge_decision` and :func:`_prune_decision` (the tests compare the steps): an A token
    merges into its most similar surviving B token where the similarity passes the threshold (eq. 1), a target's
    importance becomes its group's max, a surviving patch token is pruned unless its importance passes the
    threshold, and ``keep_one`` spares an image's most important candidate when all would go.
    """
    B, N = state.keep.shape
    P = cfg.num_prefix
    keep = state.keep  # (B, N) 1 survivor, 0 padding
    alive = keep > ops.scalar(0, keep)  # (B, N)
    mergeable = alive & ops.patch_tokens(N, P, keep.device)  # (B, N) tokens that may merge or receive: survivors
    #                                                       past the prefix
    sim = ops.cosine_similarity(metric, first_a=0)  # (B, Na, Nb); NaN at padding (zero keys)
    sim.masked_fill_(~mergeable[:, 1::2].view(B, 1, -1), -math.inf)  # B columns that cannot receive
    best, j = ops.row_max(sim)  # (B, Na), (B, Na) each A row's best B column (the first on ties)
    merge_a = (best > merge_threshold) & mergeable[:, ::2]  # (B, Na) eq. 1
    dst_a = ops.affine(j, 2, 1)  # (B, Na) the B position each A row would join
    if importance is not None:  # a target's importance is its group's max (ops.group_max); in place: the
        #                           block's own scores, not read after this step
        importance.scatter_reduce_(1, dst_a, torch.where(merge_a, importance[:, ::2], ops.scalar(-math.inf,
                                                                                                 importance)),
                                   reduce="amax")  # (B, N)
    survive = alive  # (B, N), in place: alive is not read again
    survive[:, ::2].bitwise_xor_(merge_a)  # merged A tokens (all alive) leave
    masks = [survive]
    if "prune" in cfg.ops:
        _, drop, _ = _prune_decision(cfg, survive, importance, prune_threshold, 0, x.dtype, hard=True)  # (B, N)
        survive = survive ^ drop  # drop is a subset of survive
        masks.append(survive)
    rank, counts = _survivor_counts(masks)
    target, _ = ops.slots(survive, counts, rank)  # (B, N)
    target_a = target[:, ::2]  # (B, Na) view: merged A rows join their target's slot (a pruned target's: the dump)
    target_a.copy_(torch.where(merge_a, target.gather(1, dst_a), target_a))
    x, size, source, keep = ops.gather_slots(target, max(counts), x, state.size, state.source, True,
                                             _rows_of(x, state), sum(counts))
    state_out = dataclasses.replace(state, size=size, keep=keep, source=source, counts=counts, merged_once=True,
                                    masked_once=sum(counts) < keep.numel())
    return x, state_out, _host_result(cfg, state, masks, counts)


def _reduce_single(
        x: Tensor,
        state: TokenState,
        cfg: ReduceConfig,
        importance: Tensor | None,
        metric: Tensor | None,
        merge_threshold: Tensor | None,
        prune_threshold: Tensor | None,
        rate: int,
) -> tuple[Tensor, TokenState, StepResult]:
    """:func:`reduce_step` for one image in eval mode, with index lists instead of (B, N) masks.

    The same decisions (the tests compare it with batched and train-mode runs): with every token alive and
    stored in order, set A is the even positions and set B the odd ones past the prefix (ToMe's split), merges
    are size-weighted averages into B tokens, a merged token's importance is its group's max, and survivors are
    gathered once at the end. At batch 1 the cost of a reduction step is its number of operator calls, not its
    arithmetic, so this path makes about 30 calls where the general one makes about 100, and one host
    synchronisation (the survivor count) per operation.
    """
    N, P = x.shape[1], cfg.num_prefix
    size, source = state.size, state.source
    importance = importance[0] if importance is not None else None  # (N,)
    alive = None  # (N,) bool once something is removed
    n_merged, merged_once = 0, state.merged_once
    exporting = is_exporting()  # token counts are symbolic: no Python branch may read them
    for op in cfg.ops:
        if op == "merge":
            if alive is not None:  # ltpm: pruned tokens leave first, so that A/B alternate over the survivors
                idx = alive.nonzero().squeeze(1)  # (N',)
                x, size, metric = (t.index_select(1, idx) for t in (x, size, metric))
                importance = importance.index_select(0, idx)
                source = None if source is None else source.index_select(1, idx)
                alive, N = None, idx.shape[0]
            a0 = (P + 1) // 2  # first set-A row past the prefix (A: even positions, B: odd positions)
            if not cfg.learned and rate == 0:
                continue
            if not exporting and ((N - 2 * a0 + 1) // 2 < 1 or N // 2 - P // 2 < 1):
                continue
            sim = ops.cosine_similarity(metric[0], first_a=2 * a0)  # (Na, Nb)
            if P > 1:
                sim[:, :P // 2] = float("-inf")  # B columns inside the prefix
            if exporting:  # a -inf column keeps max() defined when set B is empty; it is never selected
                sim = torch.cat([sim, sim.new_full((sim.shape[0], 1), float("-inf"))], dim=1)
            best, j = ops.row_max(sim)  # (Na,), (Na,)
            if cfg.learned:
                sel = (best > merge_threshold).nonzero().squeeze(1)  # (M,) merged A rows
            else:
                n_b = N // 2 - P // 2  # B tokens past the prefix
                k = torch.sym_min(rate, torch.sym_max(0, n_b)) if exporting else min(rate, max(0, n_b))
                # ties (equal similarities) resolve by position; exports use top-k (ONNX has no stable sort)
                sel = best.topk(k).indices if exporting else best.sort(descending=True, stable=True).indices[:k]
            if not exporting and sel.shape[0] == 0:
                continue
            src = ops.affine(sel, 2, 2 * a0)  # (M,) positions merged away
            dst = ops.affine(j.index_select(0, sel), 2, 1)  # (M,) their targets
            x, size, source, imp = _merge_rows(x, size, source, None if importance is None else importance[None],
                                               src[None], dst[None])
            importance = None if imp is None else imp[0]
            alive = torch.ones(N, dtype=torch.bool, device=x.device).index_fill_(0, src, 0)  # (N,)
            n_merged, merged_once = src.shape[0], True
        else:
            if cfg.learned:
                kept = importance > prune_threshold  # (N,) kept by eq. 1
            else:
                cand = importance.detach().to(ops.wide(importance.dtype)).clone()
                cand[:P] = float("inf")
                if alive is not None:
                    cand[~alive] = float("inf")
                kept = torch.ones(N, dtype=torch.bool, device=x.device)
                low = cand.topk(torch.sym_min(rate, N), largest=False).indices if exporting else \
                    cand.sort(stable=True).indices[:rate]
                kept[low] = False
            kept[:P] = True  # prefix tokens are never pruned
            if alive is not None:
                kept = kept & alive
            if cfg.keep_one:  # spare the most important candidate when none would be left (branch-free)
                cand_alive = alive if alive is not None else torch.ones(N, dtype=torch.bool, device=x.device)
                spare = importance.float().masked_fill(~cand_alive, float("-inf"))
                spare[:P] = float("-inf")
                i = spare.argmax()
                kept[i] = kept[i] | (~kept[P:].any() & cand_alive[P:].any())
            alive = kept
    if alive is not None:
        idx = alive.nonzero().squeeze(1)  # (N',)
        if exporting or idx.shape[0] < N:
            x, size = x.index_select(1, idx), size.index_select(1, idx)
            source = None if source is None else source.index_select(1, idx)
    n_kept = x.shape[1] - P
    n_pruned = N - P - n_merged - n_kept
    result = StepResult(merged=n_merged, pruned=n_pruned, kept=n_kept, kept_frac=n_kept)
    return x, TokenState(size=size, keep=state.keep[:, :x.shape[1]], compact=True, source=source,
                         merged_once=merged_once), result


def _survivors(scores: Tensor, k: int, offset: int) -> Tensor:
    """Positions (B, n - k) that survive pruning the ``k`` lowest ``scores`` (B, n) of the tokens at ``offset ..``,
    ties to the earlier position, in order (the ``offset`` prefix positions first): a stable sort, with the
    survivors ordered by one top-k instead of a scatter and a sort over all positions. Overwrites the prefix
    scores with +inf: the fixed-rate step passes the block's importance (or its float32 copy), which nothing reads
    after pruning. NaN scores sort after the prefix (NaN importance only comes with NaN outputs)."""
    if is_exporting():  # ONNX has no stable sort: the k lowest by a top-k, then the others in order
        B, n = scores.shape
        low = scores[:, offset:].topk(k, dim=1, largest=False).indices + offset  # (B, k) pruned positions
        key = ops.positions(n, scores.device).expand(B, n).scatter(1, low, value=n)  # (B, n) position, n if pruned
        return key.topk(n - k, dim=1, largest=False).indices  # (B, n - k) surviving positions in order
    scores[:, :offset] = math.inf  # the prefix survives
    rest = scores.sort(dim=1, stable=True).indices[:, k:]  # (B, n - k) surviving positions
    return rest.topk(rest.shape[1], dim=1, largest=False).values  # (B, n - k) in order (distinct: no ties; a
    #                                                               top-k makes fewer nested calls than a sort)


def _gather(keep: Tensor, *tensors: Tensor | None) -> list[Tensor | None]:
    """The tensors (B, N, ...) at the positions ``keep`` (B, N')."""
    return [None if t is None else t.gather(1, keep) if t.dim() == 2 else t.gather(1, ops.row_index(keep, t.shape[2]))
            for t in tensors]


def _reduce_fixed(
        x: Tensor,
        state: TokenState,
        cfg: ReduceConfig,
        importance: Tensor | None,
        metric: Tensor | None,
        rate: int,
) -> tuple[Tensor, TokenState, StepResult]:
    """:func:`reduce_step` for the fixed-rate methods in eval mode, on tokens without padding: every image
    merges and prunes the same number of tokens, known on the host from the shapes, so the step has static shapes
    and reads nothing back from the device (no host synchronisation; ``torch.compile(fullgraph=True)`` traces it).

    The same decisions as the masked step (the tests compare them): set A is the even positions past the prefix,
    set B the odd ones (ToMe's split), the ``k = min(rate, |A|, |B|)`` best-matched A tokens merge into their B
    targets as size-weighted averages (merging and the removal of the merged tokens are one pass of whole rows,
    :func:`_sum_into_slots`), a merged token's importance is its group's max, pruning removes the ``rate`` least
    important patch tokens (ties to the earlier position; one spared with ``keep_one``), and survivors keep their
    order.
    """
    B, N, _ = x.shape
    P = cfg.num_prefix
    size, source = state.size, state.source
    n_merged = n_pruned = 0
    for op in cfg.ops:
        if op == "merge":
            a0 = (P + 1) // 2  # first set-A row past the prefix (A: even positions, B: odd positions)
            k = min(rate, (N - 2 * a0 + 1) // 2, N // 2 - P // 2)
            if k <= 0:
                continue
            sim = ops.cosine_similarity(metric, first_a=2 * a0)  # (B, Na, Nb)
            if P > 1:
                sim[..., :P // 2] = float("-inf")  # B columns inside the prefix
            best, j = ops.row_max(sim)  # (B, Na), (B, Na)
            rows = _top_rows(best, k)  # (B, k) the A rows merged away, ascending
            src = ops.affine(rows, 2, 2 * a0)  # (B, k) their positions
            dst = ops.affine(j.gather(1, rows), 2, 1)  # (B, k) the B position each joins
            x, size, source, importance = _sum_into_slots(_merge_slots(src, dst, N), N - k, x, size, source,
                                                          importance, state.merged_once)
            N, n_merged = N - k, k
            state = dataclasses.replace(state, merged_once=True)
        else:
            k = min(rate, N - P - (1 if cfg.keep_one else 0))
            if k <= 0:
                continue
            imp = ops.cast(importance.detach(), ops.wide(importance.dtype))  # (B, N)
            keep = _survivors(imp, k, P)  # (B, N - k) kept positions, in order
            if state.merged_once:
                x, size, source = _gather(keep, x, size, source)
            else:  # every size is still 1: any N - k of them
                (x, source), size = _gather(keep, x, source), size[:, :N - k]
            N, n_pruned = N - k, k
    n_kept = N - P
    result = StepResult(merged=n_merged, pruned=n_pruned, kept=n_kept, kept_frac=n_kept)
    keep = ops.ones(B, N, state.keep.dtype, x.device)  # (B, N) every token real
    return x, dataclasses.replace(state, size=size, keep=keep, source=source, counts=[N] * B), result


def _top_rows(scores: Tensor, k: int) -> Tensor:
    """The rows (B, k) of the ``k`` highest ``scores`` (B, M) of each image, ties to the earlier row, in ascending
    order. The selection is a stable sort (exports: a top-k, as ONNX has no stable sort); the order one top-k on
    values that never tie (fewer operator calls than a sort)."""
    if is_exporting():
        rows = scores.topk(k, dim=1).indices  # (B, k)
    else:
        rows = scores.sort(dim=1, descending=True, stable=True).indices[:, :k]  # (B, k)
    return rows.topk(k, dim=1, largest=False).values  # (B, k) ascending


def _merge_slots(src: Tensor, dst: Tensor, n: int) -> Tensor:
    """Where each of ``n`` tokens goes when the tokens at the ascending positions ``src`` (B, k) merge into those
    at ``dst`` (B, k): a row of the flattened (B * (n - k), ...) output, at its rank among its image's ``n - k``
    tokens that stay (their order is kept), or for a merged token its target's row. (B, n)."""
    B, k = src.shape
    if is_exporting():  # merged tokens before each position: a cumulative sum (exporters know no searchsorted)
        before = torch.zeros(B, n, dtype=src.dtype, device=src.device).scatter_(1, src, 1).cumsum(1)  # (B, n)
    else:
        before = torch.searchsorted(src, ops.positions(n, src.device, batch=B))  # (B, n)
    slot = ops.batch_rows(B, n, n - k, src.device) - before  # (B, n) rank among the tokens that stay, as a row
    return slot.scatter_(1, src, slot.gather(1, dst))  # (B, n)


def _sum_into_slots(slot: Tensor, n: int, x: Tensor, size: Tensor, source: Tensor | None,
                    importance: Tensor | None, weighted: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The tokens x (B, N, C) summed into their rows ``slot`` (B, N) of the flattened (B * n, ...) output: each
    slot's size-weighted average of its tokens, added in position order (eq. 7 as :func:`ltmp.ops.merge_tokens`; a
    token that receives nothing is x * s / s, equal to x up to rounding); sizes (B, N) and source rows (B, N, N0)
    add up and importance (B, N) takes the group's max. ``weighted``: some size may differ from 1 (else x needs no
    weights). The sums are :func:`ltmp.ops.weighted_sums`, as the compact step's."""
    B, N, C = x.shape
    rows = slot.view(-1)  # (B * N,)
    num, den = ops.weighted_sums(x, size, rows, B * n, weighted)  # (B * n, C), (B * n, 1) sizes add up
    x = ops.cast(num.div_(den).view(B, n, C), x.dtype)  # (B, n, C)
    den = den.view(B, n)  # (B, n)
    if source is not None:
        source = ops.into_rows(ops.flat_rows(source), rows, B * n).view(B, n, -1)  # (B, n, N0)
    if importance is not None:  # >= 0: attention weights
        importance = torch.zeros(B * n, dtype=importance.dtype, device=x.device).scatter_reduce_(
            0, rows, ops.reshaped(importance, -1), "amax").view(B, n)  # (B, n)
    return x, ops.cast(den, size.dtype), source, importance


def _merge_rows(x: Tensor, size: Tensor, source: Tensor | None, importance: Tensor | None, src: Tensor,
                dst: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """:func:`ltmp.ops.merge_tokens` on index lists: in each image the token at ``src[:, i]`` merges into the one
    at ``dst[:, i]`` (B, k), as a size-weighted average added in the order of ``src``; sizes and source rows add
    up and a merged token's importance is its group's max. Tokens that receive nothing are returned bit-identical;
    none is removed. The single-image step (B = 1) merges here.
    """
    B, N, C = x.shape
    dt = ops.promote(x.dtype, size.dtype)
    s = ops.cast(size, dt)  # (B, N)
    xw = ops.cast(x, dt) * s.view(B, N, 1)  # (B, N, C) size-weighted tokens
    dst_c = ops.row_index(dst, C)  # (B, k, C)
    moved = xw.gather(1, ops.row_index(src, C))  # (B, k, C)
    # in place without gradients (xw is this step's own; with them, the gather saved it for its backward)
    num = xw.scatter_add(1, dst_c, moved) if xw.requires_grad else xw.scatter_add_(1, dst_c, moved)  # (B, N, C)
    den = s.scatter_add(1, dst, s.gather(1, src))  # (B, N)
    # the targets' new values; the other tokens (den == s: nothing added) stay bit-identical
    x = torch.where((den > s).view(B, N, 1), ops.cast(num.div_(den.view(B, N, 1)), x.dtype), x)  # (B, N, C)
    if source is not None:
        K = source.shape[2]
        source = source.scatter_add(1, ops.row_index(dst, K), source.gather(1, ops.row_index(src, K)))  # (B, N, N0)
    if importance is not None:
        importance = importance.scatter_reduce(1, dst, importance.gather(1, src), "amax")  # (B, N)
    return x, ops.cast(den, size.dtype), source, importance


@torch.no_grad()
def fit_threshold(threshold: Tensor, scores: Tensor, fraction: float, largest: bool) -> None:
    """Set a threshold so that the given fraction of ``scores`` passes it: the largest scores for merging (eq. 1:
    merge where ``score > threshold``), the smallest for pruning (prune where ``importance <= threshold``).

    Training-free calibration (not in the paper): one batch's quantiles stand in for learned thresholds.
    """
    if fraction <= 0 or scores.numel() == 0:
        threshold.fill_(math.inf if largest else -math.inf)
        return
    q = 1.0 - fraction if largest else fraction
    threshold.fill_(torch.quantile(scores.detach().double().flatten(), min(max(q, 0.0), 1.0)).item())


def initial_state(x: Tensor, num_prefix: int, compact: bool, trace_source: bool) -> TokenState:
    """The token state entering the first block: every token kept, all of size 1."""
    B, N, _ = x.shape
    ones = ops.ones(B, N, ops.wide(x.dtype), x.device)  # (B, N) never written to
    source = None
    if trace_source:
        source = torch.eye(N, device=x.device, dtype=ones.dtype).expand(B, N, N).clone()  # (B, N, N0)
    return TokenState(size=ones, keep=ones, compact=compact, source=source)


def real_rows(state: TokenState) -> ops.PackedRows:
    """The real tokens of a compact eval state with padding (their flat indices into its (B * N) positions, in
    order), made once per keep mask: the order of the tokens as packed rows (T, C)."""
    if state.packed is not None and state.packed[0] is state.keep:
        return state.packed[1]
    alive = ops.reshaped(state.keep, -1)  # (B * N,) 1 real, 0 padding
    if hasattr(torch, "nonzero_static"):  # the count is known on the host: no synchronisation
        # (a top-k over ``position - 2^24 * keep`` makes fewer calls but takes 2-4x the time on the CPU:
        # benchmarks/packed_index.py)
        idx = torch.nonzero_static(alive, size=state.real).squeeze(1)  # (T,)
    else:
        idx = alive.nonzero().squeeze(1)  # (T,)
    state.packed = (state.keep, ops.PackedRows(idx))
    return state.packed[1]


def padded_tokens(x: Tensor, state: TokenState) -> Tensor:
    """The tokens as a padded batch (B, N, C), 0 at padding: ``x`` itself unless it is the packed rows (T, C) of
    ``state``'s real tokens (``ltmp.patching``'s packed stream)."""
    if x.dim() != 2:
        return x
    B, N = state.keep.shape
    return real_rows(state).pad(x, B * N).view(B, N, -1)  # (B, N, C)


def log_size(state: TokenState) -> Tensor | None:
    """log of the token sizes for proportional attention (ToMe), or None while all sizes are 1."""
    if not state.merged_once:
        return None
    if not state.masked_once or size_masks_padding(state):
        return state.size.log()  # (B, N); sizes >= 1, or 0 at padding (-inf there: masked anyway)
    return state.size.clamp(min=1).log()  # (B, N); padding and removed tokens (size 0) are masked anyway


def size_masks_padding(state: TokenState) -> bool:
    """Whether :func:`log_size` is already -inf at every key attention must leave out (a compact eval state after
    a merge: padding has size 0, and its log needs no mask added)."""
    return state.compact and state.merged_once and not state.size.requires_grad


def no_reduction_thresholds() -> tuple[float, float]:
    """Thresholds that reduce nothing: +inf for merging (a cosine can exceed 1), -inf for pruning."""
    return math.inf, -math.inf
