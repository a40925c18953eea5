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
