"""ltmp.patch on timm ViTs: train and eval decide identically, batches equal single images, thresholds learn."""

from __future__ import annotations

import math
import warnings

import pytest
import timm
import torch

import ltmp
from conftest import CONFIGS, THRESHOLDS, images, make_model

LEARNED = ["ltmp", "ltpm", "ltm", "ltp"]
FIXED = [("tome", dict(r=6)), ("topk-prune", dict(k=5)), ("topk-mp", dict(k=3))]
ALL = [(m, THRESHOLDS) for m in LEARNED] + FIXED


def patched(config: str, method: str, options: dict, dtype=torch.float64, **kw):
    model = make_model(config, dtype)
    return ltmp.patch(model, method, **options, **kw)


@pytest.mark.parametrize("method,options", ALL, ids=[m for m, _ in ALL])
def test_train_mode_equals_eval_mode(config, method, options):
    model = patched(config, method, options)
    x = images(4)
    model.train()
    train_logits = model(x)
    train = ltmp.stats(model)
    model.eval()
    with torch.no_grad():
        eval_logits = model(x)
    ev = ltmp.stats(model)
    assert int(ev.merged.sum() + ev.pruned.sum()) > 0, "the test thresholds must reduce something"
    for field in ("merged", "pruned", "kept"):
        assert torch.equal(getattr(train, field), getattr(ev, field)), field
    assert torch.allclose(train_logits, eval_logits, atol=1e-6, rtol=0), (train_logits - eval_logits).abs().max()
    assert max(ev.padded[1:]) < ev.padded[0], "eval mode must really remove tokens"


@pytest.mark.parametrize("method", ["ltmp", "ltm", "ltp"])
def test_attention_in_groups_equals_the_padded_batch(config, method, monkeypatch):
    """On the CPU a padded eval batch runs attention per group of images of similar token counts where that pays;
    nothing else may change."""
    from ltmp import engine

    model = patched(config, method, THRESHOLDS)
    x = images(6)
    plans = []
    real = engine.plan_groups
    monkeypatch.setattr(engine, "plan_groups", lambda *a: plans.append(real(*a)) or plans[-1])
    monkeypatch.setitem(engine.TUNING, "cpu", dict(group_macs=0.0, max_groups=4))  # tiny models: whenever it helps
    with torch.no_grad():
        grouped = model(x)
        kept = ltmp.stats(model).kept
        assert any(p is not None for p in plans), "some block must group the batch"
        monkeypatch.setitem(engine.TUNING, "cpu", dict(group_macs=None, max_groups=1))  # never group
        plans.clear()
        whole = model(x)
        assert not plans
    assert torch.equal(ltmp.stats(model).kept, kept)
    assert torch.allclose(grouped, whole, atol=1e-12, rtol=0), (grouped - whole).abs().max()


@pytest.mark.parametrize("method,options", ALL, ids=[m for m, _ in ALL])
def test_batch_equals_single_images(config, method, options):
    model = patched(config, method, options)
    x = images(5)
    with torch.no_grad():
        batch = model(x)
        kept = ltmp.stats(model).kept
        singles = []
        for i in range(len(x)):
            singles.append(model(x[i : i + 1]))
            assert torch.equal(ltmp.stats(model).kept[0], kept[i])
    singles = torch.cat(singles)
    assert torch.allclose(batch, singles, atol=1e-6, rtol=0), (batch - singles).abs().max()
    if ltmp.METHODS[method][1] == "threshold":
        assert len(set(kept[:, -1].tolist())) > 1, "images should keep different numbers of tokens"


