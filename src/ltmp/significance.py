"""Significance of evaluations: confidence intervals of accuracy, exact paired tests between two runs on the same
images, and the correction for testing many pairs. (Not ``stats.py``: ``ltmp.stats`` is the public record of a
forward.)"""
from __future__ import annotations

import math

from .errors import LtmpError


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n, in percent."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (100 * (mid - half), 100 * (mid + half))


def mcnemar(correct_a: str, correct_b: str) -> dict:
    """Exact McNemar test on paired per-image correctness strings ('0'/'1' per image)."""
    from scipy.stats import binomtest

    if len(correct_a) != len(correct_b):
        raise LtmpError(f"the two evaluations cover different images ({len(correct_a)} vs {len(correct_b)}); "
                        f"compare runs on the same eval set")
    b = sum(1 for x, y in zip(correct_a, correct_b) if x == "1" and y == "0")
    c = sum(1 for x, y in zip(correct_a, correct_b) if x == "0" and y == "1")
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)
    return {"only_a_correct": b, "only_b_correct": c, "p_value": p}



def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (family-wise error over the whole list); statsmodels'
    ``multipletests`` does the same but is not a dependency, scipy has only Benjamini-Hochberg."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
