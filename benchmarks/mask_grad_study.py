"""Which bounded form of eq. 6's mask gradient trains best (issue #16, point 1)? Held-out images only.

For each form (``--mask-grad clamp | eps | secant``, see ``ltmp.ops.MaskedSoftmax``) and r_target, one ``ltmp train``
run of the CIFAR-10 ViT with the paper's recipe (SGD, lr 5e-6 prune / 5e-3 merge, merge init 0.9, tau 0.1,
lambda 10), ``STEPS`` steps of batch 128, light augmentation, 2% of train held out; its ``eval.json`` is on those
1,000 held-out training images (never the test set). Finished runs are kept and skipped, interrupted ones resume,
so the script can be stopped and started again:

    nohup python benchmarks/mask_grad_study.py > runs/mask-grad.log 2>&1 &
    python benchmarks/mask_grad_study.py --table        # the table of what has finished

Runs go to ``runs/mask-grad/<form>-<merge grad>-r<target>``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
MODEL = f"local-dir:{SHARED / 'models' / 'vit-cifar10'}"
DATA = str(SHARED / "data" / "cifar10" / "cifar10-jpeg.tar.gz")
STEPS = 100
TARGETS = (0.7, 0.5)
#: (mask gradient form, merge gradient) pairs: ours so far, the reference code's, and the secant form
VARIANTS = (("clamp", "average"), ("eps", "mask"), ("eps", "average"), ("secant", "average"))


def run_dir(runs: Path, form: str, merge: str, target: float) -> Path:
    return runs / f"{form}-{merge}-r{target}"


def train(folder: Path, form: str, merge: str, target: float) -> None:
    if (folder / "eval.json").exists():
        return
    cmd = [sys.executable, "-m", "ltmp", "--quiet", "train", "--model", MODEL, "--pretrained", "--data-dir", DATA,
           "--output", str(folder), "--r-target", str(target), "--steps", str(STEPS), "--augment", "light",
           "--holdout", "0.02", "--checkpoint-every", "10", "--mask-grad", form, "--merge-grad", merge]
    if (folder / "checkpoint.safetensors").exists():
        cmd.append("--resume")
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def table(runs: Path) -> str:
    rows = ["| mask gradient | merge gradient | r_target | held-out r_FLOPs | held-out top-1 | merged / pruned per "
            "image (blocks 1-12) | prune thresholds, blocks 1 / 6 / 11 |", "|---|---|---|---|---|---|---|"]
    for form, merge in VARIANTS:
        for target in TARGETS:
            folder = run_dir(runs, form, merge, target)
            if not (folder / "eval.json").exists():
                continue
            ev = json.loads((folder / "eval.json").read_text())
            merged = sum(layer["merged"] for layer in ev["per_layer"])
            pruned = sum(layer["pruned"] for layer in ev["per_layer"])
            last = json.loads((folder / "log.jsonl").read_text().splitlines()[-1])
            prune = last.get("prune") or []
            th = " / ".join(f"{prune[i]:.4f}" for i in (0, 5, 10)) if prune else "-"
            rows.append(f"| {form} | {merge} | {target} | {ev['r_flops']:.3f} | {ev['top1']:.2f} | "
                        f"{merged:.1f} / {pruned:.1f} | {th} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(ROOT / "runs" / "mask-grad"))
    ap.add_argument("--table", action="store_true", help="only print the table of finished runs")
    args = ap.parse_args(argv)
    runs = Path(args.runs)
    if not args.table:
        for form, merge in VARIANTS:
            for target in TARGETS:
                train(run_dir(runs, form, merge, target), form, merge, target)
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
