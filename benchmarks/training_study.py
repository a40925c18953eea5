"""Held-out training studies of issue #16: which eq. 6 mask-gradient form, and which procedure, trains best.

Each run is one ``ltmp train`` of the CIFAR-10 ViT (``../shared``): SGD, batch 128, tau 0.1, lambda 10, ``STEPS``
steps, light augmentation, 2% of train held out. Its ``eval.json`` is on those 1,000 held-out training images
(never the test set). Finished runs are kept and skipped, interrupted ones resume, so the script can be stopped
and started again:

    nohup python benchmarks/training_study.py forms procedure > runs/study.log 2>&1 &
    python benchmarks/training_study.py forms procedure --table     # the tables of what has finished

- ``forms``: the three forms of eq. 6's gradient to removed keys' masks (``--mask-grad``, see
  ``ltmp.ops.MaskedSoftmax``) at r_target 0.7 and 0.5, with the paper's learning rates and with the prune
  learning rate of benchmarks/reproduce.py (3e-4, merge thresholds from 1.0).
- ``optimizer``: the ``secant`` form with Adam (each threshold's step normalised by its gradient's size), with the
  paper's budget penalty (eq. 14-15) and with the budget as a constraint (``--budget constraint``, dual ascent).
- ``procedure``: the ``secant`` form at r_target 0.85 to 0.45, with the paper's SGD and with Adam.
- ``beyond``: the defaults (``secant``, Adam) with distillation from the unreduced model's logits (``--distill
  1``) and from a calibrated start (``--calibrate``), at r_target 0.7 and 0.5, paired with ``secant-adam``;
  ``--test`` then evaluates them once on the test set.

Runs go to ``runs/study/<variant>-r<target>``. What the tables use of them (each run's held-out and test
evaluation, or why it stopped) is kept in ``RAW`` (``results/training_study.json``, committed); ``--render``
prints the tables from it alone, without the runs:

    python benchmarks/training_study.py forms optimizer procedure beyond --render --test
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import DATA, MODEL, ROOT, compact, unpack

RAW = ROOT / "results" / "training_study.json"
SAVED: dict | None = None  # --render: RAW's records; nothing is read from the runs or run
KEPT: dict[str, object] = {}  # the records this call read from the runs, merged into RAW at the end


def record(folder: Path, name: str) -> dict | str | None:
    """One run's ``eval.json`` / ``test.json`` (compacted; ``correct`` unpacked) or ``stopped.txt`` (with the
    steps its log reached): from RAW when rendering, else from the run folder (and kept for RAW)."""
    key = f"{folder.name}/{name}"
    if SAVED is not None:
        value = SAVED.get(key)
    elif not (folder / name).exists():
        return None
    elif name == "stopped.txt":
        steps = len((folder / "log.jsonl").read_text().splitlines())
        value = KEPT[key] = f"stopped at step {steps}: {(folder / name).read_text().strip()}"
    else:
        value = KEPT[key] = compact(json.loads((folder / name).read_text()))
    return dict(value, correct=unpack(value["correct"])) if isinstance(value, dict) else value

STEPS = 100
PAPER = ["--optimizer", "sgd", "--lr-merge", "5e-3", "--lr-prune", "5e-6", "--merge-init", "0.9"]  # the paper's
RECIPE = ["--optimizer", "sgd", "--lr-merge", "5e-3", "--lr-prune", "3e-4", "--merge-init", "1.0"]  # reproduce.py
#: Adam: steps of about lr per step in each threshold's own units, 10x smaller for importance (about 1/65 here)
#: than for cosine similarities; from no reduction (merge 1.0, prune 0)
ADAM = ["--optimizer", "adam", "--lr-merge", "2e-3", "--lr-prune", "2e-4", "--merge-init", "1.0"]
STUDIES: dict[str, tuple[tuple[float, ...], dict[str, list[str]]]] = {
    "forms": ((0.7, 0.5), {
        "eps-mask-paper": ["--mask-grad", "eps", "--merge-grad", "mask", *PAPER],  # the reference code's signal
        "clamp-paper": ["--mask-grad", "clamp", *PAPER],
        "eps-mask-recipe": ["--mask-grad", "eps", "--merge-grad", "mask", *RECIPE],
        "clamp-recipe": ["--mask-grad", "clamp", *RECIPE],
        "secant-recipe": ["--mask-grad", "secant", *RECIPE],
    }),
    "optimizer": ((0.7,), {
        "secant-adam": ["--mask-grad", "secant", *ADAM],
        "secant-adam-constraint": ["--mask-grad", "secant", *ADAM, "--budget", "constraint"],
    }),
    "procedure": ((0.85, 0.75, 0.65, 0.55, 0.45, 0.7, 0.5), {
        "secant-paper": ["--mask-grad", "secant", *PAPER],
        "secant-adam": ["--mask-grad", "secant", *ADAM],
    }),
    "beyond": ((0.7, 0.5), {  # point 4 of #16, against secant-adam of "procedure"
        "secant-adam-distill": ["--mask-grad", "secant", *ADAM, "--distill", "1"],
        "secant-adam-calibrate": ["--mask-grad", "secant", *ADAM, "--calibrate"],
    }),
}


def train(folder: Path, target: float, extra: list[str]) -> None:
    if (folder / "eval.json").exists() or (folder / "stopped.txt").exists():
        return
    cmd = [sys.executable, "-m", "ltmp", "--quiet", "train", "--model", MODEL, "--pretrained", "--data-dir", DATA,
           "--output", str(folder), "--r-target", str(target), "--steps", str(STEPS), "--augment", "light",
           "--holdout", "0.02", "--checkpoint-every", "10", "--no-settle", *extra]  # training alone, as measured
    if (folder / "checkpoint.safetensors").exists():
        cmd.append("--resume")
    print(" ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(res.stdout + res.stderr)
    if res.returncode:  # e.g. training stopped on a collapsed block: keep its message, don't retry
        (folder / "stopped.txt").write_text(res.stderr.strip().splitlines()[-1] + "\n")


def row(name: str, target: float, folder: Path) -> str | None:
    stopped = record(folder, "stopped.txt")
    if stopped is not None:
        return f"| {name} | {target} | {stopped} |"
    ev = record(folder, "eval.json")
    if ev is None:
        return None
    merged = sum(layer["merged"] for layer in ev["per_layer"])
    pruned = sum(layer["pruned"] for layer in ev["per_layer"])
    early = sum(layer["merged"] + layer["pruned"] for layer in ev["per_layer"][:4])
    return (f"| {name} | {target} | {ev['r_flops']:.3f} ({ev['r_flops'] - target:+.3f}) | {ev['top1']:.2f} | "
            f"{merged:.1f} / {pruned:.1f} | {early / (merged + pruned):.0%} |")


#: studies whose variants are compared, image by image on the same held-out images, with a baseline variant
BASELINE = {"beyond": "secant-adam"}


def paired(folder: Path, base: Path, name: str = "eval.json") -> str:
    """top-1 difference to the baseline run and the exact McNemar p on the same images (``name``: the held-out
    ``eval.json`` or the test set's ``test.json``)."""
    from ltmp.significance import mcnemar

    a, b = record(folder, name), record(base, name)
    if a is None or b is None:
        return "-"
    return f"{a['top1'] - b['top1']:+.2f} (p={mcnemar(a['correct'], b['correct'])['p_value']:.2g})"


def test_once(runs: Path, study: str) -> str:
    """The study's variants and its baseline on the 10,000 test images (``ltmp eval``, kept as ``test.json`` in
    each run folder, so each is evaluated once), paired with the baseline."""
    from common import run

    targets, variants = STUDIES[study]
    base = BASELINE[study]
    lines = [f"### {study}: test set (10,000 images)", "", f"| variant | r_target | test r_FLOPs | test top-1 | "
             f"top-1 - {base} (p) |", "|---|---|---|---|---|"]
    for target in targets:
        for name in (base, *variants):
            folder = runs / f"{name}-r{target}"
            if SAVED is None and (folder / "thresholds.safetensors").exists() and not (folder / "test.json").exists():
                run(["eval", "--model", MODEL, "--pretrained", "--data-dir", DATA, "--val-split", "test",
                     "--thresholds", str(folder / "thresholds.safetensors"), "--json", str(folder / "test.json")])
            ev = record(folder, "test.json")
            if ev is None:
                continue
            vs = "-" if name == base else paired(folder, runs / f"{base}-r{target}", "test.json")
            lines.append(f"| {name} | {target} | {ev['r_flops']:.3f} | {ev['top1']:.2f} | {vs} |")
    return "\n".join(lines)


def table(runs: Path, study: str) -> str:
    targets, variants = STUDIES[study]
    base = BASELINE.get(study)
    lines = [f"### {study}", "", "| variant | r_target | held-out r_FLOPs (miss) | held-out top-1 | merged / pruned "
             "per image | share in blocks 1-4 |" + (f" top-1 - {base} (p) |" if base else ""),
             "|---|---|---|---|---|---|" + ("---|" if base else "")]
    for name in variants:
        for target in targets:
            line = row(name, target, runs / f"{name}-r{target}")
            if line:
                if base:
                    line += f" {paired(runs / f'{name}-r{target}', runs / f'{base}-r{target}')} |"
                lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", nargs="+", choices=sorted(STUDIES))
    ap.add_argument("--runs", default=str(ROOT / "runs" / "study"))
    ap.add_argument("--table", action="store_true", help="only print the tables of finished runs")
    ap.add_argument("--render", action="store_true", help=f"print the tables from {RAW.relative_to(ROOT)} alone")
    ap.add_argument("--test", action="store_true", help="then evaluate the study's variants and baseline on the "
                    "test set, once (studies with a baseline: " + ", ".join(BASELINE) + ")")
    args = ap.parse_args(argv)
    global SAVED
    saved = json.loads(RAW.read_text()) if RAW.exists() else {}
    if args.render:
        SAVED = saved
    runs = Path(args.runs)
    for study in args.studies:
        targets, variants = STUDIES[study]
        if not (args.table or args.render):
            for target in targets:  # every variant at one target before the next: partial results still pair up
                for name, extra in variants.items():
                    train(runs / f"{name}-r{target}", target, extra)
        print(table(runs, study) + "\n", flush=True)
        if args.test and study in BASELINE:
            print(test_once(runs, study) + "\n", flush=True)
    if SAVED is None and KEPT:
        from ltmp.thresholds import atomic_write

        merged = dict(sorted({**saved, **KEPT}.items()))
        atomic_write(RAW, lambda tmp: Path(tmp).write_text(json.dumps(merged, indent=0) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
