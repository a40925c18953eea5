"""ltmp.patch beyond timm (issue #19): transformers and OpenCLIP models keep every guarantee timm models have.

Small randomly initialised models of each supported family (no downloads), float64 so that no score near a
threshold flips a decision; a timm model runs beside them as the control.
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch
from torch import nn

import ltmp
from conftest import THRESHOLDS, images, make_model

T = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")

SIZE = dict(
    hidden_size=48, num_hidden_layers=3, num_attention_heads=3, intermediate_size=96, image_size=32, patch_size=4
)


def _hf(cls: str, config: str, **kw):
    return lambda: getattr(T, cls)(getattr(T, config)(**SIZE, **kw))


def _open_clip(**kw):
    from open_clip.transformer import VisionTransformer

    return lambda: VisionTransformer(
        image_size=32, patch_size=4, width=48, layers=3, heads=3, mlp_ratio=2.0, output_dim=16, **kw
    )


def _zero_shot():
    from ltmp.adapters.open_clip import ZeroShotClassifier

    visual = _open_clip()()
    return ZeroShotClassifier(visual, torch.randn(7, 16, generator=torch.Generator().manual_seed(3)), 10.0)


FAMILIES = {
    "timm": lambda: make_model("cls"),
    "hf-vit": _hf("ViTForImageClassification", "ViTConfig", num_labels=7),
    "hf-vit-model": _hf("ViTModel", "ViTConfig"),
    "hf-deit-teacher": _hf("DeiTForImageClassificationWithTeacher", "DeiTConfig", num_labels=7),
    "hf-dinov2-registers": _hf("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", num_register_tokens=4),
    "hf-dinov2-cls": _hf("Dinov2ForImageClassification", "Dinov2Config", num_labels=7),
    "hf-clip": _hf("CLIPVisionModelWithProjection", "CLIPVisionConfig", projection_dim=16),
    "hf-siglip": _hf("SiglipVisionModel", "SiglipVisionConfig"),
    "open-clip": _open_clip(),
    "open-clip-avg": _open_clip(pool_type="avg", final_ln_after_pool=True, ls_init_value=0.5),
    "open-clip-zero-shot": _zero_shot,
}
PREFIX = {
    "timm": 1,
    "hf-vit": 1,
    "hf-vit-model": 1,
    "hf-deit-teacher": 2,
    "hf-dinov2-registers": 5,
    "hf-dinov2-cls": 1,
    "hf-clip": 1,
    "hf-siglip": 0,
    "open-clip": 1,
    "open-clip-avg": 1,
    "open-clip-zero-shot": 1,
}
LEARNED = ["ltmp", "ltpm", "ltm", "ltp"]
FIXED = [("tome", dict(r=6)), ("topk-prune", dict(k=5)), ("topk-mp", dict(k=3))]
ALL = [(m, THRESHOLDS) for m in LEARNED] + FIXED


def make(family: str, seed: int = 0) -> nn.Module:
    """A random model of the family, float64, eval, with attention as peaked as the timm test models'."""
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    if not family.startswith("timm"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if (
                    name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "in_proj_weight"))
                    and "head." not in name
                ):
                    p.mul_(6.0)
    return model.double().eval()


def output(out) -> torch.Tensor:
    """The tensor a family's output object carries: logits, image embeddings or the pooled features."""
    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "image_embeds", "pooler_output"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    raise AssertionError(f"no output tensor in {type(out).__name__}")


@pytest.fixture(params=list(FAMILIES))
def family(request) -> str:
    return request.param


def test_prefix_tokens_and_family_are_found(family):
    model = make(family)
    adapter = ltmp.adapters.adapter_for(model)
    assert adapter.num_prefix(model) == PREFIX[family]
    assert adapter.family == family.split("-")[0].replace("hf", "transformers").replace("open", "open_clip")
    assert len(ltmp.patching.blocks(model)) == 3


