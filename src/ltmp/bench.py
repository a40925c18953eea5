"""Timing: warm-up, then repeated timed forwards; median and spread, and time ratios paired round by round. CUDA
is synchronised around each timing."""
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
        for name in names[r % len(names):] + names[:r % len(names)]:
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
