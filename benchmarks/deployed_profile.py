"""Where deployed batch-1 time goes with 1 and 2 threads: ONNX Runtime's own per-node profile of the dense, LTMP and
ToMe graphs of benchmarks/deployed.py (issue #39, "why two threads lose part of the gain").

Each graph (the ``ltmp bench --deployed onnx`` export) runs ``--images`` bundled test images once to warm up, then
``--reps`` times each with ONNX Runtime's profiler on (``SessionOptions.enable_profiling``); node times are summed
per image and split into the matrix products (``MatMul``, ``Gemm`` and ONNX Runtime's fused forms of them) and
every other node. Prints, per model and thread count, the time per image of a run and of each part (the rest of
a run is the time between nodes), the number of nodes run, the other nodes' costliest operator types, and the
two-thread speed-up of each part. The profiler adds its own cost to every node, most to the small ones.

Then the floor that batch 1 sets under any token reduction (``linear_floor``): the dense model's linear layers alone,
every weight once as in one forward, timed in ONNX Runtime (no profiler) at M = N, 3N/4, N/2, N/4 and 8 token rows
and fitted as ``a + b M``. The fixed part ``a`` (the weights read from memory each image, and each call's cost) does
not shrink with the tokens, so at LTMP's GMACs ratio r the linear layers alone take ``(a + b r N) / (a + b N)`` of
their dense time: the printed floor, above r by what no graph change removes.

Last, the forms of eq. 17's mean over query rows and heads on DeiT-S's (1, 6, 197, 197) probabilities, one node
each or two (``mean_forms``): why an export takes the rows first.

    python benchmarks/deployed_profile.py --model deit-s
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import deployed_models, mean_gmacs
from ltmp.export import deploy
from ltmp.flops import dense_gmacs, vit_spec

#: operators that are matrix products, before and after ONNX Runtime's graph fusions
MATRIX_PRODUCTS = {"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "MatMulInteger", "Attention", "MultiHeadAttention"}


def profile(path: Path, images: list[torch.Tensor], threads: int, reps: int, folder: str) -> dict:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_profiling, opts.profile_file_prefix = True, str(Path(folder) / f"{path.stem}-{threads}")
    runner = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    name = runner.get_inputs()[0].name
    for x in images:  # warm-up; its events are dropped below by run count
        runner.run(None, {name: x.numpy()})
    for _ in range(reps):
        for x in images:
            runner.run(None, {name: x.numpy()})
    events = json.loads(Path(runner.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][len(images) :]
    start = runs[0]["ts"]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start]
    us, other = collections.Counter(), collections.Counter()
    for e in nodes:
        matrix = e["args"]["op_name"] in MATRIX_PRODUCTS
        us["matrix products" if matrix else "other nodes"] += e["dur"]
        if not matrix:
            other[e["args"]["op_name"]] += e["dur"]
    n = len(runs)
    return {
        "ms": {k: v / 1000 / n for k, v in us.items()},
        "nodes_run": len(nodes) / n,
        "run_ms": sum(e["dur"] for e in runs) / 1000 / n,
        "other_ms": {k: v / 1000 / n for k, v in other.most_common(6)},
    }


def linear_floor(dense: torch.nn.Module, tokens: int, threads: int, reps: int = 20) -> tuple[float, float]:
    """``(a, b)`` of the fit ``a + b M`` (ms) of the time of ``dense``'s block linear layers on M token rows in ONNX
    Runtime: one graph with one ``Gemm`` per layer, each on an input of its width, every weight read once per run."""
    from onnx import TensorProto, helper, numpy_helper

    layers = [m for m in dense.blocks.modules() if isinstance(m, torch.nn.Linear)]
    widths = sorted({m.in_features for m in layers})
    nodes, weights = [], []
    for i, m in enumerate(layers):
        weights += [
            numpy_helper.from_array(m.weight.detach().numpy(), f"w{i}"),
            numpy_helper.from_array(m.bias.detach().numpy(), f"b{i}"),
        ]
        nodes.append(helper.make_node("Gemm", [f"x{m.in_features}", f"w{i}", f"b{i}"], [f"y{i}"], transB=1))
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info(f"x{w}", TensorProto.FLOAT, ["m", w]) for w in widths],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(layers))],
        weights,
    )
    runner = _runner(graph, threads)
    rows = [tokens, 3 * tokens // 4, tokens // 2, tokens // 4, 8]
    ms = [
        _time_ms(
            runner, {f"x{w}": np.random.default_rng(0).standard_normal((m, w), dtype=np.float32) for w in widths}, reps
        )
        for m in rows
    ]
    b, a = np.polyfit(rows, ms, 1)
    return float(a), float(b)


def _runner(graph, threads: int):
    """An ONNX Runtime CPU InferenceSession of an ``onnx.helper`` graph (opset 18), on ``threads`` intra-op threads."""
    import onnxruntime as ort
    from onnx import helper

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _time_ms(runner, feed: dict, reps: int) -> float:
    """Median of 5 timings of ``reps`` runs of ``feed``, in ms per run, after 3 warm-up runs."""
    for _ in range(3):
        runner.run(None, feed)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            runner.run(None, feed)
        times.append((time.perf_counter() - t) / reps * 1000)
    return float(np.median(times))


def mean_forms(threads: int, heads: int = 6, n: int = 197) -> dict[str, float]:
    """Microseconds per run of a one- or two-node ONNX graph that averages (1, heads, n, n) over axes 1 and 2."""
    from onnx import TensorProto, helper

    forms = {"both axes at once": [(1, 2)], "heads, then rows": [(1,), (1,)], "rows, then heads": [(2,), (1,)]}
    x = np.random.default_rng(0).random((1, heads, n, n), dtype=np.float32)
    out = {}
    for label, steps in forms.items():
        nodes, axes, prev = [], [], "x"
        for i, ax in enumerate(steps):
            axes.append(helper.make_tensor(f"a{i}", TensorProto.INT64, [len(ax)], list(ax)))
            nodes.append(helper.make_node("ReduceMean", [prev, f"a{i}"], [f"t{i}"], keepdims=0))
            prev = f"t{i}"
        graph = helper.make_graph(
            nodes,
            "mean",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
            [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)],
            axes,
        )
        out[label] = 1000 * _time_ms(_runner(graph, threads), {"x": x}, 200)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deit-s", choices=["deit-s", "cifar"])
    ap.add_argument("--images", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--floor-only", action="store_true", help="only the linear layers' floor, no profiles")
    args = ap.parse_args()
    dense, images, mine, tome = deployed_models(args.model, args.images)
    singles = [x[None] for x in images]
    with tempfile.TemporaryDirectory() as folder:
        for label, model in () if args.floor_only else (("dense", dense), ("ltmp", mine), ("tome", tome)):
            path = deploy(model, singles[0], "onnx", folder, label)
            by_threads = {t: profile(path, singles, t, args.reps, folder) for t in (1, 2)}
            for t, p in by_threads.items():
                parts = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(p["ms"].items()))
                print(
                    f"{args.model} {label} {t} thr: run {p['run_ms']:.2f} ms per image; {parts}; "
                    f"{p['nodes_run']:.0f} nodes run; most time in other nodes: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in p["other_ms"].items()),
                    flush=True,
                )
            one, two = by_threads[1], by_threads[2]
            speed = {k: one["ms"][k] / two["ms"][k] for k in one["ms"]}
            print(
                f"{args.model} {label} two-thread speed-up: run {one['run_ms'] / two['run_ms']:.2f}"
                + "".join(f", {k} {v:.2f}" for k, v in sorted(speed.items())),
                flush=True,
            )
    r = mean_gmacs(mine, images) / dense_gmacs(vit_spec(dense))
    n = dense.patch_embed.num_patches + dense.num_prefix_tokens
    for t in (1, 2):
        a, b = linear_floor(dense, n, t)
        floor = (a + b * r * n) / (a + b * n)
        print(
            f"{args.model} linear layers {t} thr: {a:.2f} ms + {1000 * b:.1f} us per token row "
            f"({a / (a + b * n):.3f} of their dense {a + b * n:.2f} ms is fixed); at LTMP's GMACs ratio {r:.3f} "
            f"they take {floor:.3f} of their dense time ({floor - r:+.3f})",
            flush=True,
        )
    for t in (1, 2):
        print(
            f"eq. 17's mean of (1, 6, 197, 197), {t} thr: "
            + ", ".join(f"{k} {v:.1f} us" for k, v in mean_forms(t).items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