@pytest.mark.parametrize("method,options", ALL, ids=[m for m, _ in ALL])
def test_train_mode_equals_eval_mode(family, method, options):
    model = ltmp.patch(make(family), method, **options)
    x = images(4)
    model.train()
    train_out = output(model(x))
    train = ltmp.stats(model)
    model.eval()
    with torch.no_grad():
        eval_out = output(model(x))
    ev = ltmp.stats(model)
    assert int(ev.merged.sum() + ev.pruned.sum()) > 0, "the test thresholds must reduce something"
    for field in ("merged", "pruned", "kept"):
        assert torch.equal(getattr(train, field), getattr(ev, field)), field
    assert torch.allclose(train_out, eval_out, atol=1e-6, rtol=0), (train_out - eval_out).abs().max()
    assert max(ev.padded[1:]) < ev.padded[0], "eval mode must really remove tokens"


@pytest.mark.parametrize("method,options", [ALL[0], FIXED[0]], ids=["ltmp", "tome"])
def test_batch_equals_single_images(family, method, options):
    model = ltmp.patch(make(family), method, **options)
    x = images(4)
    with torch.no_grad():
        batch = output(model(x))
        kept = ltmp.stats(model).kept
        singles = torch.cat([output(model(x[i : i + 1])) for i in range(4)])
    assert torch.allclose(batch, singles, atol=1e-6, rtol=0), (batch - singles).abs().max()
    if method == "ltmp":
        assert len(set(kept[:, -1].tolist())) > 1, "images should keep different numbers of tokens"


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_no_reduction_reproduces_the_unpatched_model(family, train):
    model = make(family)
    x = images(3)
    with torch.no_grad():
        expected = output(model(x))
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "reduces no tokens"
        ltmp.patch(patched, "ltmp", merge_threshold=math.inf, prune_threshold=-math.inf)
    patched.train(train)
    with torch.no_grad():
        got = output(patched(x))
    assert torch.allclose(got, expected, atol=1e-6, rtol=0), (got - expected).abs().max()
    ltmp.unpatch(patched)
    assert type(patched) is type(model) and not any("threshold" in n for n, _ in patched.named_parameters())


def test_every_threshold_gets_a_gradient(family):
    model = ltmp.patch(make(family), "ltmp", **THRESHOLDS).train()
    out = output(model(images(4)))
    loss = out.square().mean() + ltmp.budget_loss(model, 0.6)
    loss.backward()
    for i, blk in enumerate(ltmp.patching.blocks(model)):
        for name in ltmp.patching.THRESHOLD_NAMES:
            g = getattr(blk, name).grad
            assert g is not None and g != 0, (i, name, g)


def test_threshold_files_record_the_family_and_reload(family, tmp_path):
    model = ltmp.patch(make(family), "ltmp", **THRESHOLDS)
    path = tmp_path / "t.safetensors"
    ltmp.save_thresholds(model, path)
    _, meta = ltmp.read_thresholds(path)
    assert meta["family"] == ltmp.adapters.adapter_for(model).family
    assert meta["num_prefix_tokens"] == str(PREFIX[family])
    fresh = ltmp.load_thresholds(make(family), path)
    x = images(2)
    with torch.no_grad():
        assert torch.equal(output(fresh(x)), output(model(x)))


