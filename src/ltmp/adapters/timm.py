"""timm ``VisionTransformer``: the only module that knows timm's internals.

Supports the standard ``Block``/``Attention`` (qk norm, layer scale, gated attention, scale norm), class,
distillation and register prefix tokens, and ``'token'``, ``'avg'`` and ``'map'`` (attention-pool) heads.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..errors import LtmpError, UnsupportedModelError
from .base import Adapter, BlockView, conv_macs, last_tap, linear_macs, mean_pool, norm_macs, pool_bias, zero_padding

SUPPORTED = (
    "timm VisionTransformer models with standard Block/Attention and 'token', 'avg' or 'map' pooling "
    "(e.g. vit_*, deit_*, deit3_*, vit_*_reg*, vit_*_siglip_*)"
)


def _tname(obj) -> str:
    return type(obj).__name__


class TimmAdapter(Adapter):
    family = "timm"
    supported = SUPPORTED

    def owns(self, model: nn.Module) -> bool:
        return type(model).__module__.startswith("timm.")

    def check(self, model: nn.Module) -> None:
        from timm.layers import Attention
        from timm.models.vision_transformer import Block, VisionTransformer

        if not isinstance(model, VisionTransformer):
            kind = _tname(model)
            why = ""
            if "Eva" in kind or "Rope" in kind or "rope" in kind.lower():
                why = " (rotary position attention)"
            elif "RelPos" in kind or "Beit" in kind:
                why = " (relative-position attention)"
            raise UnsupportedModelError(f"ltmp.patch cannot handle {kind}{why}; it supports {SUPPORTED}")
        pool = getattr(model, "attn_pool", None)
        if pool is not None and (
            getattr(pool, "pos_embed", None) is not None
            or "attn_mask" not in inspect.signature(pool.forward).parameters
        ):
            raise UnsupportedModelError(
                f"ltmp.patch cannot handle this attention-pool head ({_tname(pool)} with a "
                f"position embedding, or a timm too old to mask it); it supports {SUPPORTED}"
            )
        if pool is None and model.global_pool not in ("token", "avg"):
            raise UnsupportedModelError(
                f"ltmp.patch cannot handle global_pool='{model.global_pool}'; it supports {SUPPORTED}"
            )
        for i, blk in enumerate(model.blocks):
            if type(blk).forward is not Block.forward:
                raise UnsupportedModelError(
                    f"ltmp.patch cannot handle block {i} of type {_tname(blk)}; it supports {SUPPORTED}"
                )
            if type(blk.attn).forward is not Attention.forward:
                raise UnsupportedModelError(
                    f"ltmp.patch cannot handle attention {_tname(blk.attn)} in block {i} "
                    f"(rotary, relative-position and other attention variants are not "
                    f"supported); it supports {SUPPORTED}"
                )

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return model.blocks

    def view(self, model: nn.Module, blk: nn.Module) -> BlockView:
        a = blk.attn

        def out(o: Tensor, y: Tensor) -> Tensor:  # timm's Attention after its heads, then layer scale, drop path
            o = a.norm(o) if getattr(a, "gate", None) is None else a.norm(o) * a.gate(y).sigmoid()
            return blk.drop_path1(blk.ls1(a.proj_drop(a.proj(o))))

        return BlockView(
            norm1=blk.norm1,
            qkv=a.qkv,
            heads=a.num_heads,
            head_dim=a.head_dim,
            scale=a.scale,
            attn_drop=a.attn_drop.p if a.training else 0.0,
            out=out,
            mlp=lambda t: blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(t)))),
            q_norm=a.q_norm,
            k_norm=a.k_norm,
            fused=bool(a.fused_attn),
        )

    def num_prefix(self, model: nn.Module) -> int:
        return int(model.num_prefix_tokens)

    def has_class_token(self, model: nn.Module) -> bool:
        return getattr(model, "cls_token", None) is not None

    def pools_patches(self, model: nn.Module) -> bool:
        return getattr(model, "attn_pool", None) is not None or model.global_pool == "avg"

    def embed_dim(self, model: nn.Module) -> int:
        return int(model.embed_dim)

    def patch_grid(self, model: nn.Module):
        pe = model.patch_embed
        return tuple(pe.grid_size), tuple(pe.patch_size), tuple(pe.img_size)

    def token_macs(self, model: nn.Module, blk: nn.Module, count_norm: bool) -> tuple[float, float]:
        a = blk.attn
        heads_norm = a.num_heads * (norm_macs(a.q_norm, a.k_norm, count=count_norm))
        attn = norm_macs(blk.norm1, getattr(a, "norm", None), count=count_norm) + linear_macs(a) + heads_norm
        return attn, norm_macs(blk.norm2, blk.mlp, count=count_norm) + linear_macs(blk.mlp)

    def embed_macs(self, model: nn.Module, count_norm: bool, n: int) -> float:
        pe = model.patch_embed
        pre = norm_macs(model.norm_pre, count=count_norm)  # every token, prefix included (CLIP-style models)
        return n * (conv_macs(pe.proj) + norm_macs(pe, count=count_norm)) + (n + self.num_prefix(model)) * pre

    def final_macs(self, model: nn.Module, count_norm: bool) -> tuple[float, float]:
        head = norm_macs(model.fc_norm, count=count_norm)
        if getattr(model, "num_classes", 0):
            head += linear_macs(model.head, getattr(model, "head_dist", None))
        final = norm_macs(model.norm, count=count_norm)
        pool = getattr(model, "attn_pool", None)
        if pool is not None:  # keys, values and the latent query's two attention matmuls per token; the query's
            final += linear_macs(pool.kv) + 2.0 * pool.num_heads * pool.head_dim  # projections and MLP once
            head += linear_macs(pool.q, pool.proj, pool.mlp) + norm_macs(pool.norm, pool.mlp, count=count_norm)
        return final, head

    def checkpointing(self, model: nn.Module) -> bool:
        return bool(getattr(model, "grad_checkpointing", False))

    def forward(self, model: nn.Module, encode, x: Tensor) -> Tensor:
        x, state, _ = encode(model, _embed(model, x))  # (B, N', C)
        return self.head(model, model.norm(x), state)

    def head(self, model: nn.Module, x: Tensor, state) -> Tensor:
        """timm's ``forward_head`` over the surviving tokens (class and distillation tokens never move)."""

        pool = getattr(model, "attn_pool", None)
        if pool is not None:
            skip = 0 if model.pool_include_prefix else model.num_prefix_tokens
            bias = pool_bias(state, x.dtype)  # (B, N) or None
            x = pool(x[:, skip:], attn_mask=None if bias is None else bias[:, None, None, skip:])  # (B, C)
        elif model.global_pool == "avg":
            x = mean_pool(x, state, 0 if model.pool_include_prefix else model.num_prefix_tokens)  # (B, C)
        else:
            return model.forward_head(x)  # class (and distillation) tokens never move: timm's head works as is
        x = model.head_drop(model.fc_norm(x))
        return model.head(x)

    def extra_methods(self, encode) -> dict:
        def forward_features(model, x: Tensor) -> Tensor:
            """The normed tokens leaving the last block: the survivors (B, N', C), padding rows 0, or with
            ``dense_output`` per patch (B, N, C) as the unpatched model's."""
            x, state, dense = last_tap(model, encode, _embed(model, x))
            return model.norm(dense) if dense is not None else zero_padding(model.norm(x), state)

        def forward_intermediates(
            model,
            x: Tensor,
            indices: int | Sequence[int] | None = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
            output_dict: bool = False,
            attn_mask: Tensor | None = None,
            is_causal: bool = False,
        ):
            """timm's ``forward_intermediates`` on the reduced forward, per patch: each block's output (and the
            final features) as dense outputs (``ltmp.patch``'s ``dense_output``), so that every output has the
            unpatched model's shape. The reduction runs every block (``stop_early`` changes nothing)."""
            if attn_mask is not None or is_causal:
                raise LtmpError("a model patched by ltmp takes no attn_mask and is not causal")
            if output_fmt not in ("NCHW", "NLC"):
                raise LtmpError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
            depth, (height, width) = len(model.blocks), x.shape[-2:]
            if indices is None:  # every block, the last n, or the ones named (negative: from the end)
                take = list(range(depth))
            elif isinstance(indices, int):
                take = list(range(depth - indices, depth))
            else:
                take = [i % depth for i in indices]
            _, _, dense = encode(model, _embed(model, x), (*take, -1))  # block -> (B, N, C), in block order
            final, p = model.norm(dense[depth - 1]), model.num_prefix_tokens
            inter = [model.norm(y) if norm else y for i, y in dense.items() if i in take]  # (B, N, C) each
            prefix, inter = [y[:, :p] for y in inter], [y[:, p:] for y in inter]
            if output_fmt == "NCHW":
                h, w = model.patch_embed.dynamic_feat_size((height, width))
                inter = [y.reshape(y.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for y in inter]
            if output_dict:
                out = {"image_intermediates": inter}
                if p and return_prefix_tokens:
                    out["image_intermediates_prefix"] = prefix
                if not intermediates_only:
                    out["image_features"] = final
                return out
            if p and return_prefix_tokens:
                inter = list(zip(inter, prefix))
            return inter if intermediates_only else (final, inter)

        return {"forward_features": forward_features, "forward_intermediates": forward_intermediates}


def _embed(model: nn.Module, x: Tensor) -> Tensor:
    """(B, 3, H, W) images -> (B, N, C) tokens entering the first block, prefix tokens first."""
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))


@torch.no_grad()
def forward_cut(model: nn.Module, x: Tensor, counts: Sequence[int]) -> Tensor:
    """An unpatched timm ViT whose tokens are simply cut to ``counts[l]`` after block l's attention: the same
    token counts as a reduction, with no reduction step. Not a useful model (it drops the last tokens); it times
    what the counts alone cost, the zero-overhead bound of a reduced model (``benchmarks/speed.py``).

    Args:
        model: An unpatched timm VisionTransformer.
        x: (B, 3, H, W) images.
        counts: Tokens (prefix included) leaving each block.
    """
    if len(counts) != len(model.blocks):
        raise LtmpError(f"forward_cut needs one token count per block ({len(model.blocks)}), got {len(counts)}")
    x = _embed(model, x)  # (B, N, C)
    for blk, n in zip(model.blocks, counts):
        x = x + blk.drop_path1(blk.ls1(blk.attn(blk.norm1(x))))  # (B, N, C)
        x = x[:, :n]  # (B, n, C)
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
    return model.forward_head(model.norm(x))


TIMM = TimmAdapter()
