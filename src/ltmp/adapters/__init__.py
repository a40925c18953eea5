"""Model families: where a vision transformer's blocks, attention, norms and prefix tokens are.

The reduction (:mod:`ltmp.engine`, :mod:`ltmp.step`, :mod:`ltmp.ops`) never learns a family's name. It asks
the model's :class:`Adapter` for a :class:`BlockView` of each block (pre-norm: ``x + attn(norm1(x))``, then the
reduction step of the paper's Figure 2, then ``x + mlp(norm2(x))``), and lets the adapter embed the images and
apply the family's head. One small file per family: :mod:`.timm`, :mod:`.hf` (Hugging Face transformers),
:mod:`.open_clip`, each on :mod:`.base`; docs/families.md says how to add one. Adapters import only plain data
and the maths (:mod:`ltmp.config`, :mod:`ltmp.ops`), never the engine: a patched model's forward hands them
``encode``.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Adapter, BlockView, conv_macs, identity, linear_macs, mean_pool, norm_macs, pool_bias
from .hf import HF
from .open_clip import OPEN_CLIP
from .timm import TIMM

__all__ = [
    "Adapter",
    "BlockView",
    "identity",
    "adapter_for",
    "supported",
    "mean_pool",
    "pool_bias",
    "linear_macs",
    "conv_macs",
    "norm_macs",
    "ADAPTERS",
]

#: The families, in the order a model is offered to them.
ADAPTERS: list[Adapter] = [TIMM, HF, OPEN_CLIP]


def supported() -> str:
    return "; ".join(a.supported for a in ADAPTERS)


def adapter_for(model: nn.Module, check: bool = False) -> Adapter:
    """The model's family adapter; with ``check``, refuse a model of the family that it cannot handle.

    Raises:
        UnsupportedModelError: no family knows the model (the message names what is supported).
    """
    found = getattr(type(model), "_ltmp_adapter", None)
    if found is None:
        for a in ADAPTERS:
            if a.owns(model):
                found = a
                break
    if found is None:
        raise UnsupportedModelError(
            f"ltmp.patch cannot handle {type(model).__name__} ({type(model).__module__}); it supports {supported()}"
        )
    if check:
        found.check(model)
    return found