def test_analytic_count_matches_the_executed_flops(family):
    """Dense GMACs from the family's spec equal what torch.utils.flop_counter counts in a patched forward that
    reduces nothing (pruning only: explicit attention matmuls, which the counter sees; no similarity matmul; eq. 17's
    importance is a mean over queries and heads, not a matrix product, where no row is padding)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = make(family).float()
    spec = ltmp.vit_spec(model, count_norm=False)  # flop_counter skips LayerNorm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ltmp.patch(model, "ltp", prune_threshold=-math.inf)
    model.requires_grad_(False)  # the counter's module tracker trips over nn.MultiheadAttention's parameters
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(images(1, torch.float32))
    assert counter.get_total_flops() == pytest.approx(2 * ltmp.dense_gmacs(spec) * 1e9, rel=1e-9)


@pytest.mark.parametrize("family", ["hf-vit", "hf-dinov2-cls"])
def test_classification_models_return_their_loss(family):
    model = ltmp.patch(make(family), "ltmp", **THRESHOLDS)
    labels = torch.tensor([0, 3])
    out = model(pixel_values=images(2), labels=labels)
    assert torch.allclose(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))


def _dup_by_size(x: torch.Tensor, size: list[int], keep: list[bool]) -> torch.Tensor:
    """(1, N, C) -> (1, N', C): each surviving token repeated as many times as the patches it stands for."""
    rows = [x[0, i : i + 1].expand(s, -1) for i, (s, k) in enumerate(zip(size, keep)) if k]
    return torch.cat(rows)[None]


def _state(size: list[int], keep: list[bool]):
    from ltmp.step import Layout, TokenState

    return TokenState(
        size=torch.tensor([size], dtype=torch.float64),
        layout=Layout(1, len(size)),
        keep=torch.tensor([keep], dtype=torch.float64),
        merged_once=True,
    )


SIZES, KEEP = [1, 3, 1, 2, 1, 4], [True, True, False, True, True, False]


def test_attention_pool_heads_weigh_merged_tokens_by_size():
    """SigLIP's and timm's attention-pool (MAP) heads over reduced tokens equal the heads over the tokens each
    survivor stands for: a merged token of size s counts s times, removed and padding tokens not at all."""
    from timm.layers import AttentionPoolLatent

    from ltmp.adapters import pool_bias
    from ltmp.adapters.hf import siglip_pool

    torch.manual_seed(0)
    x = torch.randn(1, len(SIZES), 48, dtype=torch.float64)
    state = _state(SIZES, KEEP)
    siglip = make("hf-siglip").head
    timm_pool = AttentionPoolLatent(48, num_heads=3).double().eval()
    dup = _dup_by_size(x, SIZES, KEEP)
    with torch.no_grad():
        got, expected = siglip_pool(siglip, x, pool_bias(state, x.dtype)), siglip_pool(siglip, dup, None)
        assert torch.allclose(got, expected, atol=1e-12, rtol=0), (got - expected).abs().max()
        got, expected = timm_pool(x, attn_mask=pool_bias(state, x.dtype)[:, None, None]), timm_pool(dup)
        assert torch.allclose(got, expected, atol=1e-12, rtol=0), (got - expected).abs().max()


def test_mean_pool_weighs_merged_tokens_by_size():
    from ltmp.adapters import mean_pool

    x = torch.randn(1, len(SIZES), 5, dtype=torch.float64)
    got = mean_pool(x, _state(SIZES, KEEP), 1)
    expected = _dup_by_size(x[:, 1:], SIZES[1:], KEEP[1:]).mean(1)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)


def test_models_outside_the_families_are_refused_with_what_is_supported():
    with pytest.raises(
        TypeError,
        match=r"^ltmp.patch cannot handle BeitModel; it supports transformers \(5.x\) "
        r"ViTModel, ",
    ):
        ltmp.patch(T.BeitModel(T.BeitConfig(**SIZE)))
    with pytest.raises(
        TypeError,
        match=r"^ltmp.patch cannot handle Linear \(torch.nn.modules.linear\); it supports "
        r"timm VisionTransformer .*; transformers .*; open_clip VisionTransformer",
    ):
        ltmp.patch(nn.Linear(2, 2))
    clip = open_clip.model.CLIP(
        16,
        dict(image_size=32, patch_size=4, width=48, layers=1, head_width=16),
        dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1),
    )
    with pytest.raises(TypeError, match=r"cannot handle CLIP; patch its visual tower: ltmp.patch\(model.visual"):
        ltmp.patch(clip)
    ltmp.patch(clip.visual, "tome", r=4)
    with torch.no_grad():
        assert clip.encode_image(images(2, torch.float32)).shape == (2, 16)
    assert ltmp.stats(clip.visual).kept[0].tolist() == [60]  # 64 patches, 4 merged in its one block


def test_transformers_attention_maps_get_a_clear_error():
    """Attention maps have one row per surviving token, a different count per block and image: refused in one line
    (hidden states are given per patch, ``test_hidden_states_are_every_layer_per_patch``)."""
    model = ltmp.patch(make("hf-vit"), "ltmp", **THRESHOLDS)
    with pytest.raises(ValueError, match=r"^output_attentions=True is not available on a model patched by ltmp"):
        model(pixel_values=images(1), output_attentions=True)


