"""Timing: warm-up, then repeated timed forwards; median and spread, and time ratios paired round by round. CUDA
is synchronised around each timing."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .flops import dense_gmacs, gmacs, gmacs_executed, vit_spec
from .record import stats
from .runtime import compile_model

#: glibc's malloc settings (environment variables read at process start) that change how large tensors are served
GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
#: what :func:`allocator` says for glibc malloc without any of those settings
GLIBC_DEFAULTS = "glibc malloc (defaults)"
#: settings under which glibc keeps its freed memory for reuse instead of mapping fresh pages (docs/performance.md)
GLIBC_KEEP_MEMORY = "MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736"


def allocator() -> str:
    """The heap allocator that serves CPU tensors in this process: a preloaded jemalloc, tcmalloc or mimalloc
    (``LD_PRELOAD``), else glibc malloc with its defaults or with the settings given, else "system".

    It changes CPU timings, and dense ones most: with glibc's defaults every tensor above the mmap threshold
    (dynamic, at most 32 MiB) gets fresh pages from the kernel each time it is allocated, and a dense batch has
    more such tensors than a reduced one (docs/performance.md, "Memory allocator")."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in preload:
            return name
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "system"
    tuned = [f"{k}={os.environ[k]}" for k in GLIBC_MALLOC_ENV if k in os.environ]
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")]
    settings = tuned + tunables
    return f"glibc malloc ({', '.join(settings)})" if settings else GLIBC_DEFAULTS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model: nn.Module, x: torch.Tensor, warmup: int = 3, reps: int = 10) -> dict:
    """Seconds per forward of ``model(x)`` in eval mode: ``median``, ``p25``, ``p75`` and ``reps``."""
    return compare_models({"model": model}, x, warmup=warmup, reps=reps, rounds=1)["model"]


@torch.no_grad()
def compare_models(
    models: dict[str, nn.Module], x: torch.Tensor | list[torch.Tensor], warmup: int = 3, reps: int = 10, rounds: int = 3
) -> dict[str, dict]:
    """Time several models on the same input with interleaved repetitions (round-robin, each round starting one
    model later, so that none always runs first), so that drift of the machine affects them alike.

    Args:
        models: name -> model (put in eval mode).
        x: One input, or a list of inputs (e.g. single images of batch 1) that one repetition runs in turn.

    Returns:
        Per model the median and quartiles over all repetitions (seconds per repetition), and ``times``, the
        repetitions in order (the i-th of every model came from the same round: see :func:`paired_ratio`).
    """
    inputs = x if isinstance(x, (list, tuple)) else [x]
    device = inputs[0].device
    times: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        m.eval()
        for _ in range(warmup):
            for xi in inputs:
                m(xi)
    _sync(device)
    names = list(models)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            m = models[name]
            for _ in range(reps):
                t = time.perf_counter()
                for xi in inputs:
                    m(xi)
                _sync(device)
                times[name].append(time.perf_counter() - t)
    return {name: {**_summary(ts), "reps": len(ts), "times": ts} for name, ts in times.items()}


def paired_ratio(timed: dict[str, dict], num: str, den: str) -> dict[str, float]:
    """Time ratio ``num`` / ``den`` from :func:`compare_models`, taken repetition by repetition within each round
    and then summarised (median and quartiles): a slow or fast spell of the machine shifts both times of a round
    alike, so it cancels in their ratio, where a ratio of the two medians would keep it."""
    return _summary([a / b for a, b in zip(timed[num]["times"], timed[den]["times"])])


def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2]}


def bench_models(
    dense: nn.Module,
    reduced: nn.Module,
    batch: torch.Tensor,
    batch_sizes: Sequence[int],
    *,
    compile: bool = False,
    exported: nn.Module | None = None,
    warmup: int = 3,
    reps: int = 10,
    rounds: int = 3,
) -> dict:
    """``ltmp bench``: latency and throughput of a reduced model against its dense original, with GMACs.

    Args:
        dense, reduced: The two models, on one device, in eval mode.
        batch: (B, 3, H, W) inputs; each batch size times its first images.
        batch_sizes: Batch sizes to time (each at most B).
        compile: Time both under ``torch.compile`` (reduced with dynamic shapes); the warm-up compiles.
        exported: An exported reduced model (``ltmp export``), timed at batch 1 beside the others.

    Returns:
        The machine and the dense GMACs, and per batch size (``runs``): medians and IQRs in ms, time ratio to
        dense (paired by round), GMACs and executed GMACs ratios, and throughput in images per second.
    """
    device = next(dense.parameters()).device
    spec = vit_spec(dense)
    result = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "allocator": allocator() if device.type == "cpu" else None,
        "method": reduced.ltmp_config.method,
        "gmacs_dense": dense_gmacs(spec),
        "compiled": compile,
        "runs": [],
    }
    run_dense, run_reduced = dense, reduced
    if compile:  # both alike; the warm-up forwards compile (the first batch size's take longest)
        run_dense, run_reduced = compile_model(dense, device), compile_model(reduced, device)
    for bs in batch_sizes:
        x = batch[:bs].to(device)
        with torch.no_grad():
            reduced(x)
        rec = stats(reduced)
        g_mean = float(gmacs(spec, rec.kept.cpu()).mean())
        g_exec = gmacs_executed(spec, rec.padded)
        models = {"dense": run_dense, "reduced": run_reduced}
        if exported is not None and bs == 1:  # exported programs run one image at a time
            models["exported"] = exported
        t = compare_models(models, x, warmup=warmup, reps=reps, rounds=rounds)
        ratio = paired_ratio(t, "reduced", "dense")  # round by round: drift of the machine cancels
        run = {
            "batch_size": bs,
            "dense_ms": 1000 * t["dense"]["median"],
            "reduced_ms": 1000 * t["reduced"]["median"],
            "dense_iqr_ms": [1000 * t["dense"]["p25"], 1000 * t["dense"]["p75"]],
            "reduced_iqr_ms": [1000 * t["reduced"]["p25"], 1000 * t["reduced"]["p75"]],
            "time_ratio": ratio["median"],
            "time_ratio_iqr": [ratio["p25"], ratio["p75"]],
            "gmacs": g_mean,
            "gmacs_ratio": g_mean / result["gmacs_dense"],
            "gmacs_executed": g_exec,
            "gmacs_executed_ratio": g_exec / result["gmacs_dense"],
            "throughput_dense": bs / t["dense"]["median"],
            "throughput_reduced": bs / t["reduced"]["median"],
        }
        if "exported" in t:
            run["exported_ms"] = 1000 * t["exported"]["median"]
            run["exported_time_ratio"] = paired_ratio(t, "exported", "dense")["median"]
        result["runs"].append(run)
    return result