@pytest.mark.parametrize("batch", [1, 3])
def test_merge_similarities_are_float32_under_autocast(batch, monkeypatch):
    """bf16 rounds similarities near 1 to steps of 1/256, which moves merge decisions; the single-image path
    (batch 1) and the batched one must both compare float32 scores with the threshold."""
    model = patched("cls", "ltmp", THRESHOLDS, dtype=torch.float32).eval()
    seen = []
    real = ltmp.ops.match

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out[0].dtype)
        return out

    monkeypatch.setattr(ltmp.ops, "match", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(images(batch, torch.float32))
    assert seen and set(seen) == {torch.float32}, seen


def test_train_equals_eval_in_float32():
    """In fp32 decisions agree as long as no score sits within ~1e-5 of its threshold (true for this input)."""
    model = patched("cls", "ltmp", THRESHOLDS, dtype=torch.float32)
    x = images(4, torch.float32)
    model.train()
    a = model(x)
    ka = ltmp.stats(model).kept
    model.eval()
    with torch.no_grad():
        b = model(x)
    assert torch.equal(ka, ltmp.stats(model).kept)
    assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()


def _idle_patch_logits(model, x):
    """The model's logits, then its logits once patched with LTMP thresholds that reduce nothing."""
    with torch.no_grad():
        ref = model(x)
    with pytest.warns(UserWarning, match="reduces no tokens"):
        ltmp.patch(model, "ltmp", merge_threshold=math.inf, prune_threshold=-math.inf)
    with torch.no_grad():
        return ref, model(x)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_no_reduction_reproduces_unpatched_logits(config, train):
    model = make_model(config, torch.float32)
    x = images(3, torch.float32)
    model.train(train)
    ref, out = _idle_patch_logits(model, x)
    assert ltmp.stats(model).kept.eq(64).all()
    assert torch.allclose(out, ref, atol=1e-5, rtol=0), (out - ref).abs().max()


def test_every_threshold_gets_a_gradient(config):
    model = patched(config, "ltmp", THRESHOLDS)
    for p in model.parameters():
        p.requires_grad_(False)
    thresholds = {n: p for n, p in model.named_parameters() if n.endswith("threshold")}
    for p in thresholds.values():
        p.requires_grad_(True)
    assert len(thresholds) == 2 * len(model.blocks)
    model.train()
    x = images(4).requires_grad_(True)
    logits = model(x)
    ce = torch.nn.functional.cross_entropy(logits, torch.arange(4) % 7)
    grads_ce = torch.autograd.grad(ce, list(thresholds.values()), retain_graph=True, allow_unused=True)
    loss = ce + 10 * ltmp.budget_loss(model, 0.5)
    loss.backward()
    for name, p in thresholds.items():
        assert p.grad is not None and p.grad.abs() > 0 and torch.isfinite(p.grad), name
    last = len(model.blocks) - 1
    for name, g in zip(thresholds, grads_ce):
        if name.startswith(f"blocks.{last}.") and model.global_pool == "token":
            # the last block's reduction precedes only its MLP and class-token pooling: CE cannot see it
            assert g is None or g.abs().max() == 0, name


def test_training_after_an_inference_mode_forward():
    # nothing a forward keeps for reuse may be an inference-mode tensor that a later training step saves for backward
    model = patched("cls", "ltmp", THRESHOLDS)
    with torch.inference_mode():
        model.eval()(images(4))
    model.train()
    loss = torch.nn.functional.cross_entropy(model(images(4)), torch.arange(4)) + ltmp.budget_loss(model, 0.5)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith("threshold"))


def test_budget_loss_keeps_its_gradient_when_the_record_is_first_read_without_gradients():
    model = patched("cls", "ltmp", THRESHOLDS).train()
    model(images(4))
    with torch.no_grad():  # e.g. logging r_FLOPs before the loss
        ltmp.r_flops(model)
    assert ltmp.budget_loss(model, 0.5).requires_grad


@pytest.mark.parametrize("method,options", FIXED, ids=[m for m, _ in FIXED])
def test_fixed_rates_in_eval_pass_gradients_to_the_input(method, options):
    """Saliency maps and attacks backpropagate through an eval-mode model: the static step's input gradient
    equals the masked (train-mode) step's."""
    model = patched("cls", method, options)
    x = images(2).requires_grad_()
    model.eval()
    model(x).sum().backward()
    static = x.grad.clone()
    x.grad = None
    model.train()
    model(x).sum().backward()
    assert torch.allclose(x.grad, static, atol=1e-10, rtol=0), (x.grad - static).abs().max()


