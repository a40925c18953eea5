"""ltmp train --recipe paper: each point of the reference code's recipe does what it says, in train mode; the
default recipe's prune learning rate follows the scores' spreads."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import ltmp
from conftest import THRESHOLDS, images, make_model
from ltmp.cli import build_parser, train_config
from ltmp.options import RECIPES
from ltmp.train import project_thresholds

REQUIRED = ["train", "--model", "m", "--data-dir", "d", "--output", "o", "--r-target", "0.5"]


def _study():
    """benchmarks/training_study.py, whose "recipe" study measures each point."""
    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("training_study", bench / "training_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("method", ["ltmp", "ltp"])
def test_paper_recipe_is_the_points_the_study_measures(method):
    """``--recipe paper`` sets exactly the points of docs/training.md's table (each of which the study switches
    back to the default one at a time), plus its 2% hold-out; an option given beside it wins."""
    import dataclasses

    parse = build_parser().parse_args
    preset = train_config(parse([*REQUIRED, "--method", method, "--recipe", "paper"]))
    flags = _study().recipe_variants(method)["paper"]
    spelled = train_config(parse([*REQUIRED, "--method", method, "--holdout", "0.02", *flags]))
    ignored = {"recipe"} | (
        {"merge_init", "merge_grad", "combine", "train_order", "clamp"} if method == "ltp" else set()
    )  # options that do nothing without merge thresholds (prune's range is [0, 1])
    a, b = dataclasses.asdict(preset), dataclasses.asdict(spelled)
    assert {k: v for k, v in a.items() if k not in ignored} == {k: v for k, v in b.items() if k not in ignored}
    assert all(a[k] == v for k, v in RECIPES["paper"].items())
    assert train_config(parse([*REQUIRED, "--recipe", "paper", "--mask-grad", "secant"])).mask_grad == "secant"
    assert train_config(parse([*REQUIRED, "--recipe", "paper", "--settle"])).settle is True
    assert train_config(parse(REQUIRED)).recipe == "default" and train_config(parse(REQUIRED)).settle is True


def _budget_grads(model, x, merge_p):
    model.train()
    model(x)
    (g,) = torch.autograd.grad(ltmp.budget_loss(model, 0.3), [merge_p])
    return g


def test_overwrite_leaves_the_merge_threshold_only_the_tokens_it_merges():
    """The reference code's prune mask overwrites an unmerged set-A token's merge mask, so with its detached merged
    averages a merge threshold above every similarity (nothing merges) gets no gradient; with the product of the
    masks it does. The forward (hard masks) is the same."""
    model = ltmp.patch(
        make_model("cls"), "ltmp", merge_threshold=1.0, prune_threshold=THRESHOLDS["prune_threshold"], merge_grad="mask"
    )
    for p in model.parameters():
        p.requires_grad_(False)
    first = model.blocks[0].merge_threshold.requires_grad_(True)
    x = images(4)
    model.train()
    logits_product = model(x)
    product = _budget_grads(model, x, first)
    model.ltmp_config.combine = "overwrite"
    logits_overwrite = model(x)
    overwrite = _budget_grads(model, x, first)
    assert int(ltmp.stats(model).merged.sum()) == 0 and int(ltmp.stats(model).pruned.sum()) > 0
    assert torch.equal(logits_product, logits_overwrite)
    assert product.abs() > 0 and overwrite == 0


def test_importance_over_all_rows_changes_only_what_follows_a_removal():
    """``importance_rows="all"`` averages eq. 17 over removed tokens' query rows too: block 1 (nothing removed
    before it) scores as with the survivors' rows, a later block does not; eval is unaffected."""
    model = ltmp.patch(make_model("cls"), "ltp", prune_threshold=THRESHOLDS["prune_threshold"])
    x = images(4)
    cfg = model.ltmp_config
    scores = {}
    for rows in ("survivors", "all"):
        captured = []
        cfg.importance_rows, cfg.capture = rows, captured.append
        model.train()
        model(x)
        scores[rows] = [c.scores for c in captured]
        cfg.capture = None
        model.eval()
        with torch.no_grad():
            scores[rows, "eval"] = model(x)
    assert int(ltmp.stats(model).pruned[:, 0].sum()) > 0, "block 1 must prune for block 2 to differ"
    assert torch.equal(scores["survivors"][0], scores["all"][0])
    assert not torch.allclose(scores["survivors"][1], scores["all"][1])
    assert torch.equal(scores["survivors", "eval"], scores["all", "eval"])


