"""Hugging Face transformers vision transformers (transformers 5 layouts): the only module that knows them.

Supported: ``ViTModel``, ``ViTForImageClassification``, ``DeiTModel``, ``DeiTForImageClassification(WithTeacher)``,
``Dinov2Model``, ``Dinov2WithRegistersModel``, ``Dinov2ForImageClassification``, ``CLIPVisionModel(WithProjection)``
and ``SiglipVisionModel``. The patched model returns the family's own output object; ``last_hidden_state`` then holds
the surviving tokens (padded in an eval batch: ``ltmp.stats`` says how many each image kept). Heads that read the
class token work unchanged; ``Dinov2ForImageClassification``'s patch mean and SigLIP's attention-pool head pool over
the surviving tokens with merged tokens weighted by their size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..errors import LtmpError, UnsupportedModelError
from .base import Adapter, BlockView, conv_macs, identity, linear_macs, mean_pool, norm_macs, pool_bias, zero_padding

#: class name -> the head on top of the backbone ("" for a backbone itself)
HEADS = {
    "ViTModel": "",
    "DeiTModel": "",
    "Dinov2Model": "",
    "Dinov2WithRegistersModel": "",
    "CLIPVisionModel": "",
    "SiglipVisionModel": "",
    "ViTForImageClassification": "class",
    "DeiTForImageClassification": "class",
    "DeiTForImageClassificationWithTeacher": "teacher",
    "Dinov2ForImageClassification": "dinov2",
    "CLIPVisionModelWithProjection": "projection",
}
SUPPORTED = f"transformers (5.x) {', '.join(HEADS)}"
_BACKBONES = ("vit", "deit", "dinov2", "vision_model")  # attribute of the backbone inside a model with a head


def _first(obj, names: Sequence[str], default=None):
    for n in names:
        if getattr(obj, n, None) is not None:
            return getattr(obj, n)
    return default


def _name(model: nn.Module) -> str:
    return getattr(type(model), "_ltmp_base", type(model)).__name__


def backbone(model: nn.Module) -> nn.Module:
    """The module that holds the embeddings, the layers and the final norm."""
    return model if hasattr(model, "embeddings") else _first(model, _BACKBONES)


def _layers(bb: nn.Module) -> nn.ModuleList:
    return _first(bb, ("layers",)) or _first(bb.encoder, ("layers", "layer"))


def _attention(layer: nn.Module) -> nn.Module:
    return _first(layer, ("attention", "self_attn"))


def _norms(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The norms before attention and before the MLP."""
    return (
        _first(layer, ("layernorm_before", "norm1", "layer_norm1")),
        _first(layer, ("layernorm_after", "norm2", "layer_norm2")),
    )


