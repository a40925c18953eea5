"""Where deployed batch-1 time goes with 1 and 2 threads: ONNX Runtime's own per-node profile of the dense, LTMP and
ToMe graphs of benchmarks/deployed.py (issue #39, "why two threads lose part of the gain").

Each graph (the ``ltmp bench --deployed onnx`` export) runs ``--images`` bundled test images once to warm up, then
``--reps`` times each with ONNX Runtime's profiler on (``SessionOptions.enable_profiling``); node times are summed
per image and split into the matrix products (``MatMul``, ``Gemm`` and ONNX Runtime's fused forms of them) and
every other node. Prints, per model and thread count, the time per image of a run and of each part (the rest of
a run is the time between nodes), the number of nodes run, the other nodes' costliest operator types, and the
two-thread speed-up of each part. The profiler adds its own cost to every node, most to the small ones.

    python benchmarks/deployed_profile.py --model deit-s
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch

from common import deployed_models
from ltmp.export import deploy

#: operators that are matrix products, before and after ONNX Runtime's graph fusions
MATRIX_PRODUCTS = {"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger", "Attention", "MultiHeadAttention"}


def profile(path: Path, images: list[torch.Tensor], threads: int, reps: int, folder: str) -> dict:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_profiling, opts.profile_file_prefix = True, str(Path(folder) / f"{path.stem}-{threads}")
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for x in images:  # warm-up; its events are dropped below by run count
        session.run(None, {name: x.numpy()})
    for _ in range(reps):
        for x in images:
            session.run(None, {name: x.numpy()})
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][len(images):]
    start = runs[0]["ts"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start]
    us, other = collections.Counter(), collections.Counter()
    for e in nodes:
        matrix = e["args"]["op_name"] in MATRIX_PRODUCTS
        us["matrix products" if matrix else "other nodes"] += e["dur"]
        if not matrix:
            other[e["args"]["op_name"]] += e["dur"]
    n = len(runs)
    return {"ms": {k: v / 1000 / n for k, v in us.items()}, "nodes_run": len(nodes) / n,
            "run_ms": sum(e["dur"] for e in runs) / 1000 / n,
            "other_ms": {k: v / 1000 / n for k, v in other.most_common(6)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deit-s", choices=["deit-s", "cifar"])
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dense, images, mine, tome = deployed_models(args.model, args.images)
    singles = [x[None] for x in images]
    with tempfile.TemporaryDirectory() as folder:
        for label, model in (("dense", dense), ("ltmp", mine), ("tome", tome)):
            path = deploy(model, singles[0], "onnx", folder, label)
            by_threads = {t: profile(path, singles, t, args.reps, folder) for t in (1, 2)}
            for t, p in by_threads.items():
                parts = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(p["ms"].items()))
                print(f"{args.model} {label} {t} thr: run {p['run_ms']:.2f} ms per image; {parts}; "
                      f"{p['nodes_run']:.0f} nodes run; most time in other nodes: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in p["other_ms"].items()), flush=True)
            one, two = by_threads[1], by_threads[2]
            speed = {k: one["ms"][k] / two["ms"][k] for k in one["ms"]}
            print(f"{args.model} {label} two-thread speed-up: run {one['run_ms'] / two['run_ms']:.2f}"
                  + "".join(f", {k} {v:.2f}" for k, v in sorted(speed.items())), flush=True)


if __name__ == "__main__":
    main()