def test_fixed_rate_methods_have_no_thresholds():
    model = patched("cls", "tome", dict(r=4))
    assert not [n for n, _ in model.named_parameters() if "threshold" in n]


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_tome_merges_exactly_r_per_layer(config_name):
    model = make_model(config_name)
    prefix = model.num_prefix_tokens
    for r in (5, 40):
        ltmp.patch(model, "tome", r=r)
        with torch.no_grad():
            model(images(2))
        rec = ltmp.stats(model)
        tokens = 64 + prefix
        for layer in range(len(model.blocks)):
            expect = min(r, (tokens - prefix) // 2)
            assert rec.merged[:, layer].eq(expect).all(), (layer, rec.merged[:, layer], expect)
            tokens -= expect


def test_per_layer_rates():
    model = patched("cls", "tome", dict(r=[6, 3, 0]))
    with torch.no_grad():
        model(images(2))
    assert ltmp.stats(model).merged.tolist() == [[6, 3, 0]] * 2
    with pytest.raises(ValueError, match="list of 3"):
        ltmp.patch(model, "tome", r=[1, 2])


@pytest.mark.parametrize("n", [1, 3], ids=["single", "batch"])
@pytest.mark.parametrize("method", ["ltmp", "ltpm", "ltp", "topk-prune"])
def test_prefix_tokens_survive_extreme_pruning(config, method, n):
    options = dict(k=100) if method == "topk-prune" else dict(merge_threshold=-2.0, prune_threshold=10.0)
    model = patched(config, method, options, trace_source=True)
    with torch.no_grad():
        out = model(images(n))
    rec = ltmp.stats(model)
    assert torch.isfinite(out).all()
    prefix = model.num_prefix_tokens
    assert all(k[:, :prefix].all() for k in rec.keeps)
    expected_min = 1 if (model.global_pool == "avg" or prefix == 0) else 0
    assert rec.kept[:, -1].eq(expected_min).all(), rec.kept


@pytest.mark.parametrize("n", [1, 3], ids=["single", "batch"])
def test_merge_sizes_add_up_and_sources_partition_patches(config, n):
    model = patched(config, "ltmp", THRESHOLDS, trace_source=True)
    with torch.no_grad():
        model(images(n))
    rec = ltmp.stats(model)
    for layer, (src, keep) in enumerate(zip(rec.sources, rec.keeps)):
        covered = (src * keep[..., None]).sum(1)  # (B, n) how often each patch is still covered
        assert covered.le(1).all()  # no patch in two surviving tokens
        merged_only = rec.pruned[:, : layer + 1].sum(1) == 0
        assert covered[merged_only].eq(1).all()  # without pruning every patch is still covered


def test_record_is_overwritten_not_consumed():
    model = patched("cls", "ltmp", THRESHOLDS)
    with torch.no_grad():
        model(images(2))
        a = ltmp.stats(model)
        assert ltmp.stats(model) is a  # reading twice gives the same record
        model(images(3))
    assert ltmp.stats(model) is not a and ltmp.stats(model).kept.shape == (3, 3)


def test_r_flops_is_one_without_reduction_and_matches_eq13_by_hand():
    model = patched("cls", "tome", dict(r=[10, 0, 5]))
    with torch.no_grad():
        model(images(2))
    n, d, h, L = 64, 48, 192, 3
    m = [1.0, (64 - 10) / 64, (64 - 10) / 64, (64 - 15) / 64]

    def phi_msa(f):
        return 4 * f * n * d * d + 2 * (f * n) ** 2 * d

    def phi_mlp(f):
        return 2 * f * n * d * h

    expect = sum(phi_msa(m[i]) + phi_mlp(m[i + 1]) for i in range(L)) / (L * (phi_msa(1) + phi_mlp(1)))
    assert torch.allclose(ltmp.r_flops(model), torch.tensor([expect] * 2, dtype=torch.float64), atol=1e-12)
    ltmp.patch(model, "tome", r=0)
    with torch.no_grad():
        model(images(2))
    assert torch.allclose(ltmp.r_flops(model), torch.ones(2, dtype=torch.float64))


def test_budget_loss_rejects_targets_outside_unit_interval():
    model = patched("cls", "ltmp", THRESHOLDS)
    with torch.no_grad():
        model(images(1))
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=r"r_target must lie in \(0, 1\]"):
            ltmp.budget_loss(model, bad)