@pytest.mark.parametrize("arch,published", [("ViT-B-32", 8.82), ("ViT-B-16", 35.13), ("ViT-L-14", 162.03)])
def test_open_clip_dense_gmacs_match_its_published_profile(arch, published):
    """OpenCLIP's docs/model_profile.csv lists image GFLOPs (2 per MAC) from fvcore, LayerNorm included."""
    cfg = open_clip.get_model_config(arch)
    with torch.device("meta"):
        visual = open_clip.model._build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
    got = ltmp.dense_gmacs(ltmp.vit_spec(visual))
    assert got == pytest.approx(published / 2, rel=0.005), got


def test_transformers_vit_base_gmacs_match_the_paper():
    """transformers' default ViTConfig is ViT-B/16 at 224 px: the paper's 17.583 GMACs (DeiT-B), plus the pooler's
    768 x 768 MACs."""
    with torch.device("meta"):
        model = T.ViTModel(T.ViTConfig())
    assert ltmp.dense_gmacs(ltmp.vit_spec(model)) == pytest.approx(17.583 + 768 * 768 / 1e9, rel=0.005)


def test_zero_shot_classifier_is_clip_cosine_logits_over_class_prompts():
    """``ZeroShotClassifier.from_clip``: logits are logit_scale x cos(image embedding, "a photo of a {class}.")."""
    from ltmp.adapters.open_clip import ZeroShotClassifier

    torch.manual_seed(0)
    clip = open_clip.model.CLIP(
        16,
        dict(image_size=32, patch_size=4, width=48, layers=2, head_width=16),
        dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=1),
    ).eval()
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    classes = ["air_plane", "cat", "dog"]
    zs = ZeroShotClassifier.from_clip(clip, tokenizer, classes)
    x = images(2, torch.float32)
    with torch.no_grad():
        img = torch.nn.functional.normalize(clip.encode_image(x), dim=-1)
        txt = torch.nn.functional.normalize(
            clip.encode_text(tokenizer(["a photo of a air plane.", "a photo of a cat.", "a photo of a dog."])), dim=-1
        )
        expected = clip.logit_scale.exp() * img @ txt.T
        got = zs(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    ltmp.patch(zs, "tome", r=4)
    with torch.no_grad():
        assert zs(x).shape == (2, 3)
    assert ltmp.stats(zs).kept[0].tolist() == [60, 56]


def test_a_bare_open_clip_tower_is_refused_where_logits_are_needed():
    from ltmp.evaluate import evaluate

    with pytest.raises(
        ValueError,
        match=r"^an OpenCLIP visual tower returns image embeddings, not class logits; "
        r"accuracy and training need an image classifier: ",
    ):
        evaluate(make("open-clip"), [], progress=False)


@pytest.mark.slow
def test_open_clip_models_evaluate_as_zero_shot_classifiers_on_the_command_line(tmp_path):
    """``ltmp eval --model open_clip:ViT-B-32``: the tower classifies the folder's classes zero-shot (random
    weights here, so the accuracy means nothing; the path is what is tested)."""
    import json

    from ltmp.cli import main
    from ltmp.demo import BUNDLED_DATA

    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "--quiet",
                "eval",
                "--model",
                "open_clip:ViT-B-32",
                "--data-dir",
                BUNDLED_DATA,
                "--val-split",
                "test",
                "--max-images",
                "16",
                "--batch-size",
                "16",
                "--method",
                "tome",
                "--r",
                "4",
                "--workers",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["images"] == 16 and result["gmacs_ratio"] < 0.6


def test_transformers_arguments_are_keyword_only_and_return_dict_is_honoured():
    model = ltmp.patch(make("hf-vit-model"), "ltmp", **THRESHOLDS)
    x = images(2)
    with pytest.raises(TypeError):
        model(x, True)  # ViTModel's second argument is bool_masked_pos, CLIP's interpolate_pos_encoding
    with pytest.raises(ValueError, match=r"^ViTModel computes no loss; labels= belongs to the image classifiers$"):
        model(pixel_values=x, labels=torch.tensor([0, 1]))
    with torch.no_grad():
        out = model(pixel_values=x)
        tup = model(pixel_values=x, return_dict=False)
    assert (
        isinstance(tup, tuple) and torch.equal(tup[0], out.last_hidden_state) and torch.equal(tup[1], out.pooler_output)
    )


def tokens(family: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The family's per-token output (B, N, C) as users read it: timm ``forward_features``, transformers
    ``last_hidden_state`` (the classifiers: the last of ``hidden_states``), OpenCLIP's ``output_tokens``."""
    if family == "timm":
        return model.forward_features(x)
    if family.startswith("open-clip"):
        tower = getattr(model, "visual", model)
        tower.output_tokens = True
        try:
            return model(x)[1]
        finally:
            tower.output_tokens = False
    out = model(x, output_hidden_states=True)
    seq = getattr(out, "last_hidden_state", None)
    if seq is None and out.hidden_states is None:  # (DeiT with teacher returns none: its backbone's)
        out = ltmp.adapters.hf.backbone(model)(x, output_hidden_states=True)
    return out.hidden_states[-1] if seq is None else seq


DENSE = [f for f in FAMILIES if f != "open-clip-zero-shot"]  # (a zero-shot head returns logits only)


@pytest.mark.parametrize("family", DENSE)
def test_dense_outputs_without_reduction_are_the_unpatched_models(family):
    model = make(family)
    x = images(2)
    with torch.no_grad():
        expected = tokens(family, model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "reduces no tokens"
        ltmp.patch(model, "ltmp", merge_threshold=math.inf, prune_threshold=-math.inf, dense_output=True)
    with torch.no_grad():
        got = tokens(family, model, x)
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("method,options", [ALL[0], FIXED[0], FIXED[1]], ids=["ltmp", "tome", "topk-prune"])
@pytest.mark.parametrize("family", DENSE)
def test_dense_outputs_are_the_same_in_train_and_eval_and_per_image(family, method, options):
    """Each patch gets the feature of the token it went into (a pruned one its feature when pruned): the same in
    train and eval mode, in a batch and alone, in the unpatched model's shape."""
    model = ltmp.patch(make(family), method, **options, dense_output=True)
    x = images(3)
    with torch.no_grad():
        model.eval()
        ev = tokens(family, model, x)
        rec = ltmp.stats(model)
        singles = torch.cat([tokens(family, model, x[i : i + 1]) for i in range(3)])
        model.train()
        tr = tokens(family, model, x)
    assert int(rec.merged.sum() + rec.pruned.sum()) > 0, "the test settings must reduce something"
    assert ev.shape[1] == PREFIX[family] + 64 - (1 if family.startswith("open-clip") else 0)
    assert torch.allclose(tr, ev, atol=1e-6, rtol=0), (tr - ev).abs().max()
    assert torch.allclose(singles, ev, atol=1e-6, rtol=0), (singles - ev).abs().max()


def test_hidden_states_are_every_layer_per_patch():
    """transformers' output_hidden_states on a patched model: the embeddings and every layer per patch; with
    nothing reduced, the unpatched model's."""
    model = make("hf-vit")
    x = images(2)
    with torch.no_grad():
        expected = model(x, output_hidden_states=True).hidden_states
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ltmp.patch(model, "ltmp", merge_threshold=math.inf, prune_threshold=-math.inf)
    with torch.no_grad():
        got = model(x, output_hidden_states=True).hidden_states
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-10, rtol=0), (g - e).abs().max()


def test_hooks_in_blocks_are_refused_and_a_pickled_model_stays_patched(family):
    """The habits of tests/test_habits.py in every family: a model that goes through pickle comes back patched, with
    the same outputs and token counts; a hook inside a block is refused in one line naming it."""
    model = ltmp.patch(make(family), "ltmp", **THRESHOLDS).eval()
    x = images(2)
    with torch.no_grad():
        expected, kept = output(model(x)), ltmp.stats(model).kept
        back = pickle.loads(pickle.dumps(model))
        got = output(back(x))
    assert type(back) is type(model) and torch.equal(got, expected) and torch.equal(ltmp.stats(back).kept, kept)
    ltmp.patching.blocks(model)[1].register_forward_hook(lambda *args: None)
    with pytest.raises(ltmp.LtmpError, match=r"^blocks\[1\] has a hook, which a patched model would not run"):
        model(x)
