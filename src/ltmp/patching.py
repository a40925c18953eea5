"""Applies LTMP to a vision transformer of any supported family (:mod:`ltmp.adapters`), in place.

``patch`` swaps the model's class for a subclass whose ``forward`` threads a token state through the blocks (no
shared mutable dict), and adds each block's learned thresholds as ``nn.Parameter``s named ``merge_threshold`` and
``prune_threshold``. The block weights and their names are untouched, so the family's plain checkpoints still load.
This module never learns a family's name: the model's adapter says where blocks, attention, norms and prefix
tokens are (:class:`ltmp.adapters.BlockView`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from . import engine
from .adapters import ADAPTERS, Adapter, adapter_for
from .config import DENSE_FILLS, MASK_GRADS, MERGE_GRADS, METHODS, ReduceConfig
from .errors import LtmpError

THRESHOLD_NAMES = ("merge_threshold", "prune_threshold")


def _rate(value: int | Sequence[int] | None, depth: int, name: str) -> tuple[int, ...]:
    if value is None:
        raise LtmpError(f"this method needs {name}=: tokens per layer, an int or a list of {depth} ints")
    rates = (int(value),) * depth if isinstance(value, (int, float)) else tuple(int(v) for v in value)
    if len(rates) != depth or any(r < 0 for r in rates):
        raise LtmpError(f"{name}= must be a non-negative int or a list of {depth} non-negative ints, got {value}")
    return rates


def blocks(model: nn.Module) -> Sequence[nn.Module]:
    """The transformer blocks of a supported model (patched or not), where its thresholds live."""
    return adapter_for(model).blocks(model)


def patch(
    model: nn.Module,
    method: str = "ltmp",
    *,
    tau: float = 0.1,
    importance: str = "mean",
    merge_threshold: float | None = None,
    prune_threshold: float | None = None,
    r: int | Sequence[int] | None = None,
    k: int | Sequence[int] | None = None,
    trace_source: bool = False,
    mask_grad: str = "secant",
    merge_grad: str = "average",
    dense_output: bool = False,
    dense_fill: str = "last",
) -> nn.Module:
    """Make a vision transformer reduce its tokens with LTMP or a fixed-rate baseline, in place.

    In train mode every token stays in the tensor behind a straight-through keep mask (differentiable w.r.t. the
    thresholds, eq. 1-3, 5-7); in eval mode the same decisions really remove the tokens.

    Args:
        model: A timm ``VisionTransformer`` (also DeiT distilled, register, class-token-free and attention-pool
            variants); a Hugging Face transformers ViT, DeiT, DINOv2, CLIP or SigLIP vision model; or OpenCLIP's
            ``VisionTransformer`` (``open_clip.create_model(...).visual``). See :mod:`ltmp.adapters`.
        method: ``ltmp`` | ``ltpm`` | ``ltm`` | ``ltp`` (learned thresholds) or ``tome`` | ``topk-prune`` |
            ``topk-mp`` (fixed rate).
        tau: Temperature of the sigmoid surrogate gradient (eq. 2).
        importance: ``"mean"`` (mean column attention, eq. 17) or ``"cls"`` (class attention, eq. 16).
        merge_threshold: Initial merge threshold of every block (cosine similarity; ``inf`` merges nothing). None:
            the model's own when it is already patched with merge thresholds (re-patching keeps what it learned),
            else 0.9.
        prune_threshold: Initial prune threshold of every block (importance; ``-inf`` prunes nothing). None: the
            model's own when it already has them, else 0.0.
        r: ToMe's tokens merged per layer (int or per-layer list).
        k: Top-k baselines' tokens pruned (and merged, for ``topk-mp``) per layer.
        trace_source: Record which patches each token covers after every block (for visualization).
        mask_grad: Train mode: the bounded form of eq. 6's gradient to removed keys' masks, ``"secant"``,
            ``"clamp"`` or ``"eps"`` (the reference code's), or ``"reference"``: the reference code's train-mode
            softmax itself (``ltmp.ops.reference_softmax``); see ``ltmp.ops.MaskedSoftmax``.
        merge_grad: Train mode: merge thresholds learn through the attention masks and the merged averages
            (``"average"``) or through the masks only (``"mask"``, as the reference code).
        dense_output: The family's token outputs are per patch, shaped as the unpatched model's (timm
            ``forward_features``, transformers ``last_hidden_state`` and ``hidden_states``, OpenCLIP's
            ``output_tokens``): each patch gets the feature of the token it was merged into, a pruned patch the
            feature it had when pruned (``dense_fill="zero"``: 0). Logits and pooled outputs are unchanged.
            ``forward_intermediates`` is always per patch.

    Returns:
        The same model object, patched. It returns what the unpatched model returns (logits for timm, the
        family's output object for transformers, embeddings for OpenCLIP).
    """
    choices = {
        "method": (method, METHODS),
        "importance": (importance, ("mean", "cls")),  # eq. 17, eq. 16
        "mask_grad": (mask_grad, MASK_GRADS),
        "merge_grad": (merge_grad, MERGE_GRADS),
        "dense_fill": (dense_fill, DENSE_FILLS),
    }
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise LtmpError(f"unknown {name} '{value}'; choose one of: {', '.join(allowed)}")
    if not float(tau) > 0:
        raise LtmpError(f"tau is the temperature of eq. 2's sigmoid and must be > 0, got {tau}")
    adapter = adapter_for(model, check=True)  # every check comes before the model changes
    blks = adapter.blocks(model)
    depth = len(blks)
    kept = [{n: blk._parameters[n].detach() for n in THRESHOLD_NAMES if n in blk._parameters} for blk in blks]
    cfg = ReduceConfig(
        method=method,
        tau=float(tau),
        importance=importance,
        num_prefix=adapter.num_prefix(model),
        trace_source=trace_source,
        mask_grad=mask_grad,
        merge_grad=merge_grad,
        dense_output=bool(dense_output),
        dense_fill=dense_fill,
    )
    if cfg.importance == "cls" and "prune" in cfg.ops and not adapter.has_class_token(model):
        raise LtmpError(
            "importance='cls' (class attention, eq. 16) needs a class token and this model has none; "
            "use importance='mean'"
        )
    if cfg.learned:
        if r is not None or k is not None:
            raise LtmpError(f"method '{method}' learns thresholds; r= and k= belong to tome/topk-prune/topk-mp")
    elif method == "tome":
        cfg.rate = _rate(r, depth, "r")
    else:
        cfg.rate = _rate(k, depth, "k")
    unpatch(model)

    ref = next(model.parameters())
    for blk, old in zip(blks, kept):  # re-patching keeps the thresholds the model has unless new ones are given
        for kind, given, default in (
            ("merge_threshold", merge_threshold, 0.9),
            ("prune_threshold", prune_threshold, 0.0),
        ):
            if cfg.learned and kind[:5] in cfg.ops:
                v = (
                    old[kind].clone()
                    if given is None and kind in old
                    else torch.tensor(float(default if given is None else given))
                )
                setattr(blk, kind, nn.Parameter(v.to(ref.device)))
    model.ltmp_config = cfg
    model.ltmp_record = None
    model._ltmp_hooks = [  # the hook dicts of every module in the blocks, which the forward refuses
        d
        for blk in blks
        for m in blk.modules()
        for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    ]
    model._ltmp_hook = model.register_load_state_dict_post_hook(_allow_missing_thresholds)
    model.__class__ = _patched_class(type(model), adapter)

    does_nothing = (cfg.rate is not None and not any(cfg.rate)) or (
        cfg.learned
        and ("merge" not in cfg.ops or merge_threshold == math.inf)
        and ("prune" not in cfg.ops or prune_threshold == -math.inf)
    )
    if does_nothing:
        warnings.warn(
            f"ltmp.patch(method='{method}') reduces no tokens with these settings "
            f"(r/k of 0, or thresholds merge=+inf and prune=-inf)",
            stacklevel=2,
        )
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the plain model: its class, and no threshold parameters."""
    if getattr(model, "ltmp_config", None) is None:
        return model
    for blk in blocks(model):
        for name in THRESHOLD_NAMES:
            blk._parameters.pop(name, None)
    model._ltmp_hook.remove()
    for name in ("ltmp_config", "ltmp_record", "_ltmp_hook", "_ltmp_hooks"):
        delattr(model, name)
    model.__class__ = model.__class__._ltmp_base
    return model


def _allow_missing_thresholds(module: nn.Module, incompatible) -> None:
    """A plain state dict (without thresholds) still loads strictly into a patched model."""
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.endswith(THRESHOLD_NAMES)]


_CLASSES: dict[type, type] = {}


def _patched_class(base: type, adapter: Adapter) -> type:
    if base not in _CLASSES:
        body = {
            "_ltmp_base": base,
            "_ltmp_adapter": adapter,
            "forward": engine.forward,
            "__module__": base.__module__,
            "__doc__": base.__doc__,
            "__reduce_ex__": _reduce,
            "__prepare_scriptable__": _refuse_script,
            **adapter.extra_methods(engine.encode),
        }
        _CLASSES[base] = type(f"LTMP{base.__name__}", (base,), body)
    return _CLASSES[base]


def _reduce(model: nn.Module, protocol: int) -> tuple:
    """Pickle (``torch.save(model)``, ``copy.deepcopy``) a patched model as its family's class and its state; it
    loads back patched (:func:`_new_patched`)."""
    cls = type(model)
    return _new_patched, (cls._ltmp_base, cls._ltmp_adapter.family), model.__dict__


def _new_patched(base: type, family: str) -> nn.Module:
    """An empty patched model of class ``base`` (its state follows); see :func:`_reduce`."""
    cls = _patched_class(base, next(a for a in ADAPTERS if a.family == family))
    return cls.__new__(cls)


def _refuse_script(model: nn.Module) -> None:
    raise LtmpError(
        "torch.jit.script cannot compile a patched model (its token counts depend on each image); export it with "
        "`ltmp export` (ltmp.export.export_model: ONNX or torch.export), or compile it with torch.compile"
    )


def keeps_one(model: nn.Module) -> bool:
    """Pruning leaves at least one patch token in every image: the head reads the patch tokens (mean or attention
    pool, decided at each forward), or the model has no prefix token."""
    return adapter_for(model).pools_patches(model) or model.ltmp_config.num_prefix == 0


def score_ranges(model: nn.Module) -> dict[str, tuple[float, float]]:
    """The range of the scores each kind of threshold compares: cosine similarities in [-1, 1] for merge
    thresholds; importance in [0, 1] (mean column attention, eq. 17) or [0, heads] (class attention summed over
    heads, eq. 16) for prune thresholds."""
    heads = float(num_heads(model)) if model.ltmp_config.importance == "cls" else 1.0
    return {"merge_threshold": (-1.0, 1.0), "prune_threshold": (0.0, heads)}


def num_heads(model: nn.Module) -> int:
    """Attention heads of the first block."""
    return adapter_for(model).view(model, blocks(model)[0]).heads
