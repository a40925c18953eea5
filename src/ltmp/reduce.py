"""The per-block reduction step of LTMP (paper section 3.3), one code path for every method and both modes.

A block runs attention on the surviving tokens, then this step merges and/or prunes (in the method's order), then
the MLP. Train mode keeps every token in the tensor and carries a straight-through keep mask (eq. 3:
``m^l = m^(l-1) * M(s, theta)``); eval mode removes the tokens (:func:`ltmp.ops.compact`). Both run exactly the
code below, so they make the same decisions.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

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


@dataclasses.dataclass
class ReduceConfig:
    """What one reduction step does; shared by all blocks of a patched model."""

    method: str = "ltmp"  # a key of METHODS
    tau: float = 0.1  # temperature of the sigmoid surrogate, eq. 2
    importance: str = "mean"  # "mean": mean column attention (eq. 17); "cls": class attention (eq. 16)
    num_prefix: int = 1  # prefix tokens (class, distillation, registers) at the front; never reduced
    keep_one: bool = False  # pruning always leaves one patch token (models that pool patch tokens)
    rate: tuple[int, ...] | None = None  # fixed-rate methods: tokens per layer (r for ToMe, k for top-k)
    trace_source: bool = False  # carry a (B, N, N0) map of which patches each token covers (for viz)
    fit: tuple[float, float] | None = None  # calibration: set each threshold to the batch quantile that merges /
    #                                         prunes these fractions of the block's candidates (see fit_threshold)

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


@dataclasses.dataclass
class TokenState:
    """The token set travelling between blocks, besides the tokens x (B, N, C) themselves.

    Prefix tokens always sit at positions ``0 .. num_prefix - 1``.
    """

    size: Tensor  # (B, N) patches each token stands for; 0 for padding
    keep: Tensor  # (B, N) 1 surviving, 0 removed or padding; straight-through values in train mode
    compact: bool  # eval representation: removed tokens are gathered out after each block
    source: Tensor | None = None  # (B, N, N0) patches covered by each token, if traced
    merged_once: bool = False  # sizes may differ from 1 (proportional attention needed)
    masked_once: bool = False  # some token is masked or padded (masked attention needed)


@dataclasses.dataclass
class StepResult:
    """Per-image counts of one block's reduction."""

    merged: Tensor  # (B,) tokens merged away in this block
    pruned: Tensor  # (B,) tokens pruned in this block
    kept: Tensor  # (B,) patch tokens surviving this block (hard count)
    kept_frac: Tensor  # (B,) surviving patch tokens, differentiable in train mode (m-bar of eq. 13, times n)


def layer_rate(rate: Sequence[int] | None, layer: int) -> int:
    return 0 if rate is None else int(rate[layer])