def test_reference_token_order_reorders_and_keeps_what_matters():
    """``train_order="reference"``: after every block that merges, the tokens stand set A first, then set B, and
    A/B alternate over all positions. With nothing reduced that changes no logit (attention does not see the
    order); with reduction, block 1 decides as eval does (no token is removed before it), the sizes still add up
    to the patches, and every threshold gets a gradient."""
    x = images(4)
    dense = make_model("cls")
    with torch.no_grad():
        ref = dense(x)
    with pytest.warns(UserWarning, match="reduces no tokens"):
        model = ltmp.patch(make_model("cls"), "ltmp", merge_threshold=math.inf, prune_threshold=-math.inf)
    model.ltmp_config.train_order = "reference"
    model.train()
    assert torch.allclose(model(x), ref, atol=1e-10, rtol=0)
    model = ltmp.patch(make_model("cls"), "ltmp", **THRESHOLDS, trace_source=True)
    model.eval()
    with torch.no_grad():
        model(x)
    ev = ltmp.stats(model)
    first_eval = (ev.merged[:, 0].clone(), ev.pruned[:, 0].clone())
    model.ltmp_config.train_order = "reference"
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x), torch.arange(4) % 7) + 10 * ltmp.budget_loss(model, 0.3)
    tr = ltmp.stats(model)
    assert torch.equal(tr.merged[:, 0], first_eval[0]) and torch.equal(tr.pruned[:, 0], first_eval[1])
    kept = tr.keeps[-1].to(torch.float64)  # (B, N) survivors after the last block
    per_patch = (tr.sources[-1] * kept[..., None]).sum(1)  # (B, 64) survivors covering each patch
    assert per_patch.max() == 1 and per_patch.sum() > 0  # reordered, never duplicated
    merging = ltmp.patch(make_model("cls"), "ltm", merge_threshold=THRESHOLDS["merge_threshold"], trace_source=True)
    merging.ltmp_config.train_order = "reference"
    merging.train()
    merging(x)
    rec = ltmp.stats(merging)  # merging alone: the survivors cover every patch once
    assert torch.equal((rec.sources[-1] * rec.keeps[-1][..., None]).sum(1), torch.ones(4, 64, dtype=torch.float64))
    thresholds = [p for n, p in model.named_parameters() if n.endswith("threshold")]
    grads = torch.autograd.grad(loss, thresholds, allow_unused=True)
    assert all(g is not None and torch.isfinite(g) and g.abs() > 0 for g in grads)


def test_budget_tokens_and_pool_follow_the_reference_formula():
    """``tokens="all"``: n and the kept fractions count the class token (always kept); ``pool="batch"``: one
    r_FLOPs of the batch's mean fractions, as the reference's train script computes it (by hand below)."""
    model = ltmp.patch(make_model("cls"), "ltmp", **THRESHOLDS).eval()
    with torch.no_grad():
        model(images(4))
    rec = ltmp.stats(model)
    assert len(set(rec.kept[:, -1].tolist())) > 1, "images must keep different counts for the pools to differ"
    n, d, L = 65, 48, 3
    m = (rec.keep_frac * 64 + 1).mean(0) / n  # (L + 1,) batch-mean kept fraction over all 65 tokens
    expect = (
        sum(
            (2 * m[i] * n * d * d + (m[i] * n) ** 2 * d + 4 * m[i + 1] * n * d * d) / (6 * n * d * d + n * n * d)
            for i in range(L)
        )
        / L
    )  # tools/train.py:1143-1148 of the reference, with its d = embed dim
    got = ltmp.record.mean_r_flops(model, tokens="all", pool="batch")
    assert got == pytest.approx(float(expect), rel=1e-12)
    assert got != pytest.approx(float(ltmp.record.mean_r_flops(model, tokens="all")), rel=1e-9)
    assert ltmp.record.mean_r_flops(model) == pytest.approx(float(ltmp.r_flops(model).mean()), rel=1e-12)


def test_unit_clamp_keeps_thresholds_in_zero_one():
    model = ltmp.patch(make_model("cls"), "ltmp", merge_threshold=-0.5, prune_threshold=2.0)
    merge = [b.merge_threshold for b in model.blocks]
    prune = [b.prune_threshold for b in model.blocks]
    project_thresholds(model, merge, prune)
    assert [float(p.detach()) for p in merge + prune] == [-0.5] * 3 + [1.0] * 3
    project_thresholds(model, merge, prune, "unit")
    assert [float(p.detach()) for p in merge + prune] == [0.0] * 3 + [1.0] * 3


def test_timm_random_augmentation_draws_its_interpolation():
    from ltmp.data import transforms_for

    train_tf, _, _ = transforms_for(make_model("cls"), "timm-random")
    crop = train_tf.transforms[0]
    assert isinstance(crop.interpolation, (tuple, list)) and len(crop.interpolation) == 2


def test_score_spreads_measure_the_model_with_nothing_reduced():
    """The spreads the default SGD steps in are those of the scores with nothing reduced, whatever the model's
    thresholds, and measuring leaves the model as it was."""
    from ltmp.calibrate import score_spreads

    x = images(8)
    fresh = score_spreads(ltmp.patch(make_model("cls"), "ltmp", merge_threshold=2.0, prune_threshold=-1.0), x)
    model = ltmp.patch(make_model("cls"), "ltmp", **THRESHOLDS)
    assert score_spreads(model, x) == pytest.approx(fresh, rel=1e-12)
    assert float(model.blocks[0].merge_threshold.detach()) == pytest.approx(THRESHOLDS["merge_threshold"])
    assert model.ltmp_config.capture is None
    # importance of 65 tokens averages 1/65 and spreads far less than cosine similarities
    assert fresh["prune_threshold"] < fresh["merge_threshold"] / 3
