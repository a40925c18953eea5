"""Pictures of what was merged and pruned (paper Figures 1 and 7), and accuracy-GMACs plots (Figure 4).

A patched model with ``trace_source=True`` records, after every block, which patches each surviving token covers.
Each layer is drawn as the image with every merged group filled with its mean colour (group borders in white)
and pruned patches greyed out.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .adapters import adapter_for
from .errors import LtmpError
from .thresholds import atomic_write


def layer_groups(model: nn.Module, image: torch.Tensor) -> list[np.ndarray]:
    """Run one image through a patched model and return, per block, its patch grid labelled by token.

    Args:
        model: A model patched with ``trace_source=True`` (it is switched to eval mode).
        image: (3, H, W) preprocessed image.

    Returns:
        One (gh, gw) int array per block: the index of the surviving token each patch belongs to, -1 if pruned.
    """
    from .record import stats

    cfg = getattr(model, "ltmp_config", None)
    if cfg is None or not cfg.trace_source:
        raise LtmpError("layer_groups needs a model patched with trace_source=True")
    model.eval()
    with torch.no_grad():
        model(image[None])
    rec = stats(model)
    (gh, gw), patch, img = adapter_for(model).patch_grid(model)
    if tuple(image.shape[-2:]) != tuple(img):
        gh, gw = image.shape[-2] // patch[0], image.shape[-1] // patch[1]
    out = []
    for src, keep in zip(rec.sources, rec.keeps):
        cover = src[0] * keep[0, :, None].to(src.dtype)  # (N_l, n) patches covered by surviving tokens
        owner = cover.argmax(0)  # (n,)
        owner[cover.sum(0) == 0] = -1
        out.append(owner.reshape(gh, gw).cpu().numpy())
    return out


def render_groups(img: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Fill each token's patches with their mean colour, grey out pruned patches, draw group borders.

    Args:
        img: (H, W, 3) float image in [0, 1].
        groups: (gh, gw) token index per patch, -1 for pruned.
    """
    H, W, _ = img.shape
    gh, gw = groups.shape
    ph, pw = H // gh, W // gw
    img = img[: gh * ph, : gw * pw]
    label = np.kron(groups, np.ones((ph, pw), dtype=groups.dtype))  # (H, W)
    out = np.empty_like(img)
    for g in np.unique(label):
        m = label == g
        if g < 0:
            grey = img[m].mean(1, keepdims=True)
            out[m] = 0.12 + 0.25 * grey  # pruned: dark, faint greyscale
        else:
            out[m] = img[m].mean(0)
    edge = np.zeros(label.shape, dtype=bool)
    edge[:-1] |= label[:-1] != label[1:]
    edge[:, :-1] |= label[:, :-1] != label[:, 1:]
    out[edge] = 1.0
    return out


def save_figure(fig, path: str | os.PathLike) -> None:
    """Save a matplotlib figure as PNG, atomically."""
    import matplotlib.pyplot as plt

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def plot_layers(rows: list[tuple[str, np.ndarray, list[np.ndarray]]], path: str | os.PathLike, title: str = "") -> None:
    """A PNG grid: one row per image (input, then the token groups after every block).

    Args:
        rows: (label, image (H, W, 3) in [0, 1], per-layer groups) per row.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = len(rows[0][2])
    fig, axes = plt.subplots(len(rows), depth + 1, figsize=(1.3 * (depth + 1), 1.45 * len(rows) + 0.4), squeeze=False)
    for r, (label, img, groups) in enumerate(rows):
        axes[r, 0].imshow(img)
        axes[r, 0].set_ylabel(label, fontsize=7)
        for l, g in enumerate(groups):
            axes[r, l + 1].imshow(render_groups(img, g))
            kept = len(np.unique(g[g >= 0]))
            axes[r, l + 1].set_xlabel(f"{kept} tok", fontsize=6, labelpad=1)
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_title("input", fontsize=7)
    for l in range(depth):
        axes[0, l + 1].set_title(f"layer {l + 1}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    save_figure(fig, path)


def plot_pareto(results: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Accuracy against GMACs, one line per method, from eval result dicts (Figure 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    by_method: dict[str, list[dict]] = {}
    for r in results:
        by_method.setdefault(r["method"], []).append(r)
    markers = {"dense": "*", "ltmp": "o", "tome": "s"}
    for method, rs in sorted(by_method.items()):
        rs = sorted(rs, key=lambda r: r["gmacs"])
        ax.plot(
            [r["gmacs"] for r in rs],
            [r["top1"] for r in rs],
            marker=markers.get(method, "^"),
            label=method,
            ms=9 if method == "dense" else 5,
        )
    ax.set_xlabel("GMACs per image")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def denormalize(x: torch.Tensor, mean, std) -> np.ndarray:
    """(3, H, W) normalized tensor -> (H, W, 3) float image in [0, 1]."""
    m = torch.tensor(mean).view(3, 1, 1)
    s = torch.tensor(std).view(3, 1, 1)
    return (x.cpu().float() * s + m).clamp(0, 1).permute(1, 2, 0).numpy()
