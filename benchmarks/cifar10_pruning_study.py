"""Why LTMP only ties ToMe on the CIFAR-10 ViT: the prune thresholds never engage at the paper's learning rate.

    python benchmarks/cifar10_pruning_study.py [--runs runs/cifar10] [--doc docs/cifar10-pruning.md]

Run after benchmarks/cifar10_evidence.py (it reuses its runs). The paper's initial merge threshold (0.9)
over-merges this model (r_FLOPs about 0.4 at step 0), so the budget loss first pushes the prune thresholds below
zero; at lr 5e-6 they end near 1e-5, far below the importance scores (about 1/65), and nothing is pruned: LTMP
trains as learned-threshold merging. This script trains the same recipe with a 100x prune learning rate, from the
paper's start and from a calibrated start, and compares each with ToMe at matching GMACs on the test set.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cifar10_evidence import evaluate
from common import DATA, MODEL, ROOT, run

VARIANTS = {  # name -> extra train arguments
    "paper": [],
    "lr-prune-5e-4": ["--lr-prune", "5e-4"],
    "calibrated+lr-prune-5e-4": ["--lr-prune", "5e-4", "--calibrate"],
}
TARGETS = (0.5, 0.7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=str(ROOT / "runs/cifar10"))
    ap.add_argument("--doc", default=str(ROOT / "docs/cifar10-pruning.md"))
    ap.add_argument("--targets", default=",".join(map(str, TARGETS)))
    args = ap.parse_args()
    runs = Path(args.runs)
    rows = []
    for t in [float(v) for v in args.targets.split(",")]:
        for name, extra in VARIANTS.items():
            out = runs / (f"light-r{t}" if name == "paper" else f"light-{name}-r{t}")
            if not (out / "eval.json").exists():
                run(["train", "--model", MODEL, "--pretrained", "--data-dir", DATA, "--val-split", "test",
                     "--r-target", str(t), "--augment", "light", "--holdout", "0.02", "--output", str(out),
                     "--no-settle"]
                    + extra + (["--resume"] if out.exists() else []))
            lt_json = runs / f"test-ltmp-{out.name}.json"
            lt = evaluate(lt_json, "--thresholds", str(out / "thresholds.safetensors"))
            tm = evaluate(runs / f"test-tome-match-{out.name}.json", "--method", "tome", "--match", str(lt_json),
                          "--compare", str(lt_json))
            rows.append((t, name, lt, tm))
    lines = ["# Why LTMP ties ToMe on the CIFAR-10 ViT: pruning thresholds", "",
             "Produced by `python benchmarks/cifar10_pruning_study.py` (after `benchmarks/cifar10_evidence.py`), "
             "2-core x86_64 CPU. Recipe as in [cifar10.md](cifar10.md) (light augmentation, 2% held out), "
             "test set of 10,000 images; ToMe uses the per-layer schedule closest in GMACs.", "",
             "| r_target | variant | LTMP r_FLOPs | LTMP GMACs | LTMP top-1 | pruned tokens (all layers) | "
             "ToMe GMACs | ToMe top-1 | McNemar p |", "|---|---|---|---|---|---|---|---|---|"]
    for t, name, lt, tm in rows:
        pruned = sum(x["pruned"] for x in lt["per_layer"])
        lines.append(f"| {t} | {name} | {lt['r_flops']:.3f} | {lt['gmacs']:.4f} | {lt['top1']:.2f} | {pruned:.1f} | "
                     f"{tm['gmacs']:.4f} | {tm['top1']:.2f} | {tm['paired_test']['p_value']:.3g} |")
    lines += ["", "Per-layer mean merged/pruned tokens:", ""]
    for t, name, lt, _ in rows:
        lines.append(f"- {t} {name}: " + ", ".join(f"{x['merged']:.1f}/{x['pruned']:.1f}" for x in lt["per_layer"]))
    Path(args.doc).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
