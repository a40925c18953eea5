"""``ltmp demo``: the whole method in a few minutes on the bundled CIFAR-10 ViT and image subset.

1. Evaluate the dense model.
2. For each reduction target: calibrate the thresholds on 256 training images (training-free start), train them
   (budget below), evaluate, and evaluate ToMe with a per-layer schedule matched to the same GMACs.
3. Time every model at batch 1 (latency) and at a larger batch (throughput), print one table and one sentence on
   where the reduction pays here, and write a plot of accuracy against GMACs and a per-layer token picture into
   the output folder.

The paper's recipe (one epoch of batch 128) is about 10,000 steps on ImageNet; the bundled subset has 4,000
images, i.e. 31 such steps, which barely moves the thresholds. The demo therefore starts from calibrated thresholds
and trains for 2 epochs at batch 32 (250 steps) with ``ltmp train``'s defaults (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import time
from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from . import data as ldata
from .bench import time_forward
from .evaluate import evaluate
from .flops import rate_schedule, vit_spec
from .patching import patch
from .runtime import create_model, pick_device
from .significance import mcnemar
from .thresholds import atomic_write, write_json
from .train import TrainConfig, train


def assets() -> Path:
    return Path(str(resources.files("ltmp") / "assets"))


BUNDLED_MODEL = "local-dir:{}".format(assets() / "vit-cifar10")
BUNDLED_DATA = str(assets() / "cifar10-subset.tar.gz")


@dataclasses.dataclass
class DemoConfig:
    output: str = "ltmp-demo"
    model: str | None = None  # default: the bundled CIFAR-10 ViT
    pretrained: bool = True
    checkpoint: str | None = None
    data_dir: str | None = None  # default: the bundled CIFAR-10 subset
    val_split: str = "test"
    targets: tuple[float, ...] = (0.7, 0.5)
    epochs: float = 2.0
    batch_size: int = 32
    augment: str = "light"
    max_val_images: int | None = None
    workers: int = 2
    seed: int = 0
    bench_batch: int = 64  # throughput batch: real eval images, as many as there are up to this


def _timed_row(model, one: torch.Tensor, batch: torch.Tensor, ev: dict, label: str, r_target: str) -> dict:
    """Accuracy and cost of one model, with its batch-1 latency and its throughput on ``batch`` (medians)."""
    t = time_forward(model, one, warmup=5, reps=30)
    tb = time_forward(model, batch, warmup=2, reps=10)
    return {
        "method": label,
        "r_target": r_target,
        "r_flops": ev["r_flops"],
        "gmacs": ev["gmacs"],
        "top1": ev["top1"],
        "top1_ci95": ev["top1_ci95"],
        "latency_ms": 1000 * t["median"],
        "latency_iqr_ms": [1000 * t["p25"], 1000 * t["p75"]],
        "batch": len(batch),
        "throughput": len(batch) / tb["median"],
        "rate": ev.get("rate"),
    }


def run_demo(cfg: DemoConfig, progress: bool = True) -> dict:
    from .thresholds import load_thresholds
    from .viz import denormalize, layer_groups, plot_layers, plot_pareto

    t_start = time.perf_counter()
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    model_name = cfg.model or BUNDLED_MODEL
    data_dir = cfg.data_dir or BUNDLED_DATA
    device = pick_device("auto")

    def fresh():
        return create_model(model_name, cfg.pretrained, cfg.checkpoint).to(device)

    model = fresh()
    root = ldata.resolve_root(data_dir)
    _, eval_tf, data_cfg = ldata.transforms_for(model, "none")
    split = ldata.split_dir(root, cfg.val_split)
    val_set = ldata.spread_subset(ldata.ImageFolder(split, eval_tf), cfg.max_val_images)
    loader = DataLoader(val_set, batch_size=128, num_workers=cfg.workers, collate_fn=ldata.collate_skip)
    batch = next(iter(DataLoader(val_set, batch_size=cfg.bench_batch, collate_fn=ldata.collate_skip)))[0].to(device)
    one = batch[:1]  # (1, 3, H, W)

    def say(msg: str) -> None:
        if progress:
            print(f"[{time.perf_counter() - t_start:5.0f}s] {msg}", flush=True)

    say(f"model {model_name}, eval images {len(val_set)} from {split}")
    dense = evaluate(model, loader, device, progress=progress, model_name=model_name)
    rows = [_timed_row(model, one, batch, dense, "dense", "-")]
    results = [dense]
    trained = {}
    for target in cfg.targets:
        run_dir = out / f"ltmp-r{target}"
        say(f"training ltmp thresholds for r_target {target} -> {run_dir}")
        tcfg = TrainConfig(
            model=model_name,
            pretrained=cfg.pretrained,
            checkpoint=cfg.checkpoint,
            data_dir=data_dir,
            output=str(run_dir),
            r_target=target,
            batch_size=cfg.batch_size,
            epochs=cfg.epochs,
            augment=cfg.augment,
            calibrate=True,
            seed=cfg.seed,
            workers=cfg.workers,
            val_split=cfg.val_split,
            eval_after=False,
            checkpoint_every=100,
        )
        thr = run_dir / "thresholds.safetensors"
        if not thr.exists():
            train(tcfg, resume=run_dir.exists(), progress=progress)
        lt_model = load_thresholds(fresh(), thr)
        ev = evaluate(lt_model, loader, device, progress=progress, model_name=model_name)
        rows.append(_timed_row(lt_model, one, batch, ev, "ltmp", str(target)))
        results.append(ev)
        trained[target] = thr
        sched = rate_schedule(vit_spec(model), ev["gmacs"])
        tm_model = patch(fresh(), "tome", r=sched)
        ev_t = evaluate(tm_model, loader, device, progress=progress, model_name=model_name)
        ev_t["paired_test"] = mcnemar(ev["correct"], ev_t["correct"])
        row = _timed_row(tm_model, one, batch, ev_t, "tome", f"(match {target})")
        row["mcnemar_p"] = ev_t["paired_test"]["p_value"]
        rows.append(row)
        results.append(ev_t)

    plot_pareto(
        results,
        out / "accuracy_vs_gmacs.png",
        title=f"{Path(model_name.split(':')[-1]).name}: {len(val_set)} eval images",
    )
    last = cfg.targets[-1]
    viz_model = patch(create_model(model_name, cfg.pretrained, cfg.checkpoint), "ltmp", trace_source=True)
    load_thresholds(viz_model, trained[last])  # keeps trace_source
    pics = []
    for i in range(4):
        img = val_set[i * (len(val_set) // 4)]
        if img is None:
            continue
        x = img[0]
        pics.append(
            (
                f"image {i * (len(val_set) // 4)}",
                denormalize(x, data_cfg["mean"], data_cfg["std"]),
                layer_groups(viz_model, x),
            )
        )
    plot_layers(pics, out / "tokens.png", title=f"ltmp r_target {last}: merged groups (mean colour), pruned (grey)")
    where = f"{device}, {torch.get_num_threads()} threads"
    accuracy = accuracy_sentence(rows, len(val_set), bundled=cfg.model is None and cfg.data_dir is None)
    speed = speed_sentence(rows, where)
    table = format_table(rows) + "\n\n" + accuracy + "\n\n" + speed
    summary = {
        "rows": rows,
        "output": str(out.resolve()),
        "seconds": time.perf_counter() - t_start,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "eval_images": len(val_set),
        "accuracy": accuracy,
        "speed": speed,
    }
    write_json(out / "results.json", summary)
    atomic_write(out / "results.md", lambda tmp: Path(tmp).write_text(table + "\n"))
    print(table)
    print(
        f"\nwrote {out.resolve()}/: results.md, results.json, accuracy_vs_gmacs.png, tokens.png "
        f"({summary['seconds']:.0f} s, {summary['threads']} threads, {device})"
    )
    return summary


def format_table(rows: list[dict]) -> str:
    n = rows[0]["batch"]
    lines = [
        f"| method | r_target | r_FLOPs | GMACs | top-1 % (95% CI) | latency b=1 (ms) | throughput b={n} (img/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["top1_ci95"]
        lines.append(
            f"| {r['method']} | {r['r_target']} | {r['r_flops']:.3f} | {r['gmacs']:.4f} | "
            f"{r['top1']:.2f} ({lo:.1f}-{hi:.1f}) | {r['latency_ms']:.2f} | {r['throughput']:.0f} |"
        )
    return "\n".join(lines)


def accuracy_sentence(rows: list[dict], images: int, bundled: bool = False) -> str:
    """One sentence on LTMP against ToMe at the same GMACs: the difference in top-1 per r_target and whether the
    paired test on these images (exact McNemar, ``mcnemar_p`` of each ToMe row) tells it from noise.

    Args:
        rows: The demo's rows; each ``ltmp`` row followed by its ``tome`` row.
        images: How many images both were evaluated on.
        bundled: The bundled model and images: point to the comparison on the full test set.
    """
    parts = []
    for lt, tm in zip(rows, rows[1:]):
        if lt["method"] == "ltmp" and tm["method"] == "tome":
            p = tm["mcnemar_p"]
            parts.append(
                f"{lt['top1'] - tm['top1']:+.2f} points at r_target {lt['r_target']} (paired p={p:.2g}, "
                f"{'a real difference' if p < 0.05 else 'within noise'})"
            )
    full = " The same comparison on all 10,000 CIFAR-10 test images: docs/results.md." if bundled else ""
    return f"Accuracy: LTMP - ToMe at the same GMACs on these {images:,} images: {'; '.join(parts)}.{full}"


def speed_sentence(rows: list[dict], where: str) -> str:
    """One sentence, from the timings, on whether the reduced models beat the dense one at batch 1 and at batch N.

    Args:
        rows: The demo's rows, dense first; each with ``latency_ms``, ``throughput`` and ``batch``.
        where: The machine, e.g. "cpu, 2 threads".
    """
    dense, reduced = rows[0], rows[1:]
    n = dense["batch"]
    lat = [dense["latency_ms"] / r["latency_ms"] for r in reduced]  # speed-up at batch 1 (> 1: faster)
    thr = [r["throughput"] / dense["throughput"] for r in reduced]  # speed-up at batch n

    def verdict(ratios: list[float]) -> str:
        if all(v > 1 for v in ratios):
            return "every reduced model is faster than dense"
        if not any(v > 1 for v in ratios):
            return "every reduced model is slower than dense"
        return f"{sum(v > 1 for v in ratios)} of {len(ratios)} reduced models are faster than dense"

    return (
        f"Speed here ({where}): at batch 1 {verdict(lat)} ({min(lat):.2f}-{max(lat):.2f}x its speed); at batch "
        f"{n} {verdict(thr)} ({min(thr):.2f}-{max(thr):.2f}x its throughput)."
    )
