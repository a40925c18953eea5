"""Held-out training studies of issues #16 and #36: which eq. 6 mask-gradient form, which procedure, and which
way of meeting the budget trains best.

Each run is one ``ltmp train`` of the CIFAR-10 ViT (``../shared``): batch 128, tau 0.1, lambda 10, light
augmentation, the optimizer each variant names (SGD, Adam or Adam per group). The studies of #16 train for
``STEPS`` steps with 2% of train held out and evaluate on those 1,000 held-out training images; ``allocation``
(#36) trains one epoch with 10% held out and evaluates on those 5,000 images (``SETTINGS``). Never the test set.
Finished runs are kept and skipped, interrupted ones resume, so the script can be stopped and started again:

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
- ``allocation``: LTP and LTMP at r_target 0.5, with the budget as the paper's penalty (Adam, Adam per group, and
  SGD with the paper's learning rates scaled to our steps) and as a projection (``--budget projected``, Adam and
  Adam per group); beside each run, on the same held-out images, its fixed-rate counterpart at the same GMACs
  (even schedule, and the run's own per-layer counts as schedule) and one shared threshold
  (:func:`heldout_baselines`).

Runs go to ``runs/study/<variant>-r<target>``. What the tables use of them (each run's held-out and test
evaluation, or why it stopped) is kept in ``RAW`` (``results/training_study.json``, committed); ``--render``
prints the tables from it alone, without the runs:

    python benchmarks/training_study.py forms optimizer procedure beyond --render --test
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from common import DATA, MODEL, ROOT, compact, p_text, train_run, unpack

RAW = ROOT / "results" / "training_study.json"
SAVED: dict | None = None  # --render: RAW's records; nothing is read from the runs or run
RECORDED: dict = {}  # RAW's records: read for a run whose folder is not on this machine
KEPT: dict[str, object] = {}  # the records this call read from the runs, merged into RAW at the end


def record(folder: Path, name: str) -> dict | str | None:
    """One run's ``eval.json`` / ``test.json`` (compacted; ``correct`` unpacked) or ``stopped.txt`` (with the
    steps its log reached): from RAW when rendering, else from the run folder (and kept for RAW)."""
    key = f"{folder.name}/{name}"
    if SAVED is not None:
        value = SAVED.get(key)
    elif not (folder / name).exists():
        value = RECORDED.get(key)  # a run made elsewhere, or before its folder was removed
        if value is None:
            return None
    elif name == "stopped.txt":
        log = folder / "log.jsonl"  # none when training refused to start
        steps = len(log.read_text().splitlines()) if log.exists() else 0
        value = KEPT[key] = f"stopped at step {steps}: {(folder / name).read_text().strip()}"
    else:
        value = KEPT[key] = compact(json.loads((folder / name).read_text()))
    return dict(value, correct=unpack(value["correct"])) if isinstance(value, dict) else value


STEPS = 100
#: The points of ``ltmp train --recipe paper`` (``ltmp.options.RECIPES["paper"]``): the command-line flags that set
#: each, the methods it applies to, where the reference code (github Mxbonn/ltmp at REFERENCE_COMMIT) does it, our
#: default and why it differs; in the order of docs/training.md's table. Not among them: the hold-out (the
#: reference's 2%; every run of the "recipe" study holds out 10%, 5,000 images, to be measured on).
REFERENCE_COMMIT = "1a9c055"
PAPER_POINTS: dict[str, dict] = {
    "optimizer and learning rates": dict(
        flags=["--optimizer", "sgd", "--lr-merge", "5e-3", "--lr-prune", "5e-6"],
        methods=("ltmp", "ltp"),
        where="tools/train.py:193, 205 (SGD, momentum 0), 697-733 (prune, merge groups); README: --lr 5e-6 5e-3",
        ours="SGD; merge 5e-3 x 9809 / steps, prune in units of the scores' spread",
        why="fixed rates set for 9,809 ImageNet steps move the thresholds 28x less in a CIFAR epoch, and the "
        "ratio 1,000 is not this model's ratio of squared spreads (60)",
    ),
    "merge init": dict(
        flags=["--merge-init", "0.9"],
        methods=("ltmp",),
        where="ltmp/timm/lt_mergeprune.py:51",
        ours="1.0",
        why="training starts from no reduction; with the product of masks a merge threshold at 1 still learns",
    ),
    "label smoothing": dict(
        flags=["--label-smoothing", "0.1"],
        methods=("ltmp", "ltp"),
        where="tools/train.py:411, 937-941 (timm)",
        ours="0",
        why="the paper's loss is cross-entropy (eq. 15)",
    ),
    "masked softmax": dict(
        flags=["--mask-grad", "reference"],
        methods=("ltmp", "ltp"),
        where="ltmp/timm/threshold_masking.py:23-33 (eps 1e-5 over and under, max over every key; autograd)",
        ours="secant (eval's forward)",
        why="the train forward is eval's (removed keys left out) and the mask gradient is bounded by 1; the "
        "reference's is bounded by 1e5, and where a removed key dominates a row its forward spreads attention back "
        "onto removed keys (benchmarks/reference_seeds.py --parity)",
    ),
    "merged averages": dict(
        flags=["--merge-grad", "mask"],
        methods=("ltmp",),
        where="ltmp/timm/lt_mergeprune.py:79-80 (detached)",
        ours="average",
        why="the merge mask weighs the merged averages, so they teach the merge threshold too",
    ),
    "two modules": dict(
        flags=["--combine", "overwrite"],
        methods=("ltmp",),
        where="ltmp/timm/lt_mergeprune.py:98-99",
        ours="product",
        why="the overwrite drops the merge gradient of every unmerged set-A token",
    ),
    "importance rows": dict(
        flags=["--importance-rows", "all"],
        methods=("ltmp", "ltp"),
        where="ltmp/timm/lt_mergeprune.py:128",
        ours="surviving rows",
        why="eval has only the survivors: the preset's train and eval then differ",
    ),
    "token order": dict(
        flags=["--train-order", "reference"],
        methods=("ltmp",),
        where="ltmp/timm/lt_mergeprune.py:61-64, 91-96",
        ours="positions, A/B over survivors",
        why="as eval: the preset's train and eval then differ",
    ),
    "budget tokens": dict(
        flags=["--budget-tokens", "all"],
        methods=("ltmp", "ltp"),
        where="tools/train.py:1143-1148",
        ours="patch tokens",
        why="the paper's footnote leaves the class token out of n",
    ),
    "budget pool": dict(
        flags=["--budget-pool", "batch"],
        methods=("ltmp", "ltp"),
        where="tools/train.py:1144",
        ours="per image",
        why="eq. 13 is per image; its attention term is quadratic in the kept fraction",
    ),
    "threshold range": dict(
        flags=["--clamp", "unit"],
        methods=("ltmp",),
        where="tools/train.py:1171-1175",
        ours="merge [-1, 1]",
        why="cosine similarities can be negative",
    ),
    "augmentation": dict(
        flags=["--augment", "timm-random"],
        methods=("ltmp", "ltp"),
        where="tools/train.py:336-348, 415",
        ours="timm's, model's interpolation",
        why="the model's own data config",
    ),
    "settle": dict(
        flags=["--no-settle"],
        methods=("ltmp", "ltp"),
        where="none",
        ours="on",
        why="thresholds trained on augmented images miss the budget on clean ones",
    ),
    "collapse stop": dict(
        flags=["--no-stop-collapsed"],
        methods=("ltmp", "ltp"),
        where="none (tools/train.py trains every step)",
        ours="stop after 10 steps of a block that removes every patch token",
        why="a collapsed block's thresholds get little gradient, so the run is likely lost (the reference's blocks "
        "came back after tens of steps at 10x its scaled rate: benchmarks/reference_seeds.py)",
    ),
    "first-step check": dict(
        flags=["--no-check-first-step"],
        methods=("ltmp", "ltp"),
        where="none (tools/train.py takes every step)",
        ours="SGD: refuse a first step that moves a threshold by more than its scores' range",
        why="past the range every score falls on one side and the surrogate gradient (eq. 2) vanishes: the block "
        "learns little more",
    ),
}
PAPER = ["--optimizer", "sgd", "--lr-merge", "5e-3", "--lr-prune", "5e-6", "--merge-init", "0.9"]  # the paper's
RECIPE = ["--optimizer", "sgd", "--lr-merge", "5e-3", "--lr-prune", "3e-4", "--merge-init", "1.0"]  # reproduce.py
#: Adam: steps of about lr per step in each threshold's own units, 10x smaller for importance (about 1/65 here)
#: than for cosine similarities; from no reduction (merge 1.0, prune 0)
ADAM = ["--optimizer", "adam", "--lr-merge", "2e-3", "--lr-prune", "2e-4", "--merge-init", "1.0"]


def recipe_variants(method: str) -> dict[str, list[str]]:
    """The "recipe" study's runs of one method: ``paper`` (every point of the paper's recipe: what ``--recipe
    paper`` sets) and ``default-<point>`` (that one point at the default), as flags of ``ltmp train``."""
    points = {k: p["flags"] for k, p in PAPER_POINTS.items() if method in p["methods"]}
    out = {"paper": [f for flags in points.values() for f in flags]}
    for name in points:
        out["default-" + name.replace(" ", "-")] = [f for k, flags in points.items() if k != name for f in flags]
    return out


STUDIES: dict[str, tuple[tuple[float, ...], dict[str, list[str]]]] = {
    "forms": (
        (0.7, 0.5),
        {
            "eps-mask-paper": ["--mask-grad", "eps", "--merge-grad", "mask", *PAPER],  # the reference code's signal
            "clamp-paper": ["--mask-grad", "clamp", *PAPER],
            "eps-mask-recipe": ["--mask-grad", "eps", "--merge-grad", "mask", *RECIPE],
            "clamp-recipe": ["--mask-grad", "clamp", *RECIPE],
            "secant-recipe": ["--mask-grad", "secant", *RECIPE],
        },
    ),
    "optimizer": (
        (0.7,),
        {
            "secant-adam": ["--mask-grad", "secant", *ADAM],
            "secant-adam-constraint": ["--mask-grad", "secant", *ADAM, "--budget", "constraint"],
        },
    ),
    "procedure": (
        (0.85, 0.75, 0.65, 0.55, 0.45, 0.7, 0.5),
        {
            "secant-paper": ["--mask-grad", "secant", *PAPER],
            "secant-adam": ["--mask-grad", "secant", *ADAM],
        },
    ),
    "beyond": (
        (0.7, 0.5),
        {  # point 4 of #16, against secant-adam of "procedure"
            "secant-adam-distill": ["--mask-grad", "secant", *ADAM, "--distill", "1"],
            "secant-adam-calibrate": ["--mask-grad", "secant", *ADAM, "--calibrate"],
        },
    ),
    "allocation": (
        (0.5,),
        {  # issue #36: which procedure lets the task loss decide where to reduce
            f"{method}-{name}": ["--method", method, *extra]
            for method in ("ltp", "ltmp")
            for name, extra in {
                "adam-penalty": ["--optimizer", "adam", "--budget", "penalty"],  # the defaults before #36
                # the paper's SGD with its learning rates scaled from ~10,000 ImageNet steps to our 351
                "sgd-penalty": [
                    "--optimizer",
                    "sgd",
                    "--lr-merge",
                    "0.14",
                    "--lr-prune",
                    "1.4e-4",
                    "--merge-init",
                    "1.0",
                ],
                "group-penalty": ["--optimizer", "group", "--budget", "penalty"],
                "adam-projected": ["--optimizer", "adam", "--budget", "projected"],
                "group-projected": ["--optimizer", "group", "--budget", "projected"],
            }.items()
        },
    ),
    "spread": (
        (0.5,),
        {  # SGD whose prune thresholds step in units of their scores' spread, against the
            # defaults before it: for LTMP SGD at the paper's ratio of learning rates, for LTP Adam
            f"{method}-{name}-s{seed}": ["--method", method, "--seed", str(seed), *extra]
            for seed in range(3)
            for method, name, extra in (
                ("ltmp", "spread", []),  # SGD, lr_prune = lr_merge (spread_prune / spread_merge)^2
                ("ltmp", "paper-ratio", ["--lr-prune", "1.3978e-4"]),  # the paper's 5e-6 scaled to 351 steps
                ("ltp", "spread", ["--optimizer", "sgd"]),
                ("ltp", "adam", ["--optimizer", "adam"]),
            )
        },
    ),
    "recipe": (
        (0.5,),
        {  # issue #52: the paper's recipe, and each of its points switched to the default
            f"{method}-{name}": ["--method", method, *flags]
            for method in ("ltmp", "ltp")
            for name, flags in recipe_variants(method).items()
        },
    ),
}

#: How each study trains (besides its variants' flags). The studies of #16 measured training alone for 100 steps
#: on 1,000 held-out images; "allocation" runs the whole default procedure (one epoch, settled on clean held-out
#: images) and holds out 5,000 images, so that differences of about 1.5 points are resolved.
SETTINGS = {
    "allocation": ["--holdout", "0.1", "--augment", "light", "--checkpoint-every", "25"],
    "spread": ["--holdout", "0.1", "--checkpoint-every", "25"],  # ltmp train's defaults otherwise
    "recipe": ["--holdout", "0.1", "--checkpoint-every", "25"],
}
#: studies evaluated beside their fixed-rate counterparts (and a shared threshold) on 5,000 held-out images
HELDOUT = ("allocation", "spread", "recipe")
DEFAULT_SETTINGS = [
    "--steps",
    str(STEPS),
    "--augment",
    "light",
    "--holdout",
    "0.02",
    "--checkpoint-every",
    "10",
    "--no-settle",
]  # training alone, as measured


def train(folder: Path, target: float, extra: list[str], settings: list[str]) -> None:
    """One study run by :func:`common.train_run`; finished when ``ltmp train`` wrote its held-out ``eval.json``."""
    train_run(
        folder,
        ["--model", MODEL, "--pretrained", "--data-dir", DATA, "--r-target", str(target)] + settings + extra,
        "eval.json",
    )


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
    return (
        f"| {name} | {target} | {ev['r_flops']:.3f} ({ev['r_flops'] - target:+.3f}) | {ev['top1']:.2f} | "
        f"{merged:.1f} / {pruned:.1f} | {early / (merged + pruned):.0%} |"
    )


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
    lines = [
        f"### {study}: test set (10,000 images)",
        "",
        f"| variant | r_target | test r_FLOPs | test top-1 | top-1 - {base} (p) |",
        "|---|---|---|---|---|",
    ]
    for target in targets:
        for name in (base, *variants):
            folder = runs / f"{name}-r{target}"
            if SAVED is None and (folder / "thresholds.safetensors").exists() and not (folder / "test.json").exists():
                run(
                    [
                        "eval",
                        "--model",
                        MODEL,
                        "--pretrained",
                        "--data-dir",
                        DATA,
                        "--val-split",
                        "test",
                        "--thresholds",
                        str(folder / "thresholds.safetensors"),
                        "--json",
                        str(folder / "test.json"),
                    ]
                )
            ev = record(folder, "test.json")
            if ev is None:
                continue
            vs = "-" if name == base else paired(folder, runs / f"{base}-r{target}", "test.json")
            lines.append(f"| {name} | {target} | {ev['r_flops']:.3f} | {ev['top1']:.2f} | {vs} |")
    return "\n".join(lines)


def table(runs: Path, study: str) -> str:
    targets, variants = STUDIES[study]
    base = BASELINE.get(study)
    lines = [
        f"### {study}",
        "",
        "| variant | r_target | held-out r_FLOPs (miss) | held-out top-1 | merged / pruned "
        "per image | share in blocks 1-4 |" + (f" top-1 - {base} (p) |" if base else ""),
        "|---|---|---|---|---|---|" + ("---|" if base else ""),
    ]
    for name in variants:
        for target in targets:
            line = row(name, target, runs / f"{name}-r{target}")
            if line:
                if base:
                    line += f" {paired(runs / f'{name}-r{target}', runs / f'{base}-r{target}')} |"
                lines.append(line)
    return "\n".join(lines)


FIXED = {"ltp": "topk-prune", "ltmp": "tome"}  # the fixed-rate counterpart of a learned method (Table 5)


def heldout_baselines(folder: Path, method: str, kinds: tuple[str, ...] = ("even", "schedule", "shared")) -> None:
    """Held-out evaluations beside one run of the "allocation" study, on the same 5,000 held-out images, each kept
    as a JSON file in the run folder: the fixed-rate counterpart at the run's GMACs with an even schedule
    (``heldout-even.json``) and with the run's own mean tokens removed per layer as its schedule
    (``heldout-schedule.json``: the same allocation without per-image adaptivity, issue #36 point 3), and one
    shared threshold bisected to the run's r_FLOPs on the images it settled on (``heldout-shared.json``)."""
    import copy

    from torch.utils.data import DataLoader, Subset

    import ltmp
    from ltmp import data as ldata
    from ltmp.analysis import image_batch
    from ltmp.calibrate import calibrate
    from ltmp.evaluate import evaluate
    from ltmp.flops import rate_schedule
    from ltmp.runtime import create_model
    from ltmp.thresholds import atomic_write

    names = tuple(f"heldout-{k}.json" for k in kinds)
    ev_path = folder / "eval.json"
    if not ev_path.exists() or all((folder / n).exists() for n in names):
        return
    ev = json.loads(ev_path.read_text())
    cfg = json.loads((folder / "config.json").read_text())
    dense = create_model(MODEL, True, None)
    root = ldata.resolve_root(DATA)
    _, eval_tf, _ = ldata.transforms_for(dense, "none")
    full = ldata.ImageFolder(ldata.split_dir(root, "train"), eval_tf)
    _, held = ldata.holdout_split(len(full), cfg["holdout"])
    loader = DataLoader(Subset(full, held), batch_size=128, num_workers=2, collate_fn=ldata.collate_skip)
    spec = ltmp.vit_spec(dense)
    removed = [layer["merged"] + layer["pruned"] for layer in ev["per_layer"]]
    fixed = FIXED[method]
    for name, shape in (("heldout-even.json", None), ("heldout-schedule.json", removed)):
        if name in names and not (folder / name).exists():
            sched = rate_schedule(spec, ev["gmacs"], fixed, shape)
            model = ltmp.patch(copy.deepcopy(dense), fixed, **{"r" if fixed == "tome" else "k": sched})
            res = evaluate(model, loader, progress=False, model_name=MODEL)
            atomic_write(folder / name, lambda tmp, res=res: Path(tmp).write_text(json.dumps(res)))
    if "heldout-shared.json" in names and not (folder / "heldout-shared.json").exists():
        # bisected on the 1,024 held-out images training settled on
        model = ltmp.patch(copy.deepcopy(dense), method, merge_threshold=1.0, prune_threshold=0.0)
        calibrate(model, image_batch(Subset(full, held), 1024), ev["r_flops"])
        res = evaluate(model, loader, progress=False, model_name=MODEL)
        atomic_write(folder / "heldout-shared.json", lambda tmp: Path(tmp).write_text(json.dumps(res)))


def allocation_table(runs: Path, study: str = "allocation") -> str:
    """A held-out study ("allocation", "spread"): each procedure on the held-out images, beside its fixed-rate
    counterpart (even schedule, and the run's own schedule) and one shared threshold, paired image by image."""
    from ltmp.significance import mcnemar

    targets, variants = STUDIES[study]
    lines = [
        f"### {study}",
        "",
        "| variant | r_target | held-out r_FLOPs | GMACs ratio | held-out top-1 | merged / "
        "pruned per image | reallocated vs shared | - fixed rate, even (p) | - fixed rate, own schedule (p) | "
        "- shared threshold (p) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for target in targets:
        for name in variants:
            folder = runs / f"{name}-r{target}"
            stopped = record(folder, "stopped.txt")
            if stopped is not None:
                lines.append(f"| {name} | {target} | {stopped} |")
                continue
            ev = record(folder, "eval.json")
            if ev is None:
                continue
            alloc = ev.get("allocation")
            cells = []
            for other in ("heldout-even.json", "heldout-schedule.json", "heldout-shared.json"):
                b = record(folder, other)
                cells.append(
                    "-"
                    if b is None
                    else f"{ev['top1'] - b['top1']:+.2f} ({b['top1']:.2f}, "
                    f"p={mcnemar(ev['correct'], b['correct'])['p_value']:.2g})"
                )
            merged = sum(layer["merged"] for layer in ev["per_layer"])
            pruned = sum(layer["pruned"] for layer in ev["per_layer"])
            realloc = "-" if alloc is None else f"{100 * alloc['reallocated']:.0f}%"
            lines.append(
                f"| {name} | {target} | {ev['r_flops']:.3f} | {ev['gmacs'] / ev['gmacs_dense']:.3f} | "
                f"{ev['top1']:.2f} | {merged:.1f} / {pruned:.1f} | {realloc} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def spread_comparison(runs: Path) -> str:
    """The "spread" study's verdicts: each variant's gap over its fixed-rate counterpart at its own GMACs (even
    schedule: ToMe for LTMP, top-k pruning for LTP), averaged over its seeds image by image, and for each method the
    difference of the two variants' gaps with the image as the unit (:func:`ltmp.significance.image_test`)."""
    from ltmp.significance import image_test

    (target,), variants = STUDIES["spread"]
    runs_of: dict[str, list] = {}
    for name in variants:
        folder = runs / f"{name}-r{target}"
        ev, base = record(folder, "eval.json"), record(folder, "heldout-even.json")
        if isinstance(ev, dict) and isinstance(base, dict):
            runs_of.setdefault(name.rsplit("-s", 1)[0], []).append((ev, base))
    lines = [
        "| variant | seeds | held-out top-1 | r_FLOPs | merged / pruned per image | - fixed rate at own GMACs, "
        "95% CI, p |",
        "|---|---|---|---|---|---|",
    ]
    terms = {}
    for variant, pairs in runs_of.items():
        terms[variant] = [(1.0, [e["correct"] for e, _ in pairs]), (-1.0, [b["correct"] for _, b in pairs])]
        t = image_test(terms[variant])
        mean = {
            k: sum(f(e) for e, _ in pairs) / len(pairs)
            for k, f in (
                ("top1", lambda e: e["top1"]),
                ("r", lambda e: e["r_flops"]),
                ("merged", lambda e: sum(layer["merged"] for layer in e["per_layer"])),
                ("pruned", lambda e: sum(layer["pruned"] for layer in e["per_layer"])),
            )
        }
        lines.append(
            f"| {variant} | {len(pairs)} | {mean['top1']:.2f} | {mean['r']:.3f} | {mean['merged']:.1f} / "
            f"{mean['pruned']:.1f} | {t['diff']:+.2f} ({t['ci'][0]:+.2f} to {t['ci'][1]:+.2f}), "
            f"p={t['p_value']:.2g} |"
        )
    for a, b in (("ltmp-spread", "ltmp-paper-ratio"), ("ltp-spread", "ltp-adam")):
        if a in terms and b in terms:
            t = image_test(terms[a] + [(-w, c) for w, c in terms[b]])
            lines.append(
                f"\n{a} - {b}, gaps over the fixed rate: {t['diff']:+.2f} points (95% CI {t['ci'][0]:+.2f} "
                f"to {t['ci'][1]:+.2f}), p = {t['p_value']:.2g}, {t['images']} held-out images as the unit"
            )
    return "\n".join(lines)


def recipe_table(runs: Path) -> str:
    """docs/training.md's table of the paper's recipe: each point, where the reference does it, our default and why,
    and the measured effect of switching that one point from the paper's recipe to the default: the change of the
    run's gap over its fixed-rate counterpart at its own GMACs (ToMe for LTMP, top-k pruning for LTP, even
    schedule), on the 5,000 held-out images with the image as the unit, Holm-adjusted over the table."""
    from ltmp.significance import holm, image_test

    (target,), _ = STUDIES["recipe"]

    def gap(name: str) -> tuple[dict, list] | str | None:  # the run's record and its gap's image-test terms
        folder = runs / f"{name}-r{target}"
        stopped = record(folder, "stopped.txt")
        if isinstance(stopped, str):  # why training stopped, or refused to start
            return stopped
        ev, base = record(folder, "eval.json"), record(folder, "heldout-even.json")
        if not (isinstance(ev, dict) and isinstance(base, dict)):
            return None
        return ev, [(1.0, [ev["correct"]]), (-1.0, [base["correct"]])]

    def run_cells(ev: dict) -> str:
        merged = sum(layer["merged"] for layer in ev["per_layer"])
        pruned = sum(layer["pruned"] for layer in ev["per_layer"])
        return f"{ev['top1']:.2f}, r {ev['r_flops']:.3f}, {merged:.1f} / {pruned:.1f}"

    tests, cells = [], {}
    presets = {m: gap(f"{m}-paper") for m in ("ltmp", "ltp")}
    for point, p in PAPER_POINTS.items():
        for m in ("ltmp", "ltp"):
            flip = gap(f"{m}-default-{point.replace(' ', '-')}") if m in p["methods"] else None
            if m not in p["methods"]:
                cells[point, m] = "n/a"
            elif isinstance(flip, str):
                cells[point, m] = flip
            elif not isinstance(flip, tuple) or not isinstance(presets[m], tuple):
                cells[point, m] = "pending"
            else:
                t = image_test(flip[1] + [(-w, c) for w, c in presets[m][1]])
                tests.append((point, m, t, flip[0]))
    adjusted = holm([t["p_value"] for _, _, t, _ in tests])
    for (point, m, t, ev), p_holm in zip(tests, adjusted):
        cells[point, m] = (
            f"{t['diff']:+.2f} ({t['ci'][0]:+.2f} to {t['ci'][1]:+.2f}), Holm p {p_text(p_holm)}; {run_cells(ev)}"
        )
    lines = [
        f"Paper's recipe, r_target {target} (held-out top-1, r_FLOPs, merged / pruned per image): "
        + "; ".join(
            f"{m.upper()} " + (run_cells(presets[m][0]) if isinstance(presets[m], tuple) else presets[m] or "pending")
            for m in ("ltmp", "ltp")
        ),
        "",
        f"| point | reference ({REFERENCE_COMMIT}) | default | why | LTMP: effect of the default (95% CI), "
        "held-out top-1, r_FLOPs, merged / pruned | LTP: the same |",
        "|---|---|---|---|---|---|",
    ]
    for point, p in PAPER_POINTS.items():
        paper = " ".join(p["flags"])
        lines.append(
            f"| {point} (`{paper}`) | {p['where']} | {p['ours']} | {p['why']} | {cells[point, 'ltmp']} | "
            f"{cells[point, 'ltp']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", nargs="+", choices=sorted(STUDIES))
    ap.add_argument("--runs", default=str(ROOT / "runs" / "study"))
    ap.add_argument("--table", action="store_true", help="only print the tables of finished runs")
    ap.add_argument("--render", action="store_true", help=f"print the tables from {RAW.relative_to(ROOT)} alone")
    ap.add_argument(
        "--test",
        action="store_true",
        help="then evaluate the study's variants and baseline on the "
        "test set, once (studies with a baseline: " + ", ".join(BASELINE) + ")",
    )
    ap.add_argument("--match", default="", help="train only the variants whose names match this regex, e.g. 's[12]$'")
    args = ap.parse_args(argv)
    global SAVED, RECORDED
    saved = json.loads(RAW.read_text()) if RAW.exists() else {}
    RECORDED = saved
    if args.render:
        SAVED = saved
    runs = Path(args.runs)
    for study in args.studies:
        targets, variants = STUDIES[study]
        if not (args.table or args.render):
            for target in targets:  # every variant at one target before the next: partial results still pair up
                for name, extra in variants.items():
                    if not re.search(args.match, name) or RECORDED.get(f"{name}-r{target}/eval.json"):
                        continue
                    train(runs / f"{name}-r{target}", target, extra, SETTINGS.get(study, DEFAULT_SETTINGS))
                    if study in HELDOUT:
                        heldout_baselines(
                            runs / f"{name}-r{target}",
                            extra[extra.index("--method") + 1],
                            ("even",) if study == "recipe" else ("even", "schedule", "shared"),
                        )
        if study == "recipe":
            print(recipe_table(runs) + "\n", flush=True)
        else:
            print((allocation_table(runs, study) if study in HELDOUT else table(runs, study)) + "\n", flush=True)
        if study == "spread":
            print(spread_comparison(runs) + "\n", flush=True)
        if args.test and study in BASELINE:
            print(test_once(runs, study) + "\n", flush=True)
    if SAVED is None and KEPT:
        from ltmp.thresholds import atomic_write

        merged = dict(sorted({**saved, **KEPT}.items()))
        atomic_write(RAW, lambda tmp: Path(tmp).write_text(json.dumps(merged, indent=0) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
