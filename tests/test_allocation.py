"""Where the thresholds reduce: the projected budget step, the shift that meets the budget, Adam per group, the
allocation record, and fixed-rate schedules that follow a learned allocation (issue #36)."""

from __future__ import annotations

import copy

import pytest
import torch

import ltmp
from conftest import THRESHOLDS, images, make_model
from ltmp.analysis import allocation
from ltmp.calibrate import calibrate, shift_to_budget
from ltmp.flops import rate_schedule, schedule_counts
from ltmp.record import r_flops
from ltmp.train import Dist, GroupAdam, projected_gradients, threshold_training_mode, threshold_units


def test_shift_to_budget_meets_a_step_function_within_tolerance():
    """r_FLOPs of a shift is piecewise constant (decisions are discrete): the search lands on a step within the
    tolerance, from either side, in few evaluations, and leaves the thresholds at the shift it returns."""
    applied = []

    def r_now() -> float:  # r rises in steps of 0.02 with the shift
        return 0.3 + 0.02 * (applied[-1] * 100 // 1)

    for target, increasing in ((0.5, True), (0.2, True)):
        shift, r, evals = shift_to_budget(applied.append, r_now, increasing, target, 0.005, 0.001, 2.0, 12)
        assert abs(r - target) <= 0.005 and applied[-1] == shift, (target, shift, r)
        assert evals <= 12
    # unreachable: the nearest evaluated shift (at the end of the range) is kept
    shift, r, _ = shift_to_budget(applied.append, lambda: 0.9, True, 0.5, 0.005, 0.01, 1.0, 8)
    assert r == 0.9 and applied[-1] == shift


def test_projected_gradient_leaves_r_flops_unchanged_to_first_order():
    """The step direction is the task loss's gradient minus its component along r_FLOPs' gradient (in threshold
    units): orthogonal to r_FLOPs' gradient there, and equal to the task gradient where that is orthogonal."""
    model = ltmp.patch(make_model("cls"), "ltmp", **THRESHOLDS)
    threshold_training_mode(model)
    merge = [blk.merge_threshold for blk in model.blocks]
    prune = [blk.prune_threshold for blk in model.blocks]
    x = images(4)
    out = model(x)
    task = out.logsumexp(-1).mean()
    g_task = torch.autograd.grad(task, merge + prune, retain_graph=True, allow_unused=True)
    g_r = torch.autograd.grad(r_flops(model).mean(), merge + prune, retain_graph=True)
    r = projected_gradients(model, task, merge, prune, Dist())
    units = threshold_units(model, merge, prune)
    step = torch.stack([p.grad.double() for p in merge + prune]) * units  # (P,) in threshold units
    n = torch.stack([g.double() for g in g_r]) * units
    g = torch.stack([torch.zeros((), dtype=torch.float64) if t is None else t.double() for t in g_task]) * units
    assert float(r.detach()) == pytest.approx(float(r_flops(model).mean()), abs=1e-6)
    assert abs(float(step @ n)) < 1e-6 * float(g.norm() * n.norm()), float(step @ n)  # float32 thresholds
    assert torch.allclose(step, g - (g @ n) / (n @ n) * n, rtol=1e-6, atol=1e-9)
    assert float(step.norm()) > 0.1 * float(g.norm())  # not projected away entirely


def test_group_adam_keeps_the_relative_size_of_gradients_within_a_group():
    """Adam normalises each parameter by its own gradient (both step by lr); Adam per group by the group's root
    mean square, so gradients 1 and 3 step by lr * 1/sqrt(5) and lr * 3/sqrt(5)."""
    a, b = torch.nn.Parameter(torch.zeros(())), torch.nn.Parameter(torch.zeros(()))
    opt = GroupAdam([a, b], lr=0.1)
    a.grad, b.grad = torch.tensor(1.0), torch.tensor(3.0)
    opt.step()
    assert float(a) == pytest.approx(-0.1 / 5**0.5) and float(b) == pytest.approx(-0.3 / 5**0.5)
    a2, b2 = torch.nn.Parameter(torch.zeros(())), torch.nn.Parameter(torch.zeros(()))
    adam = torch.optim.Adam([a2, b2], lr=0.1)
    a2.grad, b2.grad = torch.tensor(1.0), torch.tensor(3.0)
    adam.step()
    assert float(a2) == pytest.approx(-0.1, rel=1e-4) and float(b2) == pytest.approx(-0.1, rel=1e-4)


def test_allocation_records_quantiles_and_the_distance_to_one_shared_threshold():
    """Each threshold's quantile is the share of its block's candidates at or below it, so merging removes the
    rest and pruning removes that share; thresholds already shared by all blocks are their own shared
    allocation (nothing reallocated); thresholds that differ are reallocated against it."""
    model = ltmp.patch(make_model("cls", depth=3), "ltp", prune_threshold=0.012).eval()
    x = images(8)
    a = allocation(model, x, batch=3)
    assert a["merge_quantile"] is None and len(a["prune_quantile"]) == 3
    assert a["shared"]["threshold"] == pytest.approx(0.012, abs=2e-4)
    assert a["reallocated"] < 0.02 and a["shared"]["r_flops"] == pytest.approx(a["r_flops"], abs=0.01)
    model(x)
    rec = ltmp.stats(model)
    assert a["pruned"] == pytest.approx(rec.pruned.double().mean(0).tolist())
    before = [64.0] + rec.kept.double().mean(0).tolist()[:-1]  # candidates: the patch tokens entering each block
    for q, n, removed in zip(a["prune_quantile"], before, a["pruned"]):
        assert q * n == pytest.approx(removed, abs=1e-9)
    with torch.no_grad():
        model.blocks[0].prune_threshold.fill_(0.0)
        model.blocks[2].prune_threshold.fill_(0.03)
    b = allocation(model, x)
    assert b["pruned"][0] == 0 and b["reallocated"] > 0.2, b


def test_allocation_of_merging_counts_set_a_and_compares_with_a_merge_threshold():
    model = ltmp.patch(make_model("cls", depth=3), "ltmp", merge_threshold=0.8, prune_threshold=0.01).eval()
    x = images(6)
    a = allocation(model, x)
    model(x)
    rec = ltmp.stats(model)
    assert a["merged"] == pytest.approx(rec.merged.double().mean(0).tolist())
    assert all(0 <= q <= 1 for q in a["merge_quantile"] + a["prune_quantile"])
    assert sum(a["shared"]["pruned"]) == 0 and sum(a["shared"]["merged"]) > 0  # the shared threshold only merges
    ref = ltmp.patch(make_model("cls", depth=3), "ltmp", prune_threshold=0.0).eval()
    calibrate(ref, x, a["r_flops"], iters=14)
    assert float(ref.blocks[0].merge_threshold) == pytest.approx(a["shared"]["threshold"])


def test_allocation_says_when_an_operation_of_the_method_removed_nothing():
    """ltmp train and ltmp eval print the allocation; a method that prunes but pruned nothing (or merges but merged
    nothing) says so in one line, and a method that does both says nothing more."""
    from ltmp.analysis import format_allocation

    x = images(6)
    merge_only = allocation(
        ltmp.patch(make_model("cls", depth=3), "ltmp", merge_threshold=0.8, prune_threshold=0.0).eval(), x, shared=False
    )
    text = format_allocation(merge_only)
    assert text.splitlines()[-1] == "note: ltmp pruned no token in any block on these images: it ran as merging alone"
    both = allocation(
        ltmp.patch(make_model("cls", depth=3), "ltmp", merge_threshold=0.8, prune_threshold=0.02).eval(),
        x,
        shared=False,
    )
    assert sum(both["merged"]) > 0 and sum(both["pruned"]) > 0 and "note:" not in format_allocation(both)
    prune_only = allocation(
        ltmp.patch(make_model("cls", depth=3), "ltpm", merge_threshold=1.5, prune_threshold=0.02).eval(),
        x,
        shared=False,
    )
    assert format_allocation(prune_only).endswith(
        "ltpm merged no token in any block on these images: it ran as pruning alone"
    )


def test_rate_schedules_follow_a_shape_at_the_target_gmacs():
    """An even shape gives the even schedule; a learned model's per-layer counts as shape put the rate where it
    removed its tokens, still at the target GMACs."""
    with torch.device("meta"):
        model = make_model("cls", depth=6, dtype=torch.float32)
    spec = ltmp.vit_spec(model)
    target = 0.6 * ltmp.dense_gmacs(spec)
    assert rate_schedule(spec, target, "tome", [1.0] * 6) == rate_schedule(spec, target, "tome")
    shape = [0.0, 0.0, 6.0, 3.0, 1.0, 0.0]
    for method in ("tome", "topk-prune"):
        sched = rate_schedule(spec, target, method, shape)
        assert sched[0] == sched[1] == sched[5] == 0 and sched[2] > sched[3] > sched[4] > 0, sched
        got = float(ltmp.gmacs(spec, torch.tensor([schedule_counts(method, sched, spec.num_patches)]))[0])
        assert abs(got - target) / target < 0.02, (sched, got)
    with pytest.raises(ltmp.LtmpError, match="one weight per layer"):
        rate_schedule(spec, target, "tome", [1.0] * 5)


def test_deepcopy_keeps_allocation_inputs_untouched():
    """allocation() calibrates a copy for its shared comparison: the model's own thresholds stay."""
    model = ltmp.patch(make_model("cls", depth=3), "ltmp", merge_threshold=0.85, prune_threshold=0.01).eval()
    before = copy.deepcopy({n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("_threshold")})
    allocation(model, images(4))
    after = {n: p.detach() for n, p in model.named_parameters() if n.endswith("_threshold")}
    assert all(torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------ training decides where: a synthetic model

SYNTH_ARGS = dict(img_size=16, patch_size=4, embed_dim=8, depth=2, num_heads=1, num_classes=4)


@pytest.fixture(scope="module")
def redundant_last_block(tmp_path_factory):
    """A two-block ViT whose first block's patch tokens are all needed and whose last block's are redundant, and
    random images (its data). Block 1 is an identity with peaked attention (its importance scores vary); in block
    2 the class token's query is zero, so it averages the values of every token alive: a token pruned in block 1
    changes the output, one pruned in block 2 (after its attention) changes nothing, since only the class token
    is read after it. A threshold shared by both blocks prunes mostly in block 1."""
    import timm
    from PIL import Image
    from timm.models._hub import save_for_hf

    root = tmp_path_factory.mktemp("redundant")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", **SYNTH_ARGS)
    with torch.no_grad():
        model.cls_token.zero_()
        model.pos_embed[:, 0].zero_()
        model.pos_embed[:, 1:].normal_(0, 0.5)
        first, last = model.blocks
        for blk in (first, last):
            blk.attn.qkv.weight[:16].mul_(4)  # peaked queries and keys
            blk.attn.qkv.bias.zero_()
            blk.attn.proj.bias.zero_()
            blk.mlp.fc2.weight.zero_()
            blk.mlp.fc2.bias.zero_()
            blk.norm1.bias.zero_()  # the class token stays 0 into block 2, so its query there is 0
        first.attn.qkv.weight[16:].zero_()
        first.attn.proj.weight.zero_()
        model.head.weight.mul_(20)
    save_for_hf(
        model,
        str(root / "model"),
        model_args=SYNTH_ARGS,
        safe_serialization=True,
        data_config=dict(input_size=(3, 16, 16), crop_pct=1.0, mean=(0.5,) * 3, std=(0.25,) * 3),
    )
    g = torch.Generator().manual_seed(0)
    for c in range(4):
        folder = root / "data" / "train" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(12):
            img = (torch.rand(3, 16, 16, generator=g) * 255).byte().permute(1, 2, 0).numpy()
            Image.fromarray(img).save(folder / f"{i:02d}.png")
    return f"local-dir:{root / 'model'}", str(root / "data")


def pruned_after_training(model: str, data: str, out, **recipe) -> dict:
    from ltmp.train import TrainConfig, train

    cfg = TrainConfig(
        model=model,
        pretrained=True,
        data_dir=data,
        output=str(out),
        r_target=0.85,
        method="ltp",
        batch_size=16,
        steps=150,
        workers=0,
        augment="none",
        eval_after=False,
        distill=1.0,
        **recipe,
    )
    return train(cfg, progress=False)["allocation"]


@pytest.mark.parametrize(
    "recipe",
    [
        dict(optimizer="sgd", lr_prune=3e-3),  # the default of the methods that merge; 1e-3 to 1e-2 all pass
        dict(budget="projected", optimizer="group"),  # the budget met by a shift after each step
    ],
    ids=["sgd", "projected"],
)
def test_training_prunes_the_redundant_block_more_than_a_shared_threshold(redundant_last_block, tmp_path, recipe):
    """The task loss (distillation from the unreduced model, so every change costs) says where to prune: training
    moves the pruning into block 2, where it is free, while a shared threshold at the same r_FLOPs prunes mostly in
    block 1. The budget as a penalty with Adam per parameter (``--optimizer adam``) moves every threshold in
    lockstep and ends where the shared threshold is.

    SGD's steps are in the units of the gradient: on this toy the default learning rate for 150 steps
    (5e-6 * 9809 / 150 = 3.3e-4) leaves the thresholds short of where the loss leads them (they get there after
    about 1,000 steps), so the test sets it."""
    model, data = redundant_last_block
    a = pruned_after_training(model, data, tmp_path / "recipe", **recipe)
    assert a["r_flops"] == pytest.approx(0.85, abs=0.01)
    assert a["pruned"][1] > a["shared"]["pruned"][1] + 5, a  # about 10 of 16 tokens against 0.2
    assert a["pruned"][0] < 0.5 * a["shared"]["pruned"][0], a
    before = pruned_after_training(model, data, tmp_path / "before", optimizer="adam")  # the penalty, Adam
    assert before["pruned"][1] < before["shared"]["pruned"][1] + 1 and before["reallocated"] < 0.1, before
