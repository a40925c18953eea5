"""Training-free thresholds (``ltmp calibrate``; ``ltmp train --calibrate`` starts from them): bisection on a few
images until eval-mode r_FLOPs (eq. 13) meet the target. Not in the paper."""

from __future__ import annotations

import copy
import math
import os
import warnings

import torch
from torch import Tensor, nn

from . import data as ldata
from .errors import LtmpError
from .patching import num_heads, patch, score_ranges
from .record import r_flops
from .runtime import amp_context
from .step import Captured


def calibration_batch(
    model: nn.Module,
    root: str | os.PathLike,
    n: int,
    seed: int,
    indices: list[int] | None = None,
    classes: list[str] | None = None,
) -> torch.Tensor:
    """The first ``n`` of a seeded shuffle of the images under ``root`` (or of ``indices`` into them), with the
    model's eval transform; unreadable images are left out."""
    _, eval_tf, _ = ldata.transforms_for(model, "none")
    eval_set = ldata.ImageFolder(root, eval_tf, classes)
    indices = list(range(len(eval_set))) if indices is None else indices
    g = torch.Generator().manual_seed(seed)
    pick = [indices[i] for i in torch.randperm(len(indices), generator=g)[:n].tolist()]
    items = [eval_set[i] for i in pick]
    return torch.stack([it[0] for it in items if it is not None])


@torch.no_grad()
def calibrate(
    model: nn.Module,
    images: torch.Tensor,
    r_target: float,
    device: torch.device | str = "cpu",
    iters: int = 18,
    batch: int = 128,
    mode: str = "shared",
    prune_share: float = 0.5,
) -> float:
    """Training-free thresholds, bisected until eval-mode r_FLOPs (eq. 13) on ``images`` match ``r_target``.

    - ``"shared"``: one value for every block. Methods that merge bisect the merge threshold (prune thresholds
      stay as they are); pruning-only methods bisect the prune threshold.
    - ``"quantile"`` (not in the paper): a fraction f is bisected; every block's merge threshold becomes the
      quantile of its similarity scores that merges f of its set-A tokens, and its prune threshold the quantile
      of its importance scores that prunes ``prune_share * f`` of its remaining tokens (f for pruning-only
      methods), all over the whole of ``images`` in one batch (:func:`fit_threshold`, from each decision's scores
      as the forward makes it, ``ReduceConfig.capture``).

    Returns:
        The r_FLOPs reached.
    """
    model.eval()
    cfg = model.ltmp_config
    merge = [p for n, p in model.named_parameters() if n.endswith("merge_threshold")]
    prune = [p for n, p in model.named_parameters() if n.endswith("prune_threshold")]

    def r_of() -> float:
        return mean_eval_r_flops(model, images, device, batch)

    if mode == "quantile":
        lo, hi, increasing = 0.0, 1.0, False  # r falls as f grows

        def r_at(f: float) -> float:
            fractions = {"merge": f, "prune": prune_share * f if merge else f}

            def fit(c: Captured) -> None:  # before the block compares its scores with the threshold
                fit_threshold(c.threshold, c.scores[c.candidates], fractions[c.op], largest=c.op == "merge")

            cfg.capture = fit
            try:
                model(images.to(device))  # sets every threshold from this batch's scores, block by block
            finally:
                cfg.capture = None
            return r_of()
    elif mode == "shared":
        if merge:
            params, lo, hi, increasing = merge, -1.0, 1.05, True  # r rises with the merge threshold
        else:
            heads = num_heads(model) if cfg.importance == "cls" else 1
            params, lo, hi, increasing = prune, 0.0, float(heads), False  # importance lies in [0, 1] (eq. 17)

        def r_at(v: float) -> float:
            for p in params:
                p.fill_(v)
            return r_of()
    else:
        raise LtmpError(f"unknown calibration mode '{mode}'; choose 'shared' or 'quantile'")

    return _bisect(r_at, lo, hi, increasing, r_target, iters)


def fit_threshold(threshold: Tensor, scores: Tensor, fraction: float, largest: bool) -> None:
    """Set a threshold so that the given fraction of ``scores`` passes it: the largest scores for merging (eq. 1:
    merge where ``score > threshold``), the smallest for pruning. One batch's quantiles stand in for learned
    thresholds (not in the paper)."""
    with torch.no_grad():  # a threshold is a leaf parameter
        if fraction <= 0 or scores.numel() == 0:
            threshold.fill_(math.inf if largest else -math.inf)
            return
        q = 1.0 - fraction if largest else fraction
        threshold.fill_(torch.quantile(scores.detach().double().flatten(), min(max(q, 0.0), 1.0)).item())