class HFAdapter(Adapter):
    family = "transformers"
    supported = SUPPORTED

    def owns(self, model: nn.Module) -> bool:
        return type(model).__module__.startswith("transformers.")

    def check(self, model: nn.Module) -> None:
        name = _name(model)
        if name not in HEADS:
            raise UnsupportedModelError(f"ltmp.patch cannot handle {name}; it supports {SUPPORTED}")
        attn = _attention(_layers(backbone(model))[0])
        if getattr(attn, "q_proj", None) is None:
            raise UnsupportedModelError(
                f"ltmp.patch needs the transformers 5 layout of {name} (q_proj/k_proj/v_proj "
                f"in every attention); upgrade with: pip install 'transformers>=5'"
            )

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return _layers(backbone(model))

    def view(self, model: nn.Module, blk: nn.Module) -> BlockView:
        attn = _attention(blk)
        norm1, norm2 = _norms(blk)
        proj = _first(attn, ("o_proj", "out_proj"))
        ls1, ls2 = _first(blk, ("layer_scale1",), identity), _first(blk, ("layer_scale2",), identity)
        drop = _first(blk, ("drop_path", "dropout"), identity)  # Dinov2: drop path; ViT/DeiT: hidden dropout
        return BlockView(
            norm1=norm1,
            qkv=lambda y: torch.cat([attn.q_proj(y), attn.k_proj(y), attn.v_proj(y)], -1),  # (..., 3 H D)
            heads=_first(attn, ("num_heads", "num_attention_heads")),
            head_dim=attn.head_dim,
            scale=_first(attn, ("scaling", "scale")),
            attn_drop=float(_first(attn, ("attention_dropout", "dropout"))) if attn.training else 0.0,
            out=lambda o, y: drop(ls1(proj(o))),
            mlp=lambda t: drop(ls2(blk.mlp(norm2(t)))),
        )

    def num_prefix(self, model: nn.Module) -> int:
        emb = backbone(model).embeddings
        n = int(getattr(emb, "cls_token", None) is not None or getattr(emb, "class_embedding", None) is not None)
        n += int(getattr(emb, "distillation_token", None) is not None)
        registers = getattr(emb, "register_tokens", None)  # (1, R, C)
        return n + (0 if registers is None else int(registers.shape[1]))

    def pools_patches(self, model: nn.Module) -> bool:
        return HEADS[_name(model)] == "dinov2" or self.num_prefix(model) == 0  # SigLIP: no class token

    def embed_dim(self, model: nn.Module) -> int:
        return int(backbone(model).config.hidden_size)

    def patch_grid(self, model: nn.Module):
        cfg = backbone(model).config
        img = cfg.image_size if isinstance(cfg.image_size, (tuple, list)) else (cfg.image_size,) * 2
        patch = cfg.patch_size if isinstance(cfg.patch_size, (tuple, list)) else (cfg.patch_size,) * 2
        return (img[0] // patch[0], img[1] // patch[1]), tuple(patch), tuple(img)

    def token_macs(self, model: nn.Module, blk: nn.Module, count_norm: bool) -> tuple[float, float]:
        norm1, norm2 = _norms(blk)
        return (
            norm_macs(norm1, count=count_norm) + linear_macs(_attention(blk)),
            norm_macs(norm2, blk.mlp, count=count_norm) + linear_macs(blk.mlp),
        )

    def embed_macs(self, model: nn.Module, count_norm: bool, n: int) -> float:
        emb = backbone(model).embeddings
        conv = getattr(emb, "patch_embedding", None) or emb.patch_embeddings.projection
        pre = norm_macs(getattr(backbone(model), "pre_layrnorm", None), count=count_norm)  # CLIP: every token
        return n * conv_macs(conv) + (n + self.num_prefix(model)) * pre

    def final_macs(self, model: nn.Module, count_norm: bool) -> tuple[float, float]:
        bb = backbone(model)
        final = norm_macs(_first(bb, ("layernorm",)), count=count_norm)
        head = linear_macs(
            getattr(bb, "pooler", None),
            _first(model, ("classifier", "cls_classifier")),
            getattr(model, "distillation_classifier", None),
            getattr(model, "visual_projection", None),
        )
        post = getattr(bb, "post_layernorm", None)
        if _name(bb) == "CLIPVisionModel":
            head += norm_macs(post, count=count_norm)  # on the class token only
        else:
            final += norm_macs(post, count=count_norm)
        pool = getattr(bb, "head", None) if getattr(bb, "use_head", False) else None
        if pool is not None:  # SigLIP: keys, values and the probe's two attention matmuls per token; the probe's
            C = self.embed_dim(model)  # query, output and MLP once
            final += 2.0 * C * C + 2.0 * C
            head += C * C + linear_macs(pool) + norm_macs(pool, count=count_norm)
        return final, head

    def library_hook(self, hook) -> bool:
        return getattr(hook, "__module__", "").startswith("transformers.")

    def checkpointing(self, model: nn.Module) -> bool:
        return any(getattr(layer, "gradient_checkpointing", False) for layer in self.blocks(model))

    def forward(
        self,
        model: nn.Module,
        encode,
        pixel_values: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        bool_masked_pos: Tensor | None = None,
        attention_mask: Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """The model's forward with the blocks reduced. Arguments after ``pixel_values`` are keyword-only (their
        positions differ between the transformers classes)."""
        out = self._forward(
            model, encode, pixel_values, labels, interpolate_pos_encoding, bool_masked_pos, attention_mask, **kwargs
        )
        if return_dict is None:
            return_dict = getattr(model.config, "use_return_dict", getattr(model.config, "return_dict", True))
        return out if return_dict else out.to_tuple()

    def _forward(
        self, model, encode, pixel_values, labels, interpolate_pos_encoding, bool_masked_pos, attention_mask, **kwargs
    ):
        from transformers.modeling_outputs import ImageClassifierOutput

        if kwargs.pop("output_attentions", None) or getattr(model.config, "output_attentions", False):
            raise LtmpError(
                "output_attentions=True is not available on a model patched by ltmp (the token count changes "
                "between layers); read ltmp.stats(model) for what each block kept"
            )
        hidden = kwargs.pop("output_hidden_states", None)
        hidden = getattr(model.config, "output_hidden_states", False) if hidden is None else hidden
        if pixel_values is None or attention_mask is not None:
            raise LtmpError("a model patched by ltmp needs pixel_values and no attention_mask")
        bb, kind = backbone(model), HEADS[_name(model)]
        if labels is not None and kind not in ("class", "dinov2"):
            raise LtmpError(f"{_name(model)} computes no loss; labels= belongs to the image classifiers")
        emb_kw = {}
        if bool_masked_pos is not None:
            emb_kw["bool_masked_pos"] = bool_masked_pos
        if interpolate_pos_encoding is not None and "Dinov2" not in _name(bb):
            emb_kw["interpolate_pos_encoding"] = interpolate_pos_encoding
        pixel_values = pixel_values.to(next(bb.embeddings.parameters()).dtype)
        x = bb.embeddings(pixel_values, **emb_kw)  # (B, N, C)
        x = x_in = _first(bb, ("pre_layrnorm",), identity)(x)
        depth = len(self.blocks(model))
        taps = range(depth) if hidden else (-1,) if model.ltmp_config.dense_output else ()
        x, state, dense = encode(model, x, taps)  # (B, N', C), block -> (B, N, C)
        out, seq = _backbone_output(bb, x, state, dense[depth - 1] if model.ltmp_config.dense_output else None)
        if hidden:  # every layer per patch (dense outputs), as the unpatched model's
            out.hidden_states = (x_in, *dense.values())
        if not kind:
            return out
        if kind == "projection":
            from transformers.models.clip.modeling_clip import CLIPVisionModelOutput

            return CLIPVisionModelOutput(
                image_embeds=model.visual_projection(out.pooler_output),
                last_hidden_state=out.last_hidden_state,
                hidden_states=out.hidden_states,
            )
        if kind == "teacher":
            from transformers.models.deit.modeling_deit import DeiTForImageClassificationWithTeacherOutput

            cls_logits, dist_logits = model.cls_classifier(seq[:, 0]), model.distillation_classifier(seq[:, 1])
            return DeiTForImageClassificationWithTeacherOutput(
                logits=(cls_logits + dist_logits) / 2,
                cls_logits=cls_logits,
                distillation_logits=dist_logits,
                hidden_states=out.hidden_states,
            )
        if kind == "dinov2":  # class token beside the size-weighted mean of the surviving patch tokens
            logits = model.classifier(torch.cat([seq[:, 0], mean_pool(seq, state, self.num_prefix(model))], 1))
        else:
            logits = model.classifier(seq[:, 0])
        loss = None if labels is None else model.loss_function(labels, logits, model.config, **kwargs)
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


def _backbone_output(bb: nn.Module, x: Tensor, state, dense: Tensor | None):
    """The backbone's own output object from the tokens leaving the last block (B, N', C), and those tokens after
    the final norm, for the heads. Its ``last_hidden_state`` is the normed tokens, padding rows 0, or the normed
    ``dense`` outputs (B, N, C) when given."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    name = _name(bb)
    norm = bb.post_layernorm if name == "SiglipVisionModel" else _first(bb, ("layernorm",), identity)
    seq = norm(x)  # (B, N', C); CLIP's final norm is on the class token only
    last = zero_padding(seq, state) if dense is None else norm(dense)
    if name == "CLIPVisionModel":
        pooled = bb.post_layernorm(x[:, 0])
    elif name == "SiglipVisionModel":
        pooled = siglip_pool(bb.head, seq, pool_bias(state, seq.dtype)) if bb.use_head else None
    elif name.startswith("Dinov2"):
        pooled = seq[:, 0]
    else:
        pooled = None if getattr(bb, "pooler", None) is None else bb.pooler(seq)
    return BaseModelOutputWithPooling(last_hidden_state=last, pooler_output=pooled), seq


def siglip_pool(head: nn.Module, seq: Tensor, bias: Tensor | None) -> Tensor:
    """SigLIP's attention-pool head on (B, N, C) tokens with an additive key bias (B, N) (``pool_bias``: log size,
    -inf at removed tokens): the probe attends to the surviving tokens, merged ones weighted by their size."""
    mask = None if bias is None else bias[:, None, :].repeat_interleave(head.attention.num_heads, 0)  # (B * H, 1, N)
    h = head.attention(head.probe.expand(seq.shape[0], -1, -1), seq, seq, attn_mask=mask)[0]  # (B, 1, C); explicit
    #   attention (need_weights), which FLOP counters see on every device: one query, so it costs next to nothing
    return (h + head.mlp(head.layernorm(h)))[:, 0]  # (B, C)


HF = HFAdapter()
