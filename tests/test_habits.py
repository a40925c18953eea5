"""What people habitually do with a timm ViT still works on a patched one, or is refused in one line
(docs/families.md, "Hooks and shapes"). Each habit and the test that holds it:

- hooks and pre-hooks on ``blocks[i]``, its attention, norms, MLP, ``attn.qkv``: refused in one line naming the module
  (eval and train) (``test_hooks_inside_a_block_are_refused``).
- hooks on the model itself: fire (``test_hooks_on_the_model_itself_fire_with_its_output``).
- ``forward_intermediates``: the reduced forward, per patch, record updated (``test_forward_intermediates_*``).
- ``set_grad_checkpointing(True)``: recomputes the reduced blocks (``test_grad_checkpointing_*``).
- ``reset_classifier(global_pool="avg")`` after LTP: keeps one patch token
  (``test_a_new_head_that_pools_the_patches_*``).
- ``forward_features`` of a batch: padding rows are 0 (``test_forward_features_of_a_batch_has_zero_padding_rows``).
- pickle, ``torch.save``, deepcopy: patched with its thresholds (``test_a_patched_model_saves_and_loads_patched``).
- ``torch.jit.script``: refused, naming ``ltmp export`` (``test_torchscript_is_refused_with_the_way_to_export``).
- GMACs at another image size: those of a model built at that size (``test_gmacs_at_another_image_size_*``).
- per-patch features: ``dense_output=True`` (tests/test_families.py ``test_dense_outputs_*``, ``test_hidden_states_*``).
- hooks and pickle in HF and OpenCLIP: as timm (tests/test_families.py
  ``test_hooks_in_blocks_are_refused_and_a_pickled_*``).
- bare ``ltmp``: usage (tests/test_cli.py ``test_bare_ltmp_prints_its_commands_and_exits_zero``).
- ``ltmp train --steps 10``: refused in one line (tests/test_bad_input.py, row "train --steps 1 ...").
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import re
import warnings

import pytest
import timm
import torch

import ltmp
from conftest import THRESHOLDS, images, make_model


def _ltmp(config: str = "cls", dtype=torch.float64, **kw):
    return ltmp.patch(make_model(config, dtype), "ltmp", **{**THRESHOLDS, **kw})


def _idle(model):
    """The model patched with LTMP thresholds that reduce nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "reduces no tokens"
        return ltmp.patch(model, "ltmp", merge_threshold=math.inf, prune_threshold=-math.inf)


HOOKED = ["blocks.1", "blocks.1.attn", "blocks.1.norm1", "blocks.1.norm2", "blocks.1.mlp", "blocks.1.attn.qkv"]
KINDS = {
    "forward": lambda m: m.register_forward_hook(lambda *a: None),
    "pre": lambda m: m.register_forward_pre_hook(lambda *a: None),
    "backward": lambda m: m.register_full_backward_hook(lambda *a: None),
}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("where", HOOKED)
def test_hooks_inside_a_block_are_refused(where, kind, train):
    """A patched block is one reduction step on packed rows: a hook on it or inside it would never fire or see
    other shapes than timm documents, so the forward refuses it in one line; once removed, the model runs."""
    model = _ltmp().train(train)
    handle = KINDS[kind](model.get_submodule(where))
    name = where.replace("blocks.1", "blocks[1]")
    with pytest.raises(ltmp.LtmpError, match=rf"^{re.escape(name)} has a hook, .* forward_intermediates"):
        model(images(2))
    handle.remove()
    model(images(2))


def test_hooks_on_the_model_itself_fire_with_its_output():
    model = _ltmp().eval()
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    model.head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        model(images(3))
    assert seen == [(3, 7), (3, 7)]


def test_forward_intermediates_runs_the_reduced_model_per_patch():
    """timm's forward_intermediates on a patched model: the reduced forward (the record says what it removed),
    each requested block's output per patch in timm's shapes; with nothing reduced, timm's own outputs."""
    plain = make_model("cls")
    x = images(2)
    with torch.no_grad():
        ref_final, ref = plain.forward_intermediates(x, indices=[0, 2], norm=True)
        idle_final, idle = _idle(copy.deepcopy(plain)).forward_intermediates(x, indices=[0, 2], norm=True)
        model = _ltmp().eval()
        final, inter = model.forward_intermediates(x, indices=2, output_fmt="NLC")
    for got, want in zip([idle_final, *idle], [ref_final, *ref]):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-10, rtol=0), (got - want).abs().max()
    assert [t.shape for t in inter] == [(2, 64, 48)] * 2 and final.shape == (2, 65, 48)
    rec = ltmp.stats(model)
    assert int(rec.merged.sum() + rec.pruned.sum()) > 0 and max(rec.padded[1:]) < rec.padded[0]


def test_forward_intermediates_prefix_and_dict_outputs_follow_timm():
    model = _ltmp().eval()
    with torch.no_grad():
        out = model.forward_intermediates(images(2), indices=[1], return_prefix_tokens=True, output_dict=True)
        only = model.forward_intermediates(images(2), indices=[1], intermediates_only=True)
    assert out["image_intermediates"][0].shape == (2, 48, 8, 8)
    assert out["image_intermediates_prefix"][0].shape == (2, 1, 48)
    assert out["image_features"].shape == (2, 65, 48)
    assert len(only) == 1 and torch.equal(only[0], out["image_intermediates"][0])
    with pytest.raises(ltmp.LtmpError, match="takes no attn_mask"):
        model.forward_intermediates(images(2), attn_mask=torch.ones(65, 65, dtype=torch.bool))


