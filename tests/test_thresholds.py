"""Threshold files: the whole learned state, in safetensors, with metadata that guards against misuse."""

from __future__ import annotations

import os

import pytest
import timm
import torch

import ltmp
from conftest import BASE, THRESHOLDS, images, make_model


def trained_like(config="cls", method="ltmp"):
    model = ltmp.patch(make_model(config), method, **THRESHOLDS)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith("threshold"):
                p.add_(0.001 * i)
    return model


def test_roundtrip_restores_method_thresholds_and_decisions(tmp_path):
    model = trained_like()
    path = tmp_path / "thresholds.safetensors"
    ltmp.save_thresholds(model, path)
    assert os.path.getsize(path) < 1024  # a few hundred bytes
    tensors, meta = ltmp.read_thresholds(path)
    assert meta["method"] == "ltmp" and meta["importance"] == "mean" and float(meta["tau"]) == 0.1
    assert (meta["depth"], meta["embed_dim"], meta["num_prefix_tokens"]) == ("3", "48", "1")
    assert (meta["patch_grid"], meta["img_size"]) == ("8x8", "32x32")
    assert sorted(tensors) == ["merge_threshold", "prune_threshold"]
    assert tensors["merge_threshold"].shape == (3,)
    assert tensors["prune_threshold"][2] == model.blocks[2].prune_threshold.detach().float()
    fresh = make_model("cls")
    ltmp.load_thresholds(fresh, path)
    x = images(3)
    with torch.no_grad():
        a, b = model(x), fresh(x)
    assert torch.equal(a, b)
    assert torch.equal(ltmp.stats(model).kept, ltmp.stats(fresh).kept)


def test_loading_into_another_model_fails_clearly(tmp_path):
    path = tmp_path / "t.safetensors"
    ltmp.save_thresholds(trained_like(), path)
    deeper = timm.create_model("vit_tiny_patch16_224", **{**BASE, "depth": 4})
    with pytest.raises(ValueError, match=r"made for another model .* depth 3.* this model .* depth 4.*use thresholds"):
        ltmp.load_thresholds(deeper, path)
    distilled = make_model("distilled")
    with pytest.raises(ValueError, match=r"1 prefix tokens\); this model .* 2 prefix tokens"):
        ltmp.load_thresholds(distilled, path)
    assert getattr(deeper, "ltmp_config", None) is None


def test_files_record_their_model_family_and_load_into_same_shaped_models_of_any(tmp_path):
    """A threshold file holds one value per block; a model of another family with the same depth, width and
    prefix tokens (e.g. the same weights converted to transformers) takes it, as a same-shaped timm model does."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "t.safetensors"
    ltmp.save_thresholds(trained_like(), path)
    tensors, meta = ltmp.read_thresholds(path)
    assert meta["family"] == "timm"
    save_file(load_file(str(path)), str(path), metadata={**meta, "family": "transformers"})
    model = ltmp.load_thresholds(make_model("cls"), path)
    assert torch.equal(ltmp.thresholds.threshold_tensors(model)["prune_threshold"], tensors["prune_threshold"])
    del meta["family"]  # files from before the family was recorded
    save_file(load_file(str(path)), str(path), metadata=meta)
    ltmp.load_thresholds(make_model("cls"), path)


def test_other_image_size_warns(tmp_path):
    path = tmp_path / "t.safetensors"
    ltmp.save_thresholds(trained_like(), path)
    bigger = timm.create_model("vit_tiny_patch16_224", **{**BASE, "img_size": 48})
    with pytest.warns(UserWarning, match=r"trained on a 8x8 patch grid \(32x32 px\) and this model uses 12x12"):
        ltmp.load_thresholds(bigger, path)


def test_corrupt_or_foreign_files_fail_clearly(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="cannot read thresholds file .*bad.safetensors"):
        ltmp.load_thresholds(make_model("cls"), bad)
    from safetensors.torch import save_file

    foreign = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="is not an ltmp thresholds file"):
        ltmp.load_thresholds(make_model("cls"), foreign)
    with pytest.raises(ValueError, match="does not exist"):
        ltmp.load_thresholds(make_model("cls"), tmp_path / "missing.safetensors")


def test_class_attention_choice_is_recorded(tmp_path):
    model = ltmp.patch(make_model("cls"), "ltp", importance="cls", prune_threshold=0.3)
    path = tmp_path / "t.safetensors"
    ltmp.save_thresholds(model, path)
    fresh = ltmp.load_thresholds(make_model("cls"), path)
    assert fresh.ltmp_config.importance == "cls" and fresh.ltmp_config.method == "ltp"
    assert fresh.blocks[0].prune_threshold.item() == pytest.approx(0.3)


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "t.safetensors"
    ltmp.save_thresholds(trained_like(), path)
    before = path.read_bytes()
    import safetensors.torch

    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        ltmp.save_thresholds(trained_like(method="ltm"), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_saved_files_get_the_umask_mode(tmp_path, umask, mode):
    """Teammates can read what ltmp writes (as with open()), and a private umask keeps it private."""
    old = os.umask(umask)
    try:
        ltmp.save_thresholds(trained_like(), tmp_path / "t.safetensors")
        ltmp.save_thresholds(trained_like(), tmp_path / "t.safetensors")  # overwriting keeps the mode too
    finally:
        os.umask(old)
    assert (tmp_path / "t.safetensors").stat().st_mode & 0o777 == mode


def test_fixed_rate_models_have_nothing_to_save(tmp_path):
    with pytest.raises(ValueError, match="learned-threshold method"):
        ltmp.save_thresholds(ltmp.patch(make_model("cls"), "tome", r=2), tmp_path / "t.safetensors")
