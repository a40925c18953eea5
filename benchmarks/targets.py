"""Issue #17's speed targets in one short run: time ratios to the dense model, measured in the same rounds.

For each shape (``deit-s``, ``vit-b``: random weights, bundled CIFAR-10 test images upsampled to 224) and each
setting (``fp32:32`` = fp32 at batch 32, ``bf16:256`` = bf16 autocast at batch 256): LTMP with thresholds calibrated
to r_FLOPs 0.5 (``common.calibrated``), ToMe and top-k pruning at LTMP's mean GMACs on the same batch
(``common.at_gmacs``), and, with ``--tome-ref DIR`` (a checkout of facebookresearch/ToMe, not part of ltmp), the
reference ToMe's own timm patch with the same per-layer r. Each in eager mode and, per ``--modes``, under
``ltmp.runtime.compile_model`` (CUDA graphs for dense and fixed rates on CUDA). Time ratios are paired round by
round (``ltmp.bench.paired_ratio``). Targets (issue #17, point 6): ToMe <= 0.60 (ViT-B bf16 <= 0.55), LTMP <= 0.70,
top-k within 0.05 of ToMe; on the CPU, DeiT-S fp32 batch 32 LTMP >= 1.8x dense throughput (ratio <= 0.556).

Rows are printed and written to ``--json`` as they finish (atomically), most important first, and the run stops
starting new rows after ``--budget`` seconds, so a GPU lent for minutes returns what it finished.

    python benchmarks/targets.py --device cuda --json results/targets-cuda.json --tome-ref /path/to/ToMe
    python benchmarks/targets.py --device cpu --models deit-s --settings fp32:32 --modes eager   # the CPU target
    python benchmarks/targets.py --quick                                                         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import timm
import torch

import ltmp
from common import at_gmacs, calibrated, device_name, load_images, load_model, mean_gmacs, reference_tome
from ltmp.bench import compare_models, paired_ratio
from ltmp.runtime import compile_model, pick_device
from ltmp.thresholds import atomic_write

TARGETS = {"tome": 0.60, "ltmp": 0.70}


def row_for(name: str, dense, red, setting: str, mode: str, args, device) -> dict:
    dtype, batch = setting.split(":")
    amp = dtype == "bf16"
    x = load_images(dense, "test", int(batch)).to(device)
    spec = ltmp.vit_spec(dense)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        g = mean_gmacs(red, x)
        rec = ltmp.stats(red)
        models = {
            "dense": dense,
            "ltmp": red,
            "tome": at_gmacs(dense, "tome", g),
            "topk-prune": at_gmacs(dense, "topk-prune", g),
        }
        models["tome"].to(device), models["topk-prune"].to(device)
        if args.tome_ref:
            models["tome-ref"] = reference_tome(dense, args.tome_ref, models["tome"].ltmp_config.rate).to(device)
        gmacs = {k: g if k == "ltmp" else mean_gmacs(m, x) for k, m in models.items() if k not in ("dense", "tome-ref")}
        if mode == "compile":
            models = {k: (compile_model(m, device) if k != "tome-ref" else torch.compile(m)) for k, m in models.items()}
        t0 = time.perf_counter()
        timed = compare_models(models, x, warmup=args.warmup, reps=args.reps, rounds=args.rounds)
    ratios = {k: paired_ratio(timed, k, "dense") for k in models if k != "dense"}
    return {
        "model": name,
        "setting": setting,
        "mode": mode,
        "batch": int(batch),
        "dense_ms": 1000 * timed["dense"]["median"],
        "seconds": time.perf_counter() - t0,
        "gmacs_ratio": {k: v / ltmp.dense_gmacs(spec) for k, v in gmacs.items()},
        # every layer at the batch's padded length: an upper bound (token-wise layers run packed)
        "executed_gmacs_ratio": ltmp.gmacs_executed(spec, rec.padded) / ltmp.dense_gmacs(spec),
        "time_ratio": {k: v["median"] for k, v in ratios.items()},
        "time_ratio_iqr": {k: [v["p25"], v["p75"]] for k, v in ratios.items()},
    }


def verdict(row: dict) -> str:
    t = row["time_ratio"]
    tome_target = 0.55 if (row["model"] == "vit-b" and row["setting"].startswith("bf16")) else TARGETS["tome"]
    parts = [
        f"ToMe {t['tome']:.3f} (<= {tome_target}: {'met' if t['tome'] <= tome_target else 'missed'})",
        f"LTMP {t['ltmp']:.3f} (<= {TARGETS['ltmp']}: {'met' if t['ltmp'] <= TARGETS['ltmp'] else 'missed'})",
        f"top-k {t['topk-prune']:.3f} (within 0.05 of ToMe: "
        f"{'met' if abs(t['topk-prune'] - t['tome']) <= 0.05 else 'missed'})",
    ]
    if "tome-ref" in t:
        parts.append(f"reference ToMe {t['tome-ref']:.3f}")
    if row.get("device") == "cpu" and row["model"] == "deit-s" and row["setting"] == "fp32:32":
        lo, hi = row["time_ratio_iqr"]["ltmp"]
        parts.append(
            f"CPU target LTMP >= 1.8x throughput: {1 / t['ltmp']:.2f}x "
            f"(quartiles {1 / hi:.2f}-{1 / lo:.2f}x), {'met' if t['ltmp'] <= 1 / 1.8 else 'missed'}"
        )
    return "; ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="deit-s,vit-b")
    p.add_argument("--settings", default="fp32:32,bf16:256", help="dtype:batch, comma-separated")
    p.add_argument("--modes", default="eager,compile", help="eager and/or compile")
    p.add_argument("--device", default="auto")
    p.add_argument("--tome-ref", help="a checkout of facebookresearch/ToMe to time its own timm patch beside ours")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=480, help="start no new row after this many seconds")
    p.add_argument("--json", default="results/targets.json")
    p.add_argument("--quick", action="store_true", help="smoke run: the CIFAR ViT, fp32 batch 8, 1 round")
    args = p.parse_args()
    if args.quick:
        args.models, args.settings, args.warmup, args.reps, args.rounds = "cifar", "fp32:8", 1, 1, 1
    device = pick_device(args.device)
    start = time.monotonic()
    name = device_name(device)
    out = {
        "command": "python benchmarks/targets.py " + " ".join(sys.argv[1:]),
        "env": {"device_name": name, "torch": torch.__version__, "timm": timm.__version__},
        "rows": [],
    }
    print(f"{name}, torch {torch.__version__}, timm {timm.__version__}")
    # most important first: eager before compiled, then settings and shapes in the order given
    for mode in args.modes.split(","):
        for model_name in args.models.split(","):
            if time.monotonic() - start > args.budget:
                print(f"budget of {args.budget:.0f} s spent: skipping {model_name} {mode}")
                continue
            dense = load_model(model_name).to(device).eval()
            red, r = calibrated(dense, 0.5, device)
            for setting in args.settings.split(","):
                if time.monotonic() - start > args.budget:
                    print(f"budget of {args.budget:.0f} s spent: skipping {model_name} {setting} {mode}")
                    continue
                row = row_for(model_name, dense, red, setting, mode, args, device)
                row["r_calibrated"], row["device"] = r, device.type
                out["rows"].append(row)
                atomic_write(args.json, lambda tmp: Path(tmp).write_text(json.dumps(out, indent=1)))
                print(
                    f"{model_name} {setting} {mode}: dense {row['dense_ms']:.1f} ms; LTMP GMACs ratio "
                    f"{row['gmacs_ratio']['ltmp']:.3f} (at padded length {row['executed_gmacs_ratio']:.3f}); "
                    + verdict(row),
                    flush=True,
                )
    print(f"wrote {args.json} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
