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
    assert res["p_value"] == pytest.approx(2 * 0.5**10, rel=1e-12)  # exact two-sided binomial test
    assert mcnemar("1100", "1010")["p_value"] == 1.0  # one discordant pair each way
    with pytest.raises(ValueError, match="cover different images"):
        mcnemar("10", "101")


def test_holm_adjusts_in_order_and_stays_monotone():
    # sorted p 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> running maximum 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03]) == [pytest.approx(0.03), pytest.approx(0.06), pytest.approx(0.06)]
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1


def test_image_test_with_one_seed_is_mcnemars_normal_form():
    from scipy.stats import norm

    from ltmp.significance import image_test

    a, b = "1" * 30 + "0" * 10 + "1" * 60, "0" * 30 + "1" * 10 + "1" * 60  # 30 only a, 10 only b, of 100
    res = image_test([(1.0, [a]), (-1.0, [b])])
    # d_i is +1 on 30 images, -1 on 10, 0 on 60: mean 0.2, sample variance (40 - 100 * 0.04) / 99
    se = ((40 - 100 * 0.2**2) / 99 / 100) ** 0.5
    assert res["diff"] == pytest.approx(20.0) and res["images"] == 100
    assert res["p_value"] == pytest.approx(2 * norm.sf(0.2 / se), rel=1e-9)
    assert res["ci"] == (pytest.approx(100 * (0.2 - 1.959964 * se)), pytest.approx(100 * (0.2 + 1.959964 * se)))


def test_image_test_counts_an_image_once_however_many_seeds_see_it():
    from ltmp.significance import image_test

    a, b = "1100110011", "1000100010"
    once = image_test([(1.0, [a]), (-1.0, [b])])
    thrice = image_test([(1.0, [a, a, a]), (-1.0, [b])])  # three seeds that agree are one image's evidence
    assert thrice == once
    split = image_test([(1.0, [a, b]), (-1.0, [b])])  # seeds that disagree: half the difference per image
    assert split["diff"] == pytest.approx(once["diff"] / 2) and split["p_value"] == pytest.approx(once["p_value"])
    gaps = image_test([(1.0, [a]), (-1.0, [b]), (-1.0, [b]), (1.0, [b])])  # a's gap over b minus b's gap over b
    assert gaps["diff"] == pytest.approx(once["diff"])
    assert image_test([(1.0, [a]), (-1.0, [a])])["p_value"] == 1.0
    with pytest.raises(ValueError, match="different numbers of images"):
        image_test([(1.0, ["10"]), (-1.0, ["101"])])
