"""Analysis over a dataset: how many tokens each layer merges and prunes (paper Figures 5 and 6), and how the
importance scores of pruning rank against the similarity scores of merging (Kendall tau, Table 1)."""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .errors import LtmpError
from .patching import blocks
from .viz import save_figure


@torch.no_grad()
def layer_counts(model: nn.Module, loader, device: torch.device | str = "cpu",
                 max_images: int | None = None) -> dict[str, np.ndarray]:
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
def kendall_tau(model: nn.Module, loader, device: torch.device | str = "cpu",
                max_images: int | None = None) -> dict:
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
    if not (cfg.needs_importance and cfg.needs_metric):
        raise LtmpError("Kendall tau needs a method that both merges and prunes (topk-mp, ltmp)")
    model.eval().to(device)
    depth = len(blocks(model))
    taus: list[list[float]] = [[] for _ in range(depth)]
    seen = 0
    cfg.capture = []
    try:
        for batch in loader:
            imgs = batch[0]
            if imgs is None:
                continue
            cfg.capture.clear()
            model(imgs.to(device))
            for layer, imp, score, is_a in cfg.capture:  # (B, N) each
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
    return {"mean": [float(np.mean(t)) if t else None for t in taus],  # None: no layer with 2+ set-A tokens
            "std": [float(np.std(t)) if t else None for t in taus],
            "images": min(seen, max_images or seen)}


def summarize(counts: dict[str, np.ndarray]) -> dict[str, dict[str, list[float]]]:
    """Per-layer mean, quartiles and median of each count of :func:`layer_counts` (images x layers)."""
    return {k: {"mean": v.mean(0).tolist(), "q25": np.percentile(v, 25, 0).tolist(),
                "median": np.median(v, 0).tolist(), "q75": np.percentile(v, 75, 0).tolist()}
            for k, v in counts.items()}


def plot_layer_boxes(counts: dict[str, np.ndarray], path: str | os.PathLike, title: str = "") -> None:
    """Box plots of the tokens merged and pruned in each layer over the images (Figures 5 and 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = counts["merged"].shape[1]
    pos = np.arange(1, depth + 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * depth + 1.5), 3.4))
    for key, shift, colour in (("merged", -0.18, "tab:blue"), ("pruned", 0.18, "tab:orange")):
        bp = ax.boxplot([counts[key][:, l] for l in range(depth)], positions=pos + shift, widths=0.32,
                        patch_artist=True, showfliers=True, flierprops=dict(markersize=2, alpha=0.4))
        for box in bp["boxes"]:
            box.set(facecolor=colour, alpha=0.6)
        ax.plot([], [], color=colour, lw=6, alpha=0.6, label=f"{key} (mean {counts[key].sum(1).mean():.1f} "
                                                           f"tokens per image)")
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
    ax.errorbar(np.arange(1, depth + 1), [nan if v is None else v for v in result["mean"]],
                yerr=[nan if v is None else v for v in result["std"]], marker="o", capsize=3)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("Kendall tau")
    ax.set_xticks(np.arange(1, depth + 1))
    ax.grid(alpha=0.3)
    ax.set_title(title or f"set-A tokens, mean +- std over {result['images']} images", fontsize=8, wrap=True)
    save_figure(fig, path)
