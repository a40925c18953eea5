"""GMACs in the paper's (fvcore) convention, checked against torch.utils.flop_counter."""

from __future__ import annotations

import pytest
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import ltmp
from conftest import images, make_model


@pytest.mark.parametrize(
    "name,paper",
    [("deit_tiny_patch16_224", 1.258), ("deit_small_patch16_224", 4.608), ("deit_base_patch16_224", 17.583)],
)
def test_dense_gmacs_match_the_paper(name, paper):
    with torch.device("meta"):
        model = timm.create_model(name)
    got = ltmp.dense_gmacs(ltmp.vit_spec(model))
    assert abs(got - paper) / paper < 0.005, got


def counted_flops(model, x) -> int:
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            model(x)
    return counter.get_total_flops()


@pytest.mark.parametrize("config", ["cls", "distilled", "registers", "no-cls-avg", "layerscale-qknorm"])
def test_analytic_count_matches_flop_counter_dense(config):
    model = make_model(config, torch.float32)
    for blk in model.blocks:
        blk.attn.fused_attn = False  # flop_counter misses the fused CPU attention kernel
    spec = ltmp.vit_spec(model, count_norm=False)  # flop_counter skips LayerNorm
    expect = 2 * ltmp.dense_gmacs(spec) * 1e9  # 2 FLOPs per MAC
    assert counted_flops(model, images(1, torch.float32)) == pytest.approx(expect, rel=1e-9)


def test_gmacs_from_actual_token_counts_match_flop_counter():
    """A reduced eval forward at batch 1: the executed matmuls are the analytic count from the recorded tokens,
    plus the reduction's own similarity matmul (set A, the even positions past the class token, x set B, the odd
    ones, x head_dim per block; not part of the paper's count)."""
    model = make_model("cls", torch.float32)
    for blk in model.blocks:
        blk.attn.fused_attn = False
    ltmp.patch(model, "tome", r=[9, 4, 7])
    x = images(1, torch.float32)
    flops = counted_flops(model, x)
    rec = ltmp.stats(model)
    spec = ltmp.vit_spec(model, count_norm=False)
    analytic = float(ltmp.gmacs(spec, rec.kept)[0]) * 1e9
    overhead = sum(len(range(2, n, 2)) * len(range(1, n, 2)) * model.blocks[0].attn.head_dim for n in rec.padded[:-1])
    assert rec.kept.tolist() == [[55, 51, 44]]
    assert flops == pytest.approx(2 * (analytic + overhead), rel=1e-9)


def test_executed_gmacs_count_padding():
    model = make_model("cls", torch.float64)
    ltmp.patch(model, "ltmp", merge_threshold=0.8, prune_threshold=0.9 / 65)
    with torch.no_grad():
        model(images(4))
    rec = ltmp.stats(model)
    spec = ltmp.vit_spec(model)
    per_image = ltmp.gmacs(spec, rec.kept)
    executed = ltmp.gmacs_executed(spec, rec.padded)
    assert rec.padded[1:] == [int(k) + 1 for k in rec.kept.max(0).values]
    assert executed >= float(per_image.max()) - 1e-12
    assert float(per_image.min()) < executed < ltmp.dense_gmacs(spec)


@pytest.mark.parametrize("method,rate", [("tome", [20, 9, 5]), ("topk-prune", [30, 30, 30]), ("topk-mp", [9, 9, 9])])
def test_schedule_counts_are_the_counts_a_fixed_rate_model_keeps(method, rate):
    from ltmp.flops import schedule_counts

    model = make_model("cls")
    ltmp.patch(model, method, **({"r": rate} if method == "tome" else {"k": rate}))
    with torch.no_grad():
        model(images(3))
    kept = ltmp.stats(model).kept
    expected = schedule_counts(method, rate, 64)
    assert kept.tolist() == [expected] * 3, (kept.tolist(), expected)


@pytest.mark.parametrize("method", ["tome", "topk-prune", "topk-mp"])
def test_rate_schedule_lands_on_the_target_gmacs(method):
    from ltmp.flops import rate_schedule, schedule_counts

    with torch.device("meta"):
        model = timm.create_model("deit_small_patch16_224")
    spec = ltmp.vit_spec(model)
    target = 0.6 * ltmp.dense_gmacs(spec)
    sched = rate_schedule(spec, target, method)
    got = float(ltmp.gmacs(spec, torch.tensor([schedule_counts(method, sched, spec.num_patches)]))[0])
    assert abs(got - target) / target < 0.01, (sched, got, target)


def test_mlp_width_of_eq11_counts_a_gated_mlp_by_its_macs():
    """h of eq. 11 is fc1's width for a plain MLP, and for timm's SwiGLU the width that gives its MACs (3 C h'
    for hidden width h' = 2C h), so that r_FLOPs weighs the MLP by what it costs."""
    from timm.layers import SwiGLUPacked

    plain = make_model("cls")
    assert ltmp.vit_spec(plain).mlp_hidden == plain.blocks[0].mlp.fc1.out_features
    glu = timm.create_model(
        "vit_tiny_patch16_224",
        img_size=32,
        patch_size=4,
        embed_dim=48,
        depth=1,
        num_heads=3,
        mlp_layer=SwiGLUPacked,
        act_layer=torch.nn.SiLU,
    )
    mlp = glu.blocks[0].mlp
    macs = mlp.fc1.in_features * mlp.fc1.out_features + mlp.fc2.in_features * mlp.fc2.out_features
    assert ltmp.vit_spec(glu).mlp_hidden == round(macs / (2 * 48)) != mlp.fc1.out_features