def test_grad_checkpointing_recomputes_the_reduced_blocks_with_the_same_gradients():
    """set_grad_checkpointing(True) checkpoints the patched blocks in train mode: same loss, same gradients to the
    thresholds, and the blocks run again in the backward (benchmarks/checkpointing.py measures the memory)."""
    x = images(4)
    grads = []
    for on in (False, True):
        model = _ltmp().train()
        model.set_grad_checkpointing(on)
        calls = []
        model.blocks[0].mlp.fc1.forward = _counting(model.blocks[0].mlp.fc1, calls)
        loss = model(x).square().mean() + ltmp.budget_loss(model, 0.5)
        forward_calls = len(calls)
        loss.backward()
        grads.append(torch.stack([p.grad for n, p in model.named_parameters() if "threshold" in n]))
        assert len(calls) == forward_calls * (2 if on else 1)
    assert torch.allclose(grads[0], grads[1], atol=1e-12, rtol=0), (grads[0] - grads[1]).abs().max()


def _counting(module, calls):
    forward = module.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    return counted


def test_a_new_head_that_pools_the_patches_is_read_at_forward_time():
    """Pruning leaves one patch token where the head reads them; that is decided at each forward, so a model
    patched with a class-token head and then given an average-pool head never prunes every patch token."""
    model = ltmp.patch(make_model("cls"), "ltp", prune_threshold=1.0).eval()  # prunes every patch it can
    with torch.no_grad():
        model(images(2))
    assert int(ltmp.stats(model).kept[:, -1].max()) == 0
    model.reset_classifier(10, global_pool="avg")
    model.head.double()
    with torch.no_grad():
        logits = model(images(2))
    assert torch.isfinite(logits).all() and int(ltmp.stats(model).kept.min()) == 1


def test_forward_features_of_a_batch_has_zero_padding_rows():
    """Images of a batch keep different token counts: the rows past an image's last token are 0, so a sum over
    the tokens divided by the image's tokens does not depend on the batch."""
    model = _ltmp().eval()
    x = images(4)
    with torch.no_grad():
        feats = model.forward_features(x)  # (B, N', C)
        kept = ltmp.stats(model).kept[:, -1] + 1  # tokens of each image, class token included
        singles = [model.forward_features(x[i : i + 1])[0] for i in range(4)]
    assert len(set(kept.tolist())) > 1, "the images should keep different numbers of tokens"
    for i, n in enumerate(kept.tolist()):
        assert torch.equal(feats[i, n:], torch.zeros_like(feats[i, n:]))
        mean = feats[i].sum(0) / n
        assert torch.allclose(mean, singles[i].mean(0), atol=1e-10, rtol=0)


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_a_patched_model_saves_and_loads_patched(how):
    model = _ltmp().eval()
    with torch.no_grad():
        model.blocks[1].merge_threshold.fill_(0.75)
    if how == "pickle":
        back = pickle.loads(pickle.dumps(model))
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
    else:
        back = copy.deepcopy(model)
    assert type(back) is type(model) and back.ltmp_config == model.ltmp_config
    assert float(back.blocks[1].merge_threshold.detach()) == 0.75
    x = images(3)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    assert torch.equal(ltmp.stats(back).kept, ltmp.stats(model).kept)
    ltmp.unpatch(back)
    assert type(back) is timm.models.vision_transformer.VisionTransformer


def test_torchscript_is_refused_with_the_way_to_export():
    model = _ltmp().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        with pytest.raises(ltmp.LtmpError, match=r"^torch.jit.script cannot compile a patched model .* `ltmp export`"):
            torch.jit.script(model)


def test_gmacs_at_another_image_size_match_a_model_built_at_that_size():
    """A dynamic_img_size model run at 40x48 costs what a model built for 40x48 costs: the spec follows the
    patches of the last forward."""
    kw = dict(img_size=32, patch_size=4, embed_dim=48, depth=3, num_heads=3, num_classes=7)
    dynamic = timm.create_model("vit_tiny_patch16_224", dynamic_img_size=True, **kw).eval()
    built = timm.create_model("vit_tiny_patch16_224", **{**kw, "img_size": (40, 48)})
    _idle(dynamic)
    with torch.no_grad():
        dynamic(torch.randn(1, 3, 40, 48))
    got = float(ltmp.gmacs(ltmp.vit_spec(dynamic), ltmp.stats(dynamic).kept)[0])
    assert got == pytest.approx(ltmp.dense_gmacs(ltmp.vit_spec(built)), rel=1e-12)
    assert ltmp.dense_gmacs(ltmp.vit_spec(built)) == pytest.approx(
        ltmp.dense_gmacs(ltmp.vit_spec(copy.deepcopy(built), image_size=(40, 48))), rel=1e-12
    )
    assert ltmp.vit_spec(dynamic, image_size=(32, 32)).num_patches == 64
