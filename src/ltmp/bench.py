"""Timing: warm-up, then repeated timed forwards; median and spread. CUDA is synchronised around each timing."""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model: nn.Module, x: torch.Tensor, warmup: int = 3, reps: int = 10) -> dict:
    """Seconds per forward of ``model(x)`` in eval mode: ``median``, ``p25``, ``p75`` and ``reps``."""
    return compare_models({"model": model}, x, warmup=warmup, reps=reps, rounds=1)["model"]


@torch.no_grad()
def compare_models(models: dict[str, nn.Module], x: torch.Tensor | list[torch.Tensor], warmup: int = 3,
                   reps: int = 10, rounds: int = 3) -> dict[str, dict]:
    """Time several models on the same input with interleaved repetitions (round-robin), so that drift of the
    machine affects them alike.

    Args:
        models: name -> model (put in eval mode).
        x: One input, or a list of inputs (e.g. single images of batch 1) that one repetition runs in turn.

    Returns:
        Per model the median and quartiles over all repetitions (seconds per repetition).
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
    for _ in range(rounds):
        for name, m in models.items():
            for _ in range(reps):
                t = time.perf_counter()
                for xi in inputs:
                    m(xi)
                _sync(device)
                times[name].append(time.perf_counter() - t)
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        out[name] = {"median": statistics.median(ts), "p25": q[0], "p75": q[2], "reps": len(ts)}
    return out