def test_unpatch_restores_plain_model_and_plain_checkpoints_load():
    model = make_model("cls", torch.float32)
    cls = type(model)
    keys = list(model.state_dict())
    x = images(2, torch.float32)
    with torch.no_grad():
        ref = model(x)
    plain_state = {k: v.clone() for k, v in model.state_dict().items()}
    ltmp.patch(model, "ltmp", **THRESHOLDS)
    assert type(model) is not cls and isinstance(model, cls)
    names = [n for n, _ in model.named_parameters() if "threshold" in n]
    assert names and all(n.endswith(("merge_threshold", "prune_threshold")) for n in names)
    model.load_state_dict(plain_state)  # strict: thresholds may be missing from a timm checkpoint
    assert model.blocks[0].merge_threshold.item() == pytest.approx(0.8)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict({**plain_state, "bogus": torch.zeros(1)})
    ltmp.unpatch(model)
    assert type(model) is cls and list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_repatching_replaces_the_previous_patch():
    model = patched("cls", "ltmp", THRESHOLDS)
    ltmp.patch(model, "tome", r=2)
    assert not [n for n, _ in model.named_parameters() if "threshold" in n]
    with torch.no_grad():
        model(images(1))
    assert ltmp.stats(model).merged.eq(2).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_train_forward_and_backward_are_finite(dtype):
    model = patched("cls", "ltmp", THRESHOLDS, dtype=torch.float32).train()
    with torch.autocast("cpu", dtype=dtype):
        logits = model(images(2, torch.float32))
        loss = logits.float().logsumexp(-1).mean() + 10 * ltmp.budget_loss(model, 0.5)
    loss.backward()
    assert torch.isfinite(logits).all()
    for n, p in model.named_parameters():
        if n.endswith("threshold"):
            assert torch.isfinite(p.grad), n


