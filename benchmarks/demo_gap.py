"""Does the demo's LTMP/ToMe comparison agree with the full test set? (issue #36, point 5)

``ltmp demo`` trains LTMP on the bundled 4,000-image subset (2 epochs of batch 32 from a calibrated start, settled on
training images) and compares it with ToMe at the same GMACs on the bundled 1,000 test images. This script trains
the demo's recipe and variants of it on the bundled model, and evaluates each, and ToMe at its GMACs, on those
1,000 images and on all 10,000 CIFAR-10 test images (``../shared``):

- ``demo``: the demo's recipe (``ltmp.demo.DemoConfig``'s training settings);
- ``demo-adam``: the same with Adam, the default before issue #36;
- ``no-calibrate``: without the calibrated start;
- ``holdout``: settled on 10% of the subset held out instead of on training images;
- ``full``: one epoch of the whole CIFAR-10 train split at batch 128 (the recipe the 10,000-image results use).

    python benchmarks/demo_gap.py [--runs runs/demo-gap] [VARIANT ...]

Finished runs and evaluations are kept under ``--runs`` and reused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import DATA, ROOT, run
from ltmp.demo import BUNDLED_DATA, BUNDLED_MODEL, DemoConfig

DEMO = DemoConfig()
BASE = ["--batch-size", str(DEMO.batch_size), "--epochs", str(DEMO.epochs), "--augment", DEMO.augment]
VARIANTS = {
    "demo": [*BASE, "--calibrate"],
    "demo-adam": [*BASE, "--calibrate", "--optimizer", "adam"],
    "no-calibrate": BASE,
    "holdout": [*BASE, "--calibrate", "--holdout", "0.1"],
    "full": ["--data-dir", DATA, "--augment", DEMO.augment],
}
SPLITS = {"1k": BUNDLED_DATA, "10k": DATA}  # the demo's test images, and all of CIFAR-10's


def evaluate(folder: Path, tag: str, data: str) -> tuple[dict, dict]:
    """The run's thresholds and ToMe at their GMACs on one test set (paired McNemar test), kept as JSON."""
    mine, tome = folder / f"eval-{tag}.json", folder / f"tome-{tag}.json"
    common = ["--model", BUNDLED_MODEL, "--pretrained", "--data-dir", data, "--val-split", "test"]
    if not mine.exists():
        run(["eval", *common, "--thresholds", str(folder / "thresholds.safetensors"), "--json", str(mine)])
    if not tome.exists():
        run(["eval", *common, "--method", "tome", "--match", str(mine), "--compare", str(mine), "--json", str(tome)])
    return json.loads(mine.read_text()), json.loads(tome.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", default=list(VARIANTS), help=", ".join(VARIANTS))
    ap.add_argument("--runs", default=str(ROOT / "runs" / "demo-gap"))
    ap.add_argument("--r-target", type=float, default=DEMO.targets[-1])
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant {unknown[0]}; choose from {', '.join(VARIANTS)}")
    rows = [
        "| variant | test images | LTMP r_FLOPs | LTMP top-1 | ToMe top-1 | LTMP - ToMe | McNemar p |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.variants:
        folder = Path(args.runs) / f"{name}-r{args.r_target}"
        flags = VARIANTS[name]
        if not (folder / "thresholds.safetensors").exists():
            data = [] if "--data-dir" in flags else ["--data-dir", BUNDLED_DATA]
            run(
                [
                    "train",
                    "--model",
                    BUNDLED_MODEL,
                    "--pretrained",
                    *data,
                    "--val-split",
                    "test",
                    "--r-target",
                    str(args.r_target),
                    "--output",
                    str(folder),
                    "--no-eval",
                    "--seed",
                    str(DEMO.seed),
                    *flags,
                ]
                + (["--resume"] if folder.exists() else [])
            )
        for tag, data in SPLITS.items():
            a, b = evaluate(folder, tag, data)
            rows.append(
                f"| {name} | {a['images']:,} | {a['r_flops']:.3f} | {a['top1']:.2f} | {b['top1']:.2f} | "
                f"{a['top1'] - b['top1']:+.2f} | {b['paired_test']['p_value']:.2g} |"
            )
        print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
