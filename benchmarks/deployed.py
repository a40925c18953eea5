"""Deployed batch-1 time ratios (issue #39): exported models in a deployment runtime against the dense model exported
the same way, beside eager PyTorch; the paper's latency table is such a measurement (DeiT-S on a Pixel 7).

Rows: the DeiT-S shape (random weights, bundled CIFAR-10 test images upsampled to 224) with LTMP calibrated to
r_FLOPs 0.5 (``common.calibrated``) and ToMe at LTMP's GMACs; the CIFAR-10 ViT with LTMP calibrated to r 0.5 and ToMe
at its GMACs. Each is timed in ONNX Runtime or the ``--runtime`` given (``ltmp.bench.bench_deployed``, the path of
``ltmp bench --deployed RUNTIME``) with 1 and 2 threads, and in eager PyTorch at batch 1
(``ltmp.bench.compare_models``), one image at a time over ``--images`` images, ``--rounds`` interleaved rounds;
``--runs`` times each deployed pair that many times (exported and loaded anew; eager once). Prints ratios with
quartiles over rounds and the targets of issue #39 (LTMP <= GMACs ratio + 0.06, ToMe <= + 0.04); writes ``--json``.

    python benchmarks/deployed.py --json results/deployed.json
    python benchmarks/deployed.py --runtime openvino --runs 1 --json results/deployed-openvino.json
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch

import ltmp
from common import deployed_models
from ltmp.bench import bench_deployed, compare_models, paired_ratio
from ltmp.export import RUNTIMES
from ltmp.thresholds import write_json

#: time ratio <= GMACs ratio + this, per method (issue #39)
TARGET_MARGIN = {"ltmp": 0.06, "tome": 0.04}


def eager_ratio(dense, reduced, images, threads: int, reps: int, rounds: int) -> dict:
    torch.set_num_threads(threads)
    singles = [x[None] for x in images]
    timed = compare_models({"dense": dense, "reduced": reduced}, singles, warmup=2, reps=reps, rounds=rounds)
    r = paired_ratio(timed, "reduced", "dense")
    return {
        "time_ratio": r["median"],
        "time_ratio_iqr": [r["p25"], r["p75"]],
        "dense_ms": 1000 * timed["dense"]["median"] / len(singles),
    }


def print_row(row: dict, runtime: str) -> None:
    run, eager, ops = row["deployed"], row["eager"], row["graph_ops"]
    print(
        f"{row['model']} {row['method']} {row['threads']} thr, run {row['run']}: GMACs ratio "
        f"{row['gmacs_ratio']:.3f}; {runtime} {run['time_ratio']:.3f} (IQR {run['time_ratio_iqr'][0]:.3f}-"
        f"{run['time_ratio_iqr'][1]:.3f}, dense {run['dense_ms']['median']:.1f} ms), target <= {row['target']:.3f} "
        f"{'met' if run['time_ratio'] <= row['target'] else 'MISSED'}"
        + (f"; eager {eager['time_ratio']:.3f} (dense {eager['dense_ms']:.1f} ms)" if eager else "")
        + f"; |logit diff| {row['max_abs_diff_vs_eager']['reduced']:.1e}"
        + (
            f"; ONNX nodes dense {sum(ops['dense'].values())}, {row['method']} {sum(ops['reduced'].values())}"
            if ops
            else ""
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["deit-s", "cifar"], choices=["deit-s", "cifar"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--images", type=int, default=60)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="times each deployed pair is exported and timed anew")
    ap.add_argument("--runtime", default="onnx", choices=list(RUNTIMES))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        dense, images, mine, tome = deployed_models(name, args.images)
        for reduced in (mine, tome):
            method = reduced.ltmp_config.method
            for r in range(1, args.runs + 1):  # each run exports and times anew; eager in the first only
                dep = bench_deployed(
                    dense, reduced, images, args.runtime, args.threads, reps=args.reps, rounds=args.rounds
                )
                for run in dep["runs"]:
                    row = {
                        "model": name,
                        "method": method,
                        "run": r,
                        "threads": run["threads"],
                        "gmacs_ratio": dep["gmacs_ratio"],
                        "deployed": run,
                        "max_abs_diff_vs_eager": dep["max_abs_diff_vs_eager"],
                        "graph_ops": dep["graph_ops"],
                        "eager": eager_ratio(dense, reduced, images, run["threads"], args.reps, args.rounds)
                        if r == 1
                        else None,
                        "target": dep["gmacs_ratio"] + TARGET_MARGIN[method],
                    }
                    rows.append(row)
                    print_row(row, args.runtime)
    for key in sorted({(r["model"], r["method"], r["threads"]) for r in rows}):
        runs = [r for r in rows if (r["model"], r["method"], r["threads"]) == key]
        held = sum(r["deployed"]["time_ratio"] <= r["target"] for r in runs)
        ratios = ", ".join(f"{r['deployed']['time_ratio']:.3f}" for r in runs)
        print(
            f"{key[0]} {key[1]} {key[2]} thr: time ratios {ratios} against <= {runs[0]['target']:.3f}: held in "
            f"{held} of {len(runs)} runs"
        )
    out = {
        "runtime": args.runtime,
        "images": args.images,
        "reps": args.reps,
        "rounds": args.rounds,
        "runs": args.runs,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "ltmp": ltmp.__version__,
        "rows": rows,
    }
    if args.json:
        write_json(Path(args.json), out)


if __name__ == "__main__":
    main()
