"""Evaluation of a dense, learned-threshold or fixed-rate model: accuracy, GMACs (eq. 8-12) and tokens per layer."""

from __future__ import annotations

import time

import torch
from torch import nn

from .data import fingerprint
from .errors import LtmpError
from .flops import dense_gmacs, gmacs, gmacs_executed, vit_spec
from .record import r_flops, stats
from .runtime import amp_context, require_classifier
from .runtime import logits as logits_of
from .significance import wilson_interval

SCHEMA_VERSION = 1


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader,
    device: torch.device | str = "cpu",
    amp: str = "",
    progress: bool = True,
    model_name: str = "",
) -> dict:
    """Accuracy, GMACs from actual token counts, executed (padded) GMACs and per-layer token counts.

    Works on dense (unpatched), learned-threshold and fixed-rate models, over the whole loader at any batch size.
    The keys ``schema_version, top1, top5, images, gmacs, gmacs_dense, gmacs_ratio, gmacs_executed, r_flops,
    per_layer, method, model`` are stable.
    """
    device = torch.device(device)
    require_classifier(model)
    model.eval().to(device)
    spec = vit_spec(model)
    cfg = getattr(model, "ltmp_config", None)
    L = spec.depth
    n_img = c1 = c5 = skipped = 0
    correct: list[str] = []
    g_sum = g_exec = r_sum = 0.0
    merged = torch.zeros(L, dtype=torch.float64)
    pruned = torch.zeros(L, dtype=torch.float64)
    kept = torch.zeros(L, dtype=torch.float64)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(loader), desc="eval", unit="batch", dynamic_ncols=True)
    dense = dense_gmacs(spec)
    t0 = time.perf_counter()
    for imgs, labels, _, nskip in loader:
        skipped += nskip
        if bar is not None:
            bar.update(1)
        if imgs is None:
            continue
        imgs, labels = imgs.to(device), labels.to(device)
        with amp_context(amp, device):
            logits = logits_of(model(imgs))
        top5 = logits.float().topk(min(5, logits.shape[-1]), dim=-1).indices  # (B, 5)
        ok1 = top5[:, 0] == labels
        c1 += int(ok1.sum())
        c5 += int((top5 == labels[:, None]).any(1).sum())
        correct.append("".join("1" if v else "0" for v in ok1.tolist()))
        B = imgs.shape[0]
        n_img += B
        if cfg is None:
            g_sum += dense * B
            g_exec += dense * B
            r_sum += B
            kept += spec.num_patches * B
        else:
            rec = stats(model)
            g_sum += float(gmacs(spec, rec.kept.cpu()).sum())
            g_exec += gmacs_executed(spec, rec.padded) * B
            r_sum += float(r_flops(model).sum())
            merged += rec.merged.double().sum(0).cpu()
            pruned += rec.pruned.double().sum(0).cpu()
            kept += rec.kept.double().sum(0).cpu()
        if bar is not None:
            bar.set_postfix(top1=f"{100 * c1 / n_img:.2f}")
    if bar is not None:
        bar.close()
    if n_img == 0:
        raise LtmpError("no readable images in the eval set; check --data-dir and --val-split")
    seconds = time.perf_counter() - t0
    return {
        "schema_version": SCHEMA_VERSION,
        "model": model_name,
        "method": cfg.method if cfg is not None else "dense",
        "top1": 100 * c1 / n_img,
        "top1_ci95": list(wilson_interval(c1, n_img)),
        "top5": 100 * c5 / n_img,
        "images": n_img,
        "skipped": skipped,
        "gmacs": g_sum / n_img,
        "gmacs_dense": dense,
        "gmacs_ratio": g_sum / n_img / dense,
        "gmacs_executed": g_exec / n_img,
        "r_flops": r_sum / n_img,
        "per_layer": [
            {"merged": float(m) / n_img, "pruned": float(p) / n_img, "kept": float(k) / n_img}
            for m, p, k in zip(merged, pruned, kept)
        ],
        "rate": list(cfg.rate) if cfg is not None and cfg.rate is not None else None,
        "images_sha256": fingerprint(loader.dataset),  # which images (``ltmp eval --compare`` checks it)
        "batch_size": getattr(loader, "batch_size", None),
        "seconds": seconds,
        "correct": "".join(correct),
    }
