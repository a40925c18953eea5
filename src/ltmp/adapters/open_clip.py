"""OpenCLIP's ``VisionTransformer`` (the visual tower, ``open_clip.create_model(...).visual``): the only module
that knows it.

Patch the tower, ``ltmp.patch(model.visual, ...)``; ``model.encode_image`` then runs the reduced tower. Supports
``ResidualAttentionBlock`` (``nn.MultiheadAttention``, layer scale) with ``'tok'`` or ``'avg'`` pooling, with the
final norm before or after pooling. With ``output_tokens=True`` the returned tokens are the survivors, zero-padded
to the batch's longest image (``ltmp.stats`` says how many each image kept), or one per patch with
``patch(..., dense_output=True)``. :class:`ZeroShotClassifier` turns a tower and class names
into a classifier (CLIP's zero-shot prompts), which ``ltmp train`` and ``ltmp eval`` need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from .base import Adapter, BlockView, conv_macs, identity, last_tap, linear_macs, mean_pool, norm_macs, zero_padding

SUPPORTED = (
    "open_clip VisionTransformer (the visual tower: patch model.visual) with ResidualAttentionBlock and "
    "'tok' or 'avg' pooling"
)


class ZeroShotClassifier(nn.Module):
    """An OpenCLIP visual tower as an image classifier: logits are ``logit_scale`` times the cosine similarity of the
    image embedding to each class's prompt embedding (CLIP's zero-shot classification, Radford et al. 2021).

    ``ltmp.patch`` reduces its tower; the class embeddings are fixed (a buffer), so training learns only the
    thresholds, as for any other model.
    """

    def __init__(self, visual: nn.Module, class_embeddings: Tensor, logit_scale: float, classes: Sequence[str] = ()):
        super().__init__()
        self.visual = visual
        self.register_buffer("class_embeddings", F.normalize(class_embeddings, dim=-1))  # (K, D)
        self.logit_scale = float(logit_scale)
        self.pretrained_cfg = dict(getattr(visual, "pretrained_cfg", {}), num_classes=class_embeddings.shape[0])
        if classes:
            self.pretrained_cfg["label_names"] = list(classes)

    @classmethod
    def from_clip(
        cls, clip: nn.Module, tokenizer, classes: Sequence[str], template: str = "a photo of a {}."
    ) -> ZeroShotClassifier:
        """The classifier of ``clip.visual`` for ``classes`` (folder names; ``_`` reads as a space)."""
        import torch

        prompts = [template.format(c.replace("_", " ")) for c in classes]
        with torch.no_grad():
            text = clip.encode_text(tokenizer(prompts))  # (K, D)
        return cls(clip.visual, text, float(clip.logit_scale.exp()), classes)

    def head(self, features: Tensor) -> Tensor:
        """(B, D) image embeddings -> (B, K) logits."""
        return self.logit_scale * F.normalize(features, dim=-1) @ self.class_embeddings.to(features.dtype).T

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.visual(x))


def _tower(model: nn.Module) -> nn.Module:
    return model.visual if isinstance(model, ZeroShotClassifier) else model


class OpenClipAdapter(Adapter):
    family = "open_clip"
    supported = SUPPORTED

    def owns(self, model: nn.Module) -> bool:
        return type(model).__module__.startswith("open_clip.") or isinstance(model, ZeroShotClassifier)

    def check(self, model: nn.Module) -> None:
        from open_clip.transformer import ResidualAttentionBlock, VisionTransformer

        model = _tower(model)
        name = type(model).__name__
        if not isinstance(model, VisionTransformer):
            hint = (
                "; patch its visual tower: ltmp.patch(model.visual, ...)"
                if isinstance(getattr(model, "visual", None), VisionTransformer)
                else ""
            )
            raise UnsupportedModelError(f"ltmp.patch cannot handle {name}{hint}; it supports {SUPPORTED}")
        if not hasattr(model, "_embeds"):
            raise UnsupportedModelError(
                "ltmp.patch needs an open_clip_torch whose VisionTransformer has _embeds; "
                "upgrade with: pip install -U open_clip_torch"
            )
        if model.attn_pool is not None:
            raise UnsupportedModelError(
                f"ltmp.patch cannot handle a {name} with an attentional pooler (CoCa); it supports {SUPPORTED}"
            )
        if model.pool_type not in ("tok", "avg"):
            raise UnsupportedModelError(
                f"ltmp.patch cannot handle pool_type '{model.pool_type}'; it supports {SUPPORTED}"
            )
        for i, blk in enumerate(model.transformer.resblocks):
            if type(blk).forward is not ResidualAttentionBlock.forward:
                raise UnsupportedModelError(
                    f"ltmp.patch cannot handle block {i} of type {type(blk).__name__}; it supports {SUPPORTED}"
                )
            if hasattr(blk, "ln_1_kv") or not blk.attn._qkv_same_embed_dim:
                raise UnsupportedModelError(
                    f"ltmp.patch cannot handle block {i}: cross-attention (separate key and "
                    f"value inputs); it supports self-attention blocks of {SUPPORTED}"
                )

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return _tower(model).transformer.resblocks

    def view(self, model: nn.Module, blk: nn.Module) -> BlockView:
        attn = blk.attn  # nn.MultiheadAttention: packed q | k | v input projection
        return BlockView(
            norm1=blk.ln_1,
            qkv=lambda y: F.linear(y, attn.in_proj_weight, attn.in_proj_bias),  # (..., 3 * H * D)
            heads=attn.num_heads,
            head_dim=attn.head_dim,
            scale=attn.head_dim**-0.5,
            attn_drop=float(attn.dropout) if attn.training else 0.0,
            out=lambda o, y: blk.ls_1(attn.out_proj(o)),
            mlp=lambda t: blk.ls_2(blk.mlp(blk.ln_2(t))),
        )

    def num_prefix(self, model: nn.Module) -> int:
        return 1

    def pools_patches(self, model: nn.Module) -> bool:
        return _tower(model).pool_type == "avg"

    def embed_dim(self, model: nn.Module) -> int:
        return int(_tower(model).conv1.out_channels)

    def patch_grid(self, model: nn.Module):
        model = _tower(model)
        return tuple(model.grid_size), tuple(model.patch_size), tuple(model.image_size)

    def token_macs(self, model: nn.Module, blk: nn.Module, count_norm: bool) -> tuple[float, float]:
        attn = blk.attn
        qkv = float(attn.in_proj_weight.shape[0] * attn.in_proj_weight.shape[1])  # a parameter, not an nn.Linear
        return (
            norm_macs(blk.ln_1, count=count_norm) + qkv + linear_macs(attn),
            norm_macs(blk.ln_2, count=count_norm) + linear_macs(blk.mlp),
        )

    def embed_macs(self, model: nn.Module, count_norm: bool, n: int) -> float:
        tower = _tower(model)
        return n * conv_macs(tower.conv1) + (n + 1) * norm_macs(tower.ln_pre, count=count_norm)

    def final_macs(self, model: nn.Module, count_norm: bool) -> tuple[float, float]:
        tower = _tower(model)
        post = norm_macs(tower.ln_post, count=count_norm)
        proj = 0.0 if tower.proj is None else float(tower.proj.numel())
        if model is not tower:  # the zero-shot head: one dot product per class
            proj += float(model.class_embeddings.numel())
        return (0.0, post + proj) if tower.final_ln_after_pool else (post, proj)

    def checkpointing(self, model: nn.Module) -> bool:
        return bool(getattr(_tower(model).transformer, "grad_checkpointing", False))

    def forward(self, model: nn.Module, encode, x: Tensor):
        tower = _tower(model)
        x, state, dense = last_tap(model, encode, tower._embeds(x))  # (B, N', C), (B, N, C) or None
        norm = identity if tower.final_ln_after_pool else tower.ln_post
        x = norm(x)
        pooled = x[:, 0] if tower.pool_type == "tok" else mean_pool(x, state, 1)  # (B, C)
        if tower.final_ln_after_pool:
            pooled = tower.ln_post(pooled)
        if tower.proj is not None:
            pooled = pooled @ tower.proj  # (B, output_dim)
        if model is not tower:
            return model.head(pooled)  # (B, K)
        if not tower.output_tokens:
            return pooled
        tokens = zero_padding(x, state) if dense is None else norm(dense)  # survivors, or per patch
        return pooled, tokens[:, 1:]


OPEN_CLIP = OpenClipAdapter()
