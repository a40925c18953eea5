"""LTMP against ToMe at matching GMACs on the CIFAR-10 ViT of ../shared/models (issue: train/eval evidence).

    python benchmarks/cifar10_evidence.py [--runs runs/cifar10] [--doc docs/cifar10.md]

1. Trains ltmp thresholds for r_target 0.7 and 0.5 with two augmentations (timm's default, as in the paper, and
   the light crop+flip of the CIFAR pretraining), holding out 2% of train (1,000 images) as in the paper.
2. Picks the augmentation with the better held-out accuracy (never the test set).
3. Evaluates the chosen runs on the 10,000 test images next to ToMe with a per-layer r schedule matched to their
   GMACs, and the dense model; a paired McNemar test compares LTMP with ToMe.
4. Writes a markdown table.

Resumable: finished steps are skipped, interrupted trainings resume from their checkpoints.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from common import DATA, MODEL, ROOT, run

TARGETS = (0.7, 0.5)
AUGMENTS = ("timm", "light")


def train(out: Path, target: float, augment: str) -> dict:
    if not (out / "eval.json").exists():
        resume = ["--resume"] if out.exists() else []
        run(["train", "--model", MODEL, "--pretrained", "--data-dir", DATA, "--val-split", "test",
             "--r-target", str(target), "--augment", augment, "--holdout", "0.02", "--output", str(out),
             "--no-settle"] + resume)
    return json.loads((out / "eval.json").read_text())


def evaluate(out: Path, *extra: str) -> dict:
    if not out.exists():
        run(["eval", "--model", MODEL, "--pretrained", "--data-dir", DATA, "--val-split", "test", "--json", str(out),
             *extra])
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=str(ROOT / "runs/cifar10"))
    ap.add_argument("--doc", default=str(ROOT / "docs/cifar10.md"))
    args = ap.parse_args()
    runs = Path(args.runs)
    holdout = {(a, t): train(runs / f"{a}-r{t}", t, a) for a in AUGMENTS for t in TARGETS}
    # a setting qualifies if its held-out r_FLOPs land within 0.03 of every target; then higher accuracy wins
    hits = {a: all(abs(holdout[(a, t)]["r_flops"] - t) <= 0.03 for t in TARGETS) for a in AUGMENTS}
    score = {a: sum(holdout[(a, t)]["top1"] for t in TARGETS) for a in AUGMENTS}
    chosen = max(AUGMENTS, key=lambda a: (hits[a], score[a]))
    dense = evaluate(runs / "test-dense.json", "--method", "dense")
    rows = []
    for t in TARGETS:
        ltmp_json = runs / f"test-ltmp-{chosen}-r{t}.json"
        lt = evaluate(ltmp_json, "--thresholds", str(runs / f"{chosen}-r{t}" / "thresholds.safetensors"))
        tm = evaluate(runs / f"test-tome-r{t}.json", "--method", "tome", "--match", str(ltmp_json),
                      "--compare", str(ltmp_json))
        rows.append((t, lt, tm))

    lines = [
        "# LTMP against ToMe on the CIFAR-10 ViT",
        "",
        f"Produced by `python benchmarks/cifar10_evidence.py` on {platform.machine()} CPU "
        f"({torch.get_num_threads()} threads), torch {torch.__version__}.",
        "Model: `../shared/models/vit-cifar10` (65 tokens, 0.1678 GMACs); data: the shared CIFAR-10 JPEG copy.",
        "Training: the paper's recipe (1 epoch, SGD without momentum, batch 128, lr 5e-3 merge / 5e-6 prune, "
        "tau 0.1, lambda 10, frozen backbone) on 98% of train; 2% (1,000 images) held out.",
        "",
        "## Augmentation, chosen on the held-out images",
        "",
        "| augment | r_target | held-out top-1 | held-out r_FLOPs |",
        "|---|---|---|---|",
    ]
    for a in AUGMENTS:
        for t in TARGETS:
            h = holdout[(a, t)]
            lines.append(f"| {a} | {t} | {h['top1']:.2f} | {h['r_flops']:.3f} |")
    lines += ["", f"Chosen: **{chosen}**: held-out r_FLOPs within 0.03 of the targets: "
              + ", ".join(f"{a} {'yes' if hits[a] else 'no'}" for a in AUGMENTS)
              + "; then the higher summed held-out top-1.", "",
              "## Test set (10,000 images)", "",
              "| method | r_target | r_FLOPs | GMACs | top-1 (95% CI) | ToMe r schedule | McNemar p (LTMP vs ToMe) |",
              "|---|---|---|---|---|---|---|",
              f"| dense | - | 1.000 | {dense['gmacs']:.4f} | {dense['top1']:.2f} "
              f"({dense['top1_ci95'][0]:.2f}-{dense['top1_ci95'][1]:.2f}) | - | - |"]
    for t, lt, tm in rows:
        p = tm["paired_test"]
        lines.append(f"| ltmp | {t} | {lt['r_flops']:.3f} | {lt['gmacs']:.4f} | {lt['top1']:.2f} "
                     f"({lt['top1_ci95'][0]:.2f}-{lt['top1_ci95'][1]:.2f}) | - | - |")
        lines.append(f"| tome | - | {tm['r_flops']:.3f} | {tm['gmacs']:.4f} | {tm['top1']:.2f} "
                     f"({tm['top1_ci95'][0]:.2f}-{tm['top1_ci95'][1]:.2f}) | {','.join(map(str, tm['rate']))} | "
                     f"{p['p_value']:.3g} (ToMe-only correct {p['only_a_correct']}, LTMP-only {p['only_b_correct']}) |")
    lines += ["", "Per-layer mean tokens (LTMP): merged / pruned", ""]
    for t, lt, _ in rows:
        per = ", ".join(f"{x['merged']:.1f}/{x['pruned']:.1f}" for x in lt["per_layer"])
        lines.append(f"- r_target {t}: {per}")
    lines += ["", "## Reading the result", ""]
    for t, lt, tm in rows:
        log = [json.loads(x) for x in (runs / f"{chosen}-r{t}" / "log.jsonl").read_text().splitlines()]
        pruned = sum(x["pruned"] for x in lt["per_layer"])
        diff = lt["top1"] - tm["top1"]
        lines.append(
            f"- r_target {t}: LTMP {'+' if diff >= 0 else ''}{diff:.2f} points against ToMe at "
            f"{100 * (lt['gmacs'] / tm['gmacs'] - 1):+.1f}% GMACs (McNemar p = {tm['paired_test']['p_value']:.2g}). "
            f"r_FLOPs at training step 1: {log[0]['r_flops']:.3f}; final prune thresholds "
            f"{min(log[-1]['prune']):.1e} to {max(log[-1]['prune']):.1e}; tokens pruned per image: {pruned:.2f}.")
    lines += [
        "",
        "The paper's initial merge threshold (0.9) over-merges this small ViT, so r_FLOPs starts far below the "
        "target and the budget loss first pushes every threshold towards *less* reduction: the merge thresholds "
        "rise, and the prune thresholds sink below zero. At the paper's prune learning rate (5e-6) they end "
        "within about 1e-4 of zero, far below this model's importance scores (about 1/65), so nothing is "
        "pruned and LTMP trains as learned-threshold merging (LTM). The paper itself finds LTM only marginally "
        "better than ToMe (Table 5: +0.1 and +0.2 points on DeiT-S); the McNemar p-values above say whether the "
        "difference here is significant.",
    ]
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(args.doc).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
