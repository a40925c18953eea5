"""Hugging Face transformers (issue #19): the bundled model's conversion, which the cross-library evidence needs."""
from __future__ import annotations

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
