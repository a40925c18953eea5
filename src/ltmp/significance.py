"""Significance of evaluations: confidence intervals of accuracy, paired tests between runs on the same images with
the image as the unit, and the correction for testing many pairs. (Not ``stats.py``: ``ltmp.stats`` is the public
record of a forward.)"""

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
        raise LtmpError(
            f"the two evaluations cover different images ({len(correct_a)} vs {len(correct_b)}); "
            f"compare runs on the same eval set"
        )
    b = sum(1 for x, y in zip(correct_a, correct_b) if x == "1" and y == "0")
    c = sum(1 for x, y in zip(correct_a, correct_b) if x == "0" and y == "1")
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)
    return {"only_a_correct": b, "only_b_correct": c, "p_value": p}


def image_test(terms: list[tuple[float, list[str]]]) -> dict:
    """A paired test whose unit is the image, for comparisons of runs with several seeds on the same images.

    Each term is a weight and the per-image correctness strings ('0'/'1' per image) of one variant's runs (one per
    seed; a baseline evaluated once is a list of one). Per image, ``d_i = sum_k w_k * mean over seeds of correct``:
    ``[(1, a), (-1, b)]`` is a's seed-averaged accuracy minus b's; ``[(1, a), (-1, a_base), (-1, b), (1, b_base)]``
    compares two gaps over baselines (runs at different GMACs). The images are the independent units (their seeds
    are averaged within each image, so an image counts once however many seeds see it): the mean of ``d`` has the
    standard error ``sd(d) / sqrt(n)``, a cluster-robust test with the image as the cluster, and at n in the
    thousands its z statistic is normal. With one seed per term and two terms it is the normal form of McNemar's
    test.

    Returns:
        ``diff`` (points), ``ci`` (95% interval, points), ``p_value`` (two-sided) and ``images``.
    """
    from scipy.stats import norm

    lengths = {len(s) for _, runs in terms for s in runs}
    if len(lengths) != 1:
        raise LtmpError(
            f"the runs cover different numbers of images ({sorted(lengths)}); compare runs on the same eval set"
        )
    n = lengths.pop()
    d = [0.0] * n
    for w, runs in terms:
        for s in runs:
            for i, c in enumerate(s):
                if c == "1":
                    d[i] += w / len(runs)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(var / n)
    p = (1.0 if mean == 0 else 0.0) if se == 0 else float(2 * norm.sf(abs(mean) / se))
    return {
        "diff": 100 * mean,
        "ci": (100 * (mean - 1.959964 * se), 100 * (mean + 1.959964 * se)),
        "p_value": p,
        "images": n,
    }


def holm(pvalues: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (family-wise error over the whole list); statsmodels'
    ``multipletests`` does the same but is not a dependency, scipy has only Benjamini-Hochberg."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