def test_warns_when_patch_changes_nothing():
    model = make_model("cls")
    with pytest.warns(UserWarning, match="reduces no tokens"):
        ltmp.patch(model, "tome", r=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ltmp.patch(model, "tome", r=1)


def test_unsupported_models_get_clear_errors():
    eva = timm.create_model("eva02_tiny_patch14_224", img_size=28, depth=1)
    with pytest.raises(TypeError, match=r"Eva \(rotary position attention\); it supports"):
        ltmp.patch(eva, "ltmp")
    relpos = timm.create_model("vit_relpos_small_patch16_224", img_size=32, depth=1)
    with pytest.raises(TypeError, match=r"relative-position attention\); it supports"):
        ltmp.patch(relpos, "ltmp")
    nocls = make_model("no-cls-avg")
    with pytest.raises(ValueError, match="importance='cls' .* needs a class token"):
        ltmp.patch(nocls, "ltmp", importance="cls")
    with pytest.raises(ValueError, match="unknown method 'ltmpp'; choose one of: ltmp, ltpm"):
        ltmp.patch(nocls, "ltmpp")
    with pytest.raises(ValueError, match="needs r="):
        ltmp.patch(nocls, "tome")
    assert getattr(nocls, "ltmp_config", None) is None  # a failed patch leaves the model untouched


def test_class_attention_importance_runs_and_records_choice(tmp_path):
    model = patched("cls", "ltp", dict(prune_threshold=0.2), importance="cls")
    with torch.no_grad():
        model(images(2))
    assert ltmp.stats(model).pruned.sum() > 0


@pytest.mark.parametrize(
    "method,options",
    [
        ("ltmp", THRESHOLDS),
        ("ltpm", THRESHOLDS),
        ("ltm", THRESHOLDS),
        ("tome", dict(r=6)),
        ("topk-prune", dict(k=5)),
        ("topk-mp", dict(k=3)),
    ],
)
@pytest.mark.parametrize("batch", [1, 4])
def test_eval_host_synchronisations(method, options, batch):
    """Fixed rates read nothing back from the device (token counts follow from the shapes); learned thresholds
    once per block (each compaction's counts), at any batch size; reading the record reads nothing more."""
    from ltmp.runtime import HostSyncs

    model = patched("cls", method, options, dtype=torch.float32).eval()
    with torch.no_grad(), HostSyncs() as syncs:
        model(images(batch, torch.float32))
    assert max(ltmp.stats(model).padded[1:]) < 65  # tokens were really removed
    if ltmp.METHODS[method][1] == "topk":
        assert syncs.calls == {}
    else:
        assert syncs.calls == {"tolist": len(model.blocks)}
        with HostSyncs() as reads:
            rec = ltmp.stats(model)
            counts = rec.merged + rec.pruned + rec.kept  # (B, L)
        assert reads.calls == {}, reads.calls
        before = torch.cat([torch.full((batch, 1), 64), rec.kept[:, :-1]], 1)  # (B, L) patch tokens entering
        assert torch.equal(counts, before)


def test_host_sync_counter_sees_reads():
    from ltmp.runtime import HostSyncs

    x = torch.tensor([1.0, 0.0, 2.0])
    with HostSyncs() as syncs:
        x.tolist(), x.sum().item(), bool(x[0] > 0), x.nonzero(), x[x > 0], int(x.sum())
        torch.nonzero_static(x, size=2), x[1:], x * 2  # no reads
    assert syncs.calls == {"tolist": 1, "item": 1, "__bool__": 1, "nonzero": 1, "__getitem__": 1, "__int__": 1}


def test_forward_cut_is_the_dense_model_when_nothing_is_cut(config):
    from ltmp.adapters.timm import forward_cut

    model = make_model(config).eval()
    x = images(2)
    n = model.patch_embed.num_patches + model.num_prefix_tokens
    with torch.no_grad():
        assert torch.allclose(forward_cut(model, x, [n] * len(model.blocks)), model(x), atol=1e-12, rtol=0)
        cut = forward_cut(model, x, [n - 4 * (i + 1) for i in range(len(model.blocks))])
    assert cut.shape == (2, model.num_classes)


def test_forward_cut_needs_a_count_per_block():
    from ltmp.adapters.timm import forward_cut

    model = make_model("cls").eval()
    with pytest.raises(ValueError, match=r"forward_cut needs one token count per block \(\d+\), got 1"):
        forward_cut(model, images(1), [10])


def test_gelu_never_writes_over_the_residual_stream_when_fc1_returns_its_input():
    """A block whose MLP has no norm2 and an identity fc1 (say, after surgery) hands the GELU the residual stream
    itself: the in-place GELU must not run there. Same logits as the unpatched model with no reduction."""
    model = make_model("cls", torch.float32).eval()
    for blk in model.blocks:
        blk.norm2, blk.mlp.fc1 = torch.nn.Identity(), torch.nn.Identity()
        blk.mlp.fc2 = torch.nn.Linear(blk.mlp.fc2.out_features, blk.mlp.fc2.out_features).requires_grad_(False)
        torch.nn.init.zeros_(blk.mlp.fc2.weight)
    x = images(2, torch.float32)
    ref, out = _idle_patch_logits(model, x)
    assert torch.allclose(out, ref, atol=1e-5, rtol=0), (out - ref).abs().max()