def _bisect(r_at, lo: float, hi: float, increasing: bool, r_target: float, iters: int) -> float:
    """Bisect the argument of ``r_at`` (r_FLOPs rising with it if ``increasing``) towards ``r_target``; leaves the
    model at the final midpoint and returns its r_FLOPs."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (r_at(mid) < r_target) == increasing:
            lo = mid
        else:
            hi = mid
    return r_at((lo + hi) / 2)


def shift_to_budget(
    apply, r_now, increasing: bool, r_target: float, tolerance: float, step: float, span: float, max_evals: int = 8
) -> tuple[float, float, int]:
    """Shift a set of thresholds by one amount until r_FLOPs meets ``r_target`` within ``tolerance``, with few
    evaluations (the per-step budget of ``ltmp train --budget projected``).

    ``apply(shift)`` sets the thresholds, ``r_now()`` measures r_FLOPs where they are; r rises with the shift if
    ``increasing`` and is piecewise constant (decisions are discrete). The search evaluates the shift 0 first; if it
    misses, it grows a bracket from ``step`` (e.g. the size of the last shift) in the direction that closes the
    gap, then narrows it by the Illinois form of regula falsi. After ``max_evals`` evaluations it keeps the
    evaluated shift nearest the target. Shifts stay within ``[-span, span]``.

    Returns:
        The shift applied, its r_FLOPs and the number of evaluations.
    """

    def gap(shift: float) -> float:
        apply(shift)
        return r_now() - r_target

    points = [(0.0, gap(0.0))]  # (shift, r - r_target) of every evaluation
    a, fa = points[0]
    if abs(fa) > tolerance:
        h = (1.0 if (fa < 0) == increasing else -1.0) * max(abs(step), 1e-3 * span)  # r too low: raise it
        b, fb = a, fa
        while (fb > 0) == (fa > 0) and len(points) < max_evals and abs(b) < span:  # grow a bracket
            a, fa = b, fb
            b = max(-span, min(span, b + h))
            points.append((b, fb := gap(b)))
            h *= 2
        side = 0
        while (fa > 0) != (fb > 0) and abs(fb) > tolerance and len(points) < max_evals:
            c = b - fb * (b - a) / (fb - fa)
            points.append((c, fc := gap(c)))
            if (fc > 0) == (fb > 0):  # a stays: halve its weight so that the next point moves towards it
                b, fb = c, fc
                if side == -1:
                    fa /= 2
                side = -1
            else:
                a, fa, b, fb = b, fb, c, fc
                side = 1
    shift, miss = min(points, key=lambda p: abs(p[1]))
    if shift != points[-1][0]:
        apply(shift)
    return shift, miss + r_target, len(points)


@torch.no_grad()
def mean_eval_r_flops(
    model: nn.Module, images: torch.Tensor, device: torch.device | str = "cpu", batch: int = 128, amp: str = ""
) -> float:
    """Mean eval-mode r_FLOPs (eq. 13) of ``images`` (N, 3, H, W), in batches (under ``--amp``'s autocast)."""
    model.eval()
    total = 0.0
    for i in range(0, len(images), batch):
        with amp_context(amp, torch.device(device)):
            model(images[i : i + batch].to(device))
        total += float(r_flops(model).sum())
    return total / len(images)


@torch.no_grad()
def settle(
    model: nn.Module,
    images: torch.Tensor,
    r_target: float,
    device: torch.device | str = "cpu",
    tolerance: float = 0.01,
    iters: int = 18,
    batch: int = 128,
    amp: str = "",
) -> dict:
    """Meet the budget on clean images after training: when eval-mode r_FLOPs on ``images`` miss ``r_target`` by
    more than ``tolerance``, shift the trained thresholds by one shared amount, bisected as :func:`calibrate`
    ``mode="shared"`` does (the merge thresholds for methods that merge, else the prune thresholds). The learned
    allocation over blocks (their differences) stays.

    Returns:
        ``r_flops_trained`` (before), ``r_flops`` (after), ``shift`` (0.0 when within tolerance), ``met`` (within
        tolerance after settling; False when even the largest shift cannot reach the target) and ``images``.
    """
    merge = [p for n, p in model.named_parameters() if n.endswith("merge_threshold")]
    prune = [p for n, p in model.named_parameters() if n.endswith("prune_threshold")]
    before = mean_eval_r_flops(model, images, device, batch, amp)
    out = {"r_flops_trained": before, "r_flops": before, "shift": 0.0, "met": True, "images": len(images)}
    if abs(before - r_target) <= tolerance:
        return out
    params = merge or prune
    base = [p.detach().clone() for p in params]
    low, top = score_ranges(model)["merge_threshold" if merge else "prune_threshold"]  # as training keeps them
    span = top - low

    def r_at(shift: float) -> float:
        for p, b in zip(params, base):
            p.copy_((b + shift).clamp(low, top))
        out["shift"] = shift
        return mean_eval_r_flops(model, images, device, batch, amp)

    # r rises with the merge thresholds (fewer merges) and falls with the prune thresholds (more pruned)
    out["r_flops"] = _bisect(r_at, -span, span, bool(merge), r_target, iters)
    out["met"] = abs(out["r_flops"] - r_target) <= tolerance
    return out


@torch.no_grad()
def score_spreads(
    model: nn.Module, images: torch.Tensor, device: torch.device | str = "cpu", batch: int = 128
) -> dict[str, float]:
    """The spread of the scores each kind of threshold compares, with nothing reduced: for ``merge_threshold`` the
    set-A tokens' best cosine similarity (eq. 1 on ToMe's matching), for ``prune_threshold`` the patch tokens'
    importance (eq. 16/17), each the root mean square over blocks of the standard deviation within a block, on
    ``images`` (N, 3, H, W) in eval mode. A threshold moved by one spread passes about the same share of its
    block's tokens whatever its kind; ``ltmp.train`` steps in these units (:func:`ltmp.train.resolve`)."""
    probe = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it reduces nothing on purpose
        patch(
            probe, "ltmp", importance=model.ltmp_config.importance, merge_threshold=math.inf, prune_threshold=-math.inf
        )
    probe.eval().to(device)
    captured: list[Captured] = []
    probe.ltmp_config.capture = captured.append
    for i in range(0, len(images), batch):
        probe(images[i : i + batch].to(device))
    per_block: dict[tuple[str, int], list[Tensor]] = {}
    for c in captured:
        per_block.setdefault((c.op, c.layer), []).append(c.scores[c.candidates].double())
    out = {}
    for op in ("merge", "prune"):
        stds = [torch.cat(v).std() for (kind, _), v in per_block.items() if kind == op]  # one per block
        out[f"{op}_threshold"] = float(torch.stack(stds).square().mean().sqrt())
    return out
