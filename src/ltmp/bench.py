"""Timing: warm-up, then repeated timed forwards; median and spread. CUDA is synchronised around each timing."""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_forward(model: nn.Module, x: torch.Tensor, warmup: int = 3, reps: int = 10) -> dict:
    """Seconds per forward of ``model(x)`` in eval mode.

    Returns:
        ``median``, ``p25``, ``p75`` (seconds) and ``reps``.
    """
    model.eval()
    for _ in range(warmup):
        model(x)
    _sync(x.device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        model(x)
        _sync(x.device)
        times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median": statistics.median(times), "p25": q[0], "p75": q[2], "reps": reps}


@torch.no_grad()
def compare_models(models: dict[str, nn.Module], x: torch.Tensor, warmup: int = 3, reps: int = 10,
                   rounds: int = 3) -> dict[str, dict]:
    """Time several models on the same input with interleaved repetitions (round-robin), so that drift of the
    machine affects them alike. Returns per model the median and quartiles over all repetitions (seconds)."""
    times: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        m.eval()
        for _ in range(warmup):
            m(x)
    _sync(x.device)
    for _ in range(rounds):
        for name, m in models.items():
            for _ in range(reps):
                t = time.perf_counter()
                m(x)
                _sync(x.device)
                times[name].append(time.perf_counter() - t)
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        out[name] = {"median": statistics.median(ts), "p25": q[0], "p75": q[2], "reps": len(ts)}
    return out
