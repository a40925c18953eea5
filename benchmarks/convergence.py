"""Convergence (issue #7, claim 6): accuracy and r_FLOPs against the number of training images, from the
thresholds that ``ltmp train`` logs after every step (``log.jsonl``), without retraining.

    python benchmarks/convergence.py runs/cifar10/light-r0.7 runs/cifar10/light-r0.5 --out runs/convergence.json

Each run folder needs ``config.json`` and ``log.jsonl`` (per-step ``merge``/``prune`` thresholds). Step 0 is the
initial thresholds. Evaluation: the run's model on ``--val-split`` (default test) of its data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import ltmp
from ltmp import data as ldata
from ltmp.evaluate import evaluate
from ltmp.runtime import create_model
from ltmp.thresholds import atomic_write, set_thresholds


def thresholds_at(log: list[dict], step: int, cfg: dict, depth: int) -> dict[str, torch.Tensor]:
    if step == 0:
        return {
            "merge_threshold": torch.full((depth,), float(cfg["merge_init"])),
            "prune_threshold": torch.full((depth,), float(cfg["prune_init"])),
        }
    line = next(rec for rec in log if rec["step"] == step)
    return {"merge_threshold": torch.tensor(line["merge"]), "prune_threshold": torch.tensor(line["prune"])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--steps", default="0,10,25,50,100,200,last")
    p.add_argument("--val-split", default="test")
    p.add_argument("--max-images", type=int)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--out", default="runs/convergence.json")
    args = p.parse_args(argv)
    results = []
    for run in args.runs:
        cfg = json.loads((Path(run) / "config.json").read_text())
        log = [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines() if line]
        last = max(rec["step"] for rec in log)
        model = create_model(cfg["model"], cfg["pretrained"], cfg.get("checkpoint"))
        ltmp.patch(model, cfg["method"], tau=cfg["tau"], importance=cfg["importance"])
        kinds = set(ltmp.thresholds.threshold_tensors(model))
        _, tf, _ = ldata.transforms_for(model, "none")
        ds = ldata.ImageFolder(ldata.split_dir(ldata.resolve_root(cfg["data_dir"]), args.val_split), tf)
        ds = ldata.spread_subset(ds, args.max_images)
        loader = DataLoader(ds, batch_size=args.batch_size, num_workers=2, collate_fn=ldata.collate_skip)
        for s in args.steps.split(","):
            step = last if s == "last" else min(int(s), last)
            th = {k: v for k, v in thresholds_at(log, step, cfg, len(model.blocks)).items() if k in kinds}
            set_thresholds(model, th)
            ev = evaluate(model, loader, "cpu", progress=False)
            row = {
                "run": run,
                "r_target": cfg["r_target"],
                "step": step,
                "images": step * cfg["batch_size"],
                "top1": ev["top1"],
                "r_flops": ev["r_flops"],
                "gmacs": ev["gmacs"],
                "pruned_per_image": sum(layer["pruned"] for layer in ev["per_layer"]),
            }
            results.append(row)
            print(
                f"{Path(run).name} step {step:4d} ({row['images']:6d} images): top-1 {row['top1']:.2f}%, "
                f"r_FLOPs {row['r_flops']:.3f}, pruned/image {row['pruned_per_image']:.2f}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, lambda tmp: Path(tmp).write_text(json.dumps(results, indent=1)))


if __name__ == "__main__":
    main()