def reduce_step(
        x: Tensor,
        state: TokenState,
        cfg: ReduceConfig,
        layer: int,
        probs: Tensor | None,
        metric: Tensor | None,
        merge_threshold: Tensor | None,
        prune_threshold: Tensor | None,
) -> tuple[Tensor, TokenState, StepResult]:
    """Merge and/or prune the tokens of one block, between attention and MLP.

    Every decision is defined on the surviving tokens only: the A/B split alternates over survivors in order
    (:func:`ltmp.ops.bipartite_sets`), merge targets are surviving B tokens, and importance averages over surviving
    query rows. In ``ltmp`` a token that just received merges can be pruned in the same block (its importance is
    its group's max); in ``ltpm`` the split runs over the tokens left after pruning.

    Args:
        x: (B, N, C) tokens after the attention residual.
        state: The token state (sizes, keep mask).
        cfg: The reduction config.
        layer: Block index (for per-layer fixed rates).
        probs: (B, H, N, N) attention probabilities, if the method prunes.
        metric: (B, N, D) keys averaged over heads, if the method merges.
        merge_threshold, prune_threshold: Learned thresholds (scalars), for the threshold methods.

    Returns:
        The new x, the new state, and the step's counts.
    """
    B, N, _ = x.shape
    P = cfg.num_prefix
    keep, size, source = state.keep, state.size, state.source
    importance = ops.importance_scores(probs, keep if state.masked_once else None, cfg.importance) \
        if cfg.needs_importance else None  # (B, N)
    merged = pruned = x.new_zeros(B, dtype=torch.long)
    rate = layer_rate(cfg.rate, layer)
    for op in cfg.ops:
        if op == "merge":
            if state.compact and keep is state.keep:  # survivors still contiguous: ToMe's even/odd split
                score, dst, is_a = ops.best_match_contiguous(metric, keep, P)  # (B, N) each
                n_b = (keep > 0.5).sum(1) // 2 - P // 2  # (B,) odd positions past the prefix
            else:
                is_a, is_b = ops.bipartite_sets(keep, P)  # (B, N) each
                score, dst = ops.best_match(metric, is_a, is_b)  # (B, N) each
                n_b = is_b.sum(1)
            if cfg.learned:
                if cfg.fit is not None:
                    fit_threshold(merge_threshold, score[is_a], cfg.fit[0], largest=True)
                merge = ops.threshold_mask(score, merge_threshold, cfg.tau) * is_a  # (B, N)
            else:
                k = torch.minimum(is_a.sum(1), n_b).clamp(max=rate)  # (B,)
                merge = ops.topk_mask(score, is_a, k, largest=True).to(x.dtype)  # (B, N)
            hard = merge.detach() > 0.5  # (B, N)
            if bool(hard.any()) or merge.requires_grad:
                x, size, source = ops.merge_tokens(x, size, merge.to(size.dtype), dst, source)
                if importance is not None:
                    importance = ops.group_max(importance, merge, dst)
                keep = keep * (1 - merge)
                state = dataclasses.replace(state, merged_once=True, masked_once=True)
            merged = hard.sum(1)
        else:
            cand = keep > 0.5  # (B, N)
            cand[:, :P] = False
            if cfg.learned:
                if cfg.fit is not None:
                    fit_threshold(prune_threshold, importance[cand], cfg.fit[1], largest=False)
                pm = ops.threshold_mask(importance, prune_threshold, cfg.tau)  # (B, N) 1 = keep
                drop = cand & (pm.detach() <= 0.5)
            else:
                drop = ops.topk_mask(importance, cand, torch.full_like(merged, rate), largest=False)
                pm = (~drop).to(x.dtype)
            if cfg.keep_one:  # never prune an image's last patch token: spare its most important one
                top = importance.detach().float().masked_fill(~cand, float("-inf")).argmax(1, keepdim=True)
                spare = torch.zeros_like(cand).scatter_(1, top, True) & (drop & cand).sum(1, keepdim=True).eq(
                    cand.sum(1, keepdim=True))
                pm = pm + (spare & drop).to(pm.dtype)
                drop = drop & ~spare
            if bool(drop.any()) or pm.requires_grad:
                keep = keep * torch.where(cand, pm, torch.ones_like(pm))
                state = dataclasses.replace(state, masked_once=True)
            pruned = drop.sum(1)
    patch_keep = keep[:, P:]  # (B, N - P)
    result = StepResult(merged=merged, pruned=pruned, kept=(patch_keep > 0.5).sum(1), kept_frac=patch_keep.sum(1))
    if state.compact and state.masked_once and bool((keep <= 0.5).any()):
        keep, (x, size, source) = ops.compact(keep, x, size, source)
        # without padding (e.g. batch 1) the next block needs no mask at all
        state = dataclasses.replace(state, masked_once=bool((keep <= 0.5).any()))
    return x, dataclasses.replace(state, size=size, keep=keep, source=source), result


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
    size = x.new_ones(B, N, dtype=torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
    source = None
    if trace_source:
        source = torch.eye(N, device=x.device, dtype=size.dtype).expand(B, N, N).clone()  # (B, N, N0)
    return TokenState(size=size, keep=x.new_ones(B, N, dtype=size.dtype), compact=compact, source=source)


def log_size(state: TokenState) -> Tensor | None:
    """log of the token sizes for proportional attention (ToMe), or None while all sizes are 1."""
    if not state.merged_once:
        return None
    return state.size.clamp(min=1).log()  # (B, N); padding (size 0) is masked anyway


def no_reduction_thresholds() -> tuple[float, float]:
    """Thresholds that reduce nothing: +inf for merging (a cosine can exceed 1), -inf for pruning."""
    return math.inf, -math.inf
