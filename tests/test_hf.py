"""Hugging Face transformers (issue #19): the bundled model's conversion, which the cross-library evidence needs."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import images, make_model

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("timm_to_hf", ROOT / "scripts" / "timm_to_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timm_to_hf_gives_the_same_logits():
    model = make_model("cls", torch.float64)
    hf = _script().convert(model)
    x = images(3)
    with torch.no_grad():
        expected = model(x)
        got = hf(pixel_values=x).logits
        assert torch.allclose(got, expected, atol=1e-10, rtol=0), (got - expected).abs().max()
        fc1 = next(p for n, p in hf.named_parameters() if n.endswith(("mlp.fc1.weight", "intermediate.dense.weight")))
        # a converted weight is used: changing it changes the logits (not by a constant: LayerNorm removes those)
        fc1.add_(0.1 * torch.randn(fc1.shape, generator=torch.Generator().manual_seed(0), dtype=fc1.dtype))
        assert not torch.allclose(hf(pixel_values=x).logits, expected, atol=1e-6, rtol=0)


def test_timm_to_hf_names_what_it_cannot_convert():
    with pytest.raises(SystemExit, match="no registers"):
        _script().convert(make_model("registers", torch.float64))


def _bundled_pair(tmp_path):
    """The bundled CIFAR-10 ViT in timm and, converted with the script, as an hf: folder; float64."""
    from ltmp.demo import BUNDLED_MODEL
    from ltmp.runtime import create_model

    timm_model = create_model(BUNDLED_MODEL, pretrained=True).eval()
    script = _script()
    folder = tmp_path / "hf"
    script.save(script.convert(timm_model), timm_model, str(folder))
    return timm_model.double(), create_model(f"hf:{folder}").double(), folder


def _bundled_images(model, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ltmp import data as ldata
    from ltmp.demo import BUNDLED_DATA

    ds = ldata.eval_set(model, BUNDLED_DATA, "test", n)
    x, y, _, _ = ldata.collate_skip([ds[i] for i in range(len(ds))])
    return x.double(), y


def test_same_thresholds_file_gives_the_same_decisions_in_timm_and_transformers(tmp_path):
    """Issue #19's evidence on real weights: one thresholds file, loaded into the bundled model and into its
    transformers conversion, keeps the same tokens in every block of every image and gives the same top-1."""
    import ltmp

    timm_model, hf, _ = _bundled_pair(tmp_path)
    x, y = _bundled_images(timm_model, 64)
    path = tmp_path / "t.safetensors"
    ltmp.save_thresholds(
        ltmp.patch(copy.deepcopy(timm_model), "ltmp", merge_threshold=0.85, prune_threshold=0.004), path
    )
    ltmp.load_thresholds(timm_model, path)
    ltmp.load_thresholds(hf, path)
    with torch.no_grad():
        a, b = timm_model(x), hf(pixel_values=x).logits
    kept = ltmp.stats(timm_model).kept
    assert torch.equal(kept, ltmp.stats(hf).kept)
    assert int(kept[:, -1].max()) < 64 and len(set(kept[:, -1].tolist())) > 1, "the thresholds must reduce"
    assert torch.allclose(a, b, atol=1e-10, rtol=0), (a - b).abs().max()
    assert torch.equal(a.argmax(1), b.argmax(1))


def test_hf_models_take_their_preprocessing_from_the_folder_and_run_the_cli(tmp_path, capsys):
    """``--model hf:DIR``: the image processor's size, mean and std become the data config; ltmp eval gives the
    same accuracy and GMACs as the timm model it was converted from."""
    import json

    from ltmp.cli import main
    from ltmp.demo import BUNDLED_DATA, BUNDLED_MODEL

    timm_model, hf, folder = _bundled_pair(tmp_path)
    for key in ("input_size", "mean", "std"):
        assert hf.pretrained_cfg[key] == pytest.approx(tuple(timm_model.pretrained_cfg[key])), key
    results = []
    for model in (BUNDLED_MODEL, f"hf:{folder}"):
        out = tmp_path / f"{len(results)}.json"
        assert (
            main(
                [
                    "--quiet",
                    "eval",
                    "--model",
                    model,
                    "--pretrained",
                    "--data-dir",
                    BUNDLED_DATA,
                    "--val-split",
                    "test",
                    "--max-images",
                    "128",
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
        results.append(json.loads(out.read_text()))
    for key in ("top1", "gmacs", "images"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-9), key


def test_hf_and_open_clip_spellings_fail_clearly(tmp_path, capsys):
    from ltmp.cli import main

    assert main(["--quiet", "flops", "--model", f"hf:{tmp_path / 'missing'}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ltmp: error: model folder {tmp_path / 'missing'} does not exist; pass "
        f"hf:DIR with a folder holding the model's config.json and weights"
    )
    pytest.importorskip("open_clip")
    assert main(["--quiet", "flops", "--model", "open_clip:ViT-X-99"]) == 2
    assert "unknown OpenCLIP architecture 'ViT-X-99'; pick one of open_clip.list_models()" in capsys.readouterr().err


def test_hf_data_config_follows_the_processor_resize_and_center_crop(tmp_path):
    """A processor that resizes to 256 and crops 224 (DeiT's) becomes timm's input size 224, crop_pct 0.875."""
    import transformers

    from ltmp.runtime import create_model

    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=224,
        patch_size=32,
        num_labels=3,
    )
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path)
    transformers.DeiTImageProcessor(
        size={"height": 256, "width": 256},
        crop_size={"height": 224, "width": 224},
        resample=3,
        image_mean=[0.4, 0.5, 0.6],
        image_std=[0.2, 0.2, 0.2],
    ).save_pretrained(tmp_path)
    got = create_model(f"hf:{tmp_path}").pretrained_cfg
    assert got["input_size"] == (3, 224, 224) and got["crop_pct"] == pytest.approx(0.875)
    assert got["interpolation"] == "bicubic" and got["mean"] == pytest.approx((0.4, 0.5, 0.6))
