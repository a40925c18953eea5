"""Confidence intervals and paired tests of evaluations, against values worked out by hand."""
from __future__ import annotations

import pytest

from ltmp.significance import holm, mcnemar, wilson_interval


def test_wilson_interval_of_half():
    lo, hi = wilson_interval(50, 100)  # the textbook 95% Wilson interval of 50/100: 40.38% to 59.62%
    assert (lo, hi) == (pytest.approx(40.383, abs=1e-3), pytest.approx(59.617, abs=1e-3))


def test_mcnemar_counts_the_discordant_pairs():
    res = mcnemar("1" * 10 + "0" * 5, "0" * 10 + "0" * 5)  # a right and b wrong on 10 images, never the reverse
    assert (res["only_a_correct"], res["only_b_correct"]) == (10, 0)
    assert res["p_value"] == pytest.approx(2 * 0.5 ** 10, rel=1e-12)  # exact two-sided binomial test
    assert mcnemar("1100", "1010")["p_value"] == 1.0  # one discordant pair each way
    with pytest.raises(ValueError, match="cover different images"):
        mcnemar("10", "101")


def test_holm_adjusts_in_order_and_stays_monotone():
    # sorted p 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> running maximum 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == [pytest.approx(0.03), pytest.approx(0.06), pytest.approx(0.06)]
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