def bench_deployed(
    dense: nn.Module,
    reduced: nn.Module,
    images: torch.Tensor,
    runtime: str,
    threads: Sequence[int],
    *,
    warmup: int = 3,
    reps: int = 10,
    rounds: int = 5,
) -> dict:
    """``ltmp bench --deployed``: the dense and the reduced model exported the same way, loaded into a deployment
    runtime (:func:`ltmp.export.deploy`) and run one image at a time, as the paper timed DeiT-S on a phone; both
    in the same interleaved rounds (one repetition runs every image once), the time ratio paired round by round.

    Args:
        dense, reduced: The eager models (CPU, eval mode).
        images: (N, 3, H, W) images; the first is the export example.
        runtime: ``onnx`` (ONNX Runtime, CPU provider), ``openvino`` (OpenVINO, CPU) or ``aoti`` (AOTInductor).
        threads: Intra-op thread counts to time with (both models exported once).

    Returns:
        The reduced model's GMACs ratio (its eager token counts on these images, one at a time), each deployed
        model's largest |logit difference| from its eager original, the ONNX graphs' operators by type, and per
        thread count (``runs``) medians and quartiles per image in ms and the paired time ratio.
    """
    import tempfile

    from .export import RUNTIMES, deploy, load_deployed

    spec = vit_spec(dense)
    singles = [x[None] for x in images]  # (1, 3, H, W) each
    kept, diff, runs = [], {"dense": 0.0, "reduced": 0.0}, []
    with tempfile.TemporaryDirectory() as folder:
        files = {
            name: deploy(m, singles[0], runtime, folder, name) for name, m in (("dense", dense), ("reduced", reduced))
        }
        for n in threads:
            models = {name: load_deployed(path, runtime, n) for name, path in files.items()}
            if not runs:
                with torch.no_grad():
                    for x in singles:
                        for name, eager in (("dense", dense), ("reduced", reduced)):
                            gap = (models[name](x).float() - eager(x).float()).abs().max()
                            diff[name] = max(diff[name], float(gap))
                        kept.append(stats(reduced).kept)  # (1, L) of the eager reduced model, just run
            timed = compare_models(models, singles, warmup=warmup, reps=reps, rounds=rounds)
            ratio = paired_ratio(timed, "reduced", "dense")
            runs.append(
                {
                    "threads": n,
                    "time_ratio": ratio["median"],
                    "time_ratio_iqr": [ratio["p25"], ratio["p75"]],
                    **{
                        f"{name}_ms": {k: 1000 * timed[name][k] / len(singles) for k in ("median", "p25", "p75")}
                        for name in models
                    },
                }
            )
        ops = {name: graph_ops(path) for name, path in files.items()} if RUNTIMES[runtime] == "onnx" else None
    g_mean = float(gmacs(spec, torch.cat(kept)).mean())
    return {
        "runtime": runtime,
        "images": len(singles),
        "method": reduced.ltmp_config.method,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "gmacs_dense": dense_gmacs(spec),
        "gmacs": g_mean,
        "gmacs_ratio": g_mean / dense_gmacs(spec),
        "max_abs_diff_vs_eager": diff,
        "graph_ops": ops,
        "rounds": rounds,
        "reps": reps,
        "runs": runs,
    }


def graph_ops(path: Path) -> dict[str, int]:
    """Operators of an ONNX graph by type, most frequent first (nodes of subgraphs included)."""
    import collections

    import onnx

    counts: collections.Counter = collections.Counter()
    graphs = [onnx.load(str(path)).graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            counts[node.op_type] += 1
            graphs += [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    return dict(counts.most_common())
