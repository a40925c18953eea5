"""Analysis over a dataset: how many tokens each layer merges and prunes (paper Figures 5 and 6), and how the
importance scores of pruning rank against the similarity scores of merging (Kendall tau, Table 1)."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .config import METHODS
from .errors import LtmpError
from .patching import blocks
from .viz import save_figure


@torch.no_grad()
def layer_counts(
    model: nn.Module, loader, device: torch.device | str = "cpu", max_images: int | None = None
) -> dict[str, np.ndarray]:
    """Per image and layer, the tokens merged and pruned by a patched model in eval mode.

    Returns:
        ``merged``, ``pruned``, ``kept``: (images, L) int arrays.
    """
    from .record import stats

    model.eval().to(device)
    out: dict[str, list] = {"merged": [], "pruned": [], "kept": []}
    seen = 0
    for batch in loader:
        imgs = batch[0]
        if imgs is None:
            continue
        model(imgs.to(device))
        rec = stats(model)
        for key in out:
            out[key].append(getattr(rec, key).cpu().numpy())
        seen += len(imgs)
        if max_images and seen >= max_images:
            break
    return {k: np.concatenate(v)[:max_images] for k, v in out.items()}


@torch.no_grad()
def kendall_tau(model: nn.Module, loader, device: torch.device | str = "cpu", max_images: int | None = None) -> dict:
    """Kendall tau between the importance scores (pruning) and the similarity scores (merging) of the set-A tokens,
    per layer and image (paper Table 1, computed with :func:`scipy.stats.kendalltau`).

    Args:
        model: A model patched with a method that both merges and prunes, e.g. ``topk-mp`` with ``k=8`` as in
            the paper.

    Returns:
        ``mean``, ``std`` (per layer, over images) and ``images``.
    """
    from scipy.stats import kendalltau

    cfg = model.ltmp_config
    if not ("prune" in cfg.ops and "merge" in cfg.ops):
        raise LtmpError("Kendall tau needs a method that both merges and prunes (topk-mp, ltmp)")
    model.eval().to(device)
    depth = len(blocks(model))
    taus: list[list[float]] = [[] for _ in range(depth)]
    seen = 0
    captured: list = []
    cfg.capture = captured.append
    try:
        for batch in loader:
            imgs = batch[0]
            if imgs is None:
                continue
            captured.clear()
            model(imgs.to(device))
            for layer, op, score, is_a, imp, _ in captured:  # (B, N) each
                if op != "merge" or imp is None:
                    continue
                for b in range(imp.shape[0]):
                    a = is_a[b]
                    if int(a.sum()) >= 2:
                        tau = kendalltau(imp[b][a].double().numpy(), score[b][a].double().numpy()).statistic
                        if np.isfinite(tau):
                            taus[layer].append(float(tau))
            seen += len(imgs)
            if max_images and seen >= max_images:
                break
    finally:
        cfg.capture = None
    return {
        "mean": [float(np.mean(t)) if t else None for t in taus],  # None: no layer with 2+ set-A tokens
        "std": [float(np.std(t)) if t else None for t in taus],
        "images": min(seen, max_images or seen),
    }


#: Images (spread over the set) on which ``ltmp train``, ``eval`` and ``analyze`` describe the allocation.
ALLOCATION_IMAGES = 512


def image_batch(dataset, n: int = ALLOCATION_IMAGES) -> torch.Tensor:
    """Up to ``n`` readable images of ``dataset`` spread over it (class-balanced for ImageFolder), as (N, 3, H, W)."""
    from .data import spread_subset

    part = spread_subset(dataset, n)
    items = [it for it in (part[i] for i in range(len(part))) if it is not None]
    if not items:
        raise LtmpError("no readable images to describe the allocation on")
    return torch.stack([it[0] for it in items])


@torch.no_grad()
def allocation(
    model: nn.Module, images: torch.Tensor, device: torch.device | str = "cpu", batch: int = 128, shared: bool = True
) -> dict:
    """Where a model with learned thresholds reduces, block by block, on ``images`` (N, 3, H, W) in eval mode.

    - ``merged`` / ``pruned``: mean tokens per image each block merges away and prunes; ``*_frac``: the same as
      fractions of the n patch tokens.
    - ``merge_quantile`` / ``prune_quantile``: each threshold's position in its block's scores, i.e. the fraction
      of the block's candidates whose score lies at or below it, pooled over the images (candidates: set-A
      similarities for merging, the surviving patch tokens' importance for pruning; None where a block had
      none). Merging removes the ``1 - q`` above its threshold, pruning the ``q`` below.
    - ``shared`` (if asked): the same counts for one threshold shared by every block and bisected on these images
      to the same r_FLOPs (:func:`ltmp.calibrate.calibrate` ``mode="shared"``: a merge threshold, nothing pruned;
      a prune threshold for ``ltp``), and ``reallocated``: the share of the removed tokens that the learned
      thresholds remove in other blocks, or by the other operation, than the shared threshold does (the total
      variation distance between the two allocations over (block, operation)).
    """
    import copy

    from .calibrate import calibrate
    from .record import r_flops

    cfg = model.ltmp_config
    if not cfg.learned:
        raise LtmpError("allocation() describes learned thresholds; this model uses a fixed rate")
    model.eval().to(device)
    depth = len(blocks(model))
    below = {op: np.zeros(depth) for op in cfg.ops}  # candidates at or below the threshold, per block
    total = {op: np.zeros(depth) for op in cfg.ops}
    counts = {"merged": np.zeros(depth), "pruned": np.zeros(depth)}
    r_sum = 0.0
    captured: list = []
    cfg.capture = captured.append
    try:
        for i in range(0, len(images), batch):
            captured.clear()
            model(images[i : i + batch].to(device))
            for c in captured:  # one entry per (block, operation)
                th = float(getattr(blocks(model)[c.layer], f"{c.op}_threshold"))
                scores = c.scores[c.candidates].double()
                below[c.op][c.layer] += float((scores <= th).sum())
                total[c.op][c.layer] += scores.numel()
            rec = model.ltmp_record
            for key in counts:
                counts[key] += getattr(rec, key).double().sum(0).cpu().numpy()
            r_sum += float(r_flops(model).sum())
    finally:
        cfg.capture = None
    n = len(images)
    patches = model.ltmp_record.num_patches
    out: dict = {"images": n, "r_flops": r_sum / n, "method": cfg.method}
    for key in counts:
        out[key] = (counts[key] / n).tolist()
        out[f"{key}_frac"] = (counts[key] / n / patches).tolist()
    for op in ("merge", "prune"):
        out[f"{op}_quantile"] = (
            None if op not in cfg.ops else [float(b / t) if t else None for b, t in zip(below[op], total[op])]
        )
    if shared:
        base = copy.deepcopy(model)
        for name, p in base.named_parameters():
            if name.endswith("prune_threshold") and "merge" in cfg.ops:
                p.fill_(0.0)  # the shared threshold merges only (as `ltmp calibrate`); importance is never below 0
        calibrate(base, images, out["r_flops"], device, iters=14, batch=batch)
        ref = allocation(base, images, device, batch, shared=False)
        out["shared"] = {k: ref[k] for k in ("r_flops", "merged", "pruned", "merge_quantile", "prune_quantile")}
        kind = "merge_threshold" if "merge" in cfg.ops else "prune_threshold"
        out["shared"]["threshold"] = float(getattr(blocks(base)[0], kind))
        ours = np.array(out["merged"] + out["pruned"])
        theirs = np.array(ref["merged"] + ref["pruned"])
        out["reallocated"] = float(
            0.5 * np.abs(ours / max(ours.sum(), 1e-12) - theirs / max(theirs.sum(), 1e-12)).sum()
        )
    return out


def format_allocation(a: dict) -> str:
    """The table of :func:`allocation`, one line per block."""

    def q(v: list | None, i: int) -> str:
        return "-" if v is None or v[i] is None else f"{v[i]:.3f}"

    lines = [
        f"allocation on {a['images']} images (r_FLOPs {a['r_flops']:.3f}): tokens per image merged / pruned, "
        f"thresholds as quantiles of their block's scores"
        + (", and one shared threshold at the same r_FLOPs" if "shared" in a else "")
    ]
    head = "block  merged  pruned  merge q  prune q"
    lines.append(head + ("   | shared: merged  pruned" if "shared" in a else ""))
    for i in range(len(a["merged"])):
        row = (
            f"{i + 1:>5}  {a['merged'][i]:6.2f}  {a['pruned'][i]:6.2f}  {q(a['merge_quantile'], i):>7}  "
            f"{q(a['prune_quantile'], i):>7}"
        )
        if "shared" in a:
            row += f"   |         {a['shared']['merged'][i]:6.2f}  {a['shared']['pruned'][i]:6.2f}"
        lines.append(row)
    if "shared" in a:
        lines.append(f"reallocated against the shared threshold: {100 * a['reallocated']:.1f}% of the removed tokens")
    method = a.get("method", "")
    for op, key in (("merge", "merged"), ("prune", "pruned")):  # an operation of the method that did nothing
        if op in METHODS.get(method, ((),))[0] and not any(a[key]):
            lines.append(
                f"note: {method} {key} no token in any block on these images: it ran as "
                f"{'pruning' if op == 'merge' else 'merging'} alone"
            )
    return "\n".join(lines)


def summarize(counts: dict[str, np.ndarray]) -> dict[str, dict[str, list[float]]]:
    """Per-layer mean, quartiles and median of each count of :func:`layer_counts` (images x layers)."""
    return {
        k: {
            "mean": v.mean(0).tolist(),
            "q25": np.percentile(v, 25, 0).tolist(),
            "median": np.median(v, 0).tolist(),
            "q75": np.percentile(v, 75, 0).tolist(),
        }
        for k, v in counts.items()
    }


def plot_layer_boxes(counts: dict[str, np.ndarray], path: str | os.PathLike, title: str = "") -> None:
    """Box plots of the tokens merged and pruned in each layer over the images (Figures 5 and 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = counts["merged"].shape[1]
    pos = np.arange(1, depth + 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * depth + 1.5), 3.4))
    for key, shift, colour in (("merged", -0.18, "tab:blue"), ("pruned", 0.18, "tab:orange")):
        bp = ax.boxplot(
            [counts[key][:, l] for l in range(depth)],
            positions=pos + shift,
            widths=0.32,
            patch_artist=True,
            showfliers=True,
            flierprops=dict(markersize=2, alpha=0.4),
        )
        for box in bp["boxes"]:
            box.set(facecolor=colour, alpha=0.6)
        ax.plot(
            [],
            [],
            color=colour,
            lw=6,
            alpha=0.6,
            label=f"{key} (mean {counts[key].sum(1).mean():.1f} tokens per image)",
        )
    ax.set_xticks(pos, [str(p) for p in pos])
    ax.set_xlabel("layer")
    ax.set_ylabel("tokens removed in the layer")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def plot_kendall(result: dict, path: str | os.PathLike, title: str = "") -> None:
    """Kendall tau per layer with its spread over images (Table 1 as a plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = len(result["mean"])
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * depth + 1.5), 3.2))
    nan = float("nan")
    ax.errorbar(
        np.arange(1, depth + 1),
        [nan if v is None else v for v in result["mean"]],
        yerr=[nan if v is None else v for v in result["std"]],
        marker="o",
        capsize=3,
    )
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("Kendall tau")
    ax.set_xticks(np.arange(1, depth + 1))
    ax.grid(alpha=0.3)
    ax.set_title(title or f"set-A tokens, mean +- std over {result['images']} images", fontsize=8, wrap=True)
    save_figure(fig, path)
