"""Convert a timm ViT to a Hugging Face transformers ``ViTForImageClassification`` and check that both agree.

Issue #19's evidence on real weights: the bundled CIFAR-10 ViT as a transformers model, whose dense accuracy must
equal timm's on the same images, and with ``--thresholds FILE`` the same LTMP thresholds file loaded into both
(``ltmp.load_thresholds``): the same tokens kept in every block of every image and the same top-1.
Supported: timm ``VisionTransformer`` with a class token, ``'token'`` pooling, pre-norm blocks without layer scale,
q/k norms or registers (the layout of transformers' ViT). Needs ``pip install 'ltmp[hf]'`` (transformers 5).

    python scripts/timm_to_hf.py --output runs/vit-cifar10-hf              # the bundled model, bundled test images
    python scripts/timm_to_hf.py --model local-dir:../shared/models/vit-cifar10 --output DIR \\
        --data-dir ../shared/data/cifar10/cifar10-jpeg.tar.gz --images 10000 --thresholds FILE

Prints the largest logit difference and both models' top-1 on the images; writes ``save_pretrained`` (safetensors,
with an image processor config, so that ``ltmp ... --model hf:DIR`` preprocesses as timm does) to ``--output``.
Runs in float64 with ``--thresholds``, so that no score near a threshold flips a decision. Exits non-zero when any
image's prediction (or kept-token count) differs between the two.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn


def convert(model: nn.Module):
    """A ``transformers.ViTForImageClassification`` with ``model``'s weights (same dtype), in eval mode."""
    from transformers import ViTConfig, ViTForImageClassification

    blk = model.blocks[0]
    why = []
    if model.cls_token is None or model.global_pool != "token" or getattr(model, "attn_pool", None) is not None:
        why.append("a class token and 'token' pooling")
    if model.num_prefix_tokens != 1 or getattr(model, "no_embed_class", False):
        why.append("no registers, position embedding on the class token")
    if not isinstance(blk.ls1, nn.Identity) or not isinstance(blk.attn.q_norm, nn.Identity):
        why.append("no layer scale, no q/k norm")
    if not isinstance(model.fc_norm, nn.Identity) or not isinstance(model.norm_pre, nn.Identity):
        why.append("final norm before the head only")
    if not isinstance(getattr(blk.attn, "norm", nn.Identity()), nn.Identity) or not isinstance(
        getattr(blk.mlp, "norm", nn.Identity()), nn.Identity
    ):
        why.append("no norms inside attention or MLP")
    if not isinstance(blk.mlp.act, nn.GELU) or getattr(blk.mlp.act, "approximate", "none") != "none":
        why.append("exact GELU")
    if blk.attn.proj.bias is None or blk.mlp.fc1.bias is None or blk.mlp.fc2.bias is None:
        why.append("biases on the projection and MLP layers")
    if len(set(model.patch_embed.img_size)) != 1:
        why.append("square images")
    if (
        not isinstance(model.patch_embed.norm, nn.Identity)
        or model.patch_embed.proj.bias is None
        or not isinstance(model.head, nn.Linear)
    ):
        why.append("a patch embedding with bias and no norm, and a linear head")
    if why:
        raise SystemExit(f"timm_to_hf.py converts ViTs with {'; '.join(why)}; {type(model).__name__} differs")
    C, patch = model.embed_dim, model.patch_embed.patch_size[0]
    cfg = ViTConfig(
        hidden_size=C,
        num_hidden_layers=len(model.blocks),
        num_attention_heads=blk.attn.num_heads,
        intermediate_size=blk.mlp.fc1.out_features,
        hidden_act="gelu",
        layer_norm_eps=blk.norm1.eps,
        image_size=model.patch_embed.img_size[0],
        patch_size=patch,
        num_channels=3,
        qkv_bias=blk.attn.qkv.bias is not None,
        num_labels=model.num_classes,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = ViTForImageClassification(cfg).to(model.pos_embed.dtype).eval()
    sd = {
        "vit.embeddings.cls_token": model.cls_token,
        "vit.embeddings.position_embeddings": model.pos_embed,
        "vit.embeddings.patch_embeddings.projection.weight": model.patch_embed.proj.weight,
        "vit.embeddings.patch_embeddings.projection.bias": model.patch_embed.proj.bias,
        "vit.layernorm.weight": model.norm.weight,
        "vit.layernorm.bias": model.norm.bias,
        "classifier.weight": model.head.weight,
        "classifier.bias": model.head.bias,
    }
    names = {
        "norm1": "layernorm_before",
        "q": "attention.q_proj",
        "k": "attention.k_proj",
        "v": "attention.v_proj",
        "proj": "attention.o_proj",
        "norm2": "layernorm_after",
        "fc1": "mlp.fc1",
        "fc2": "mlp.fc2",
    }
    for i, b in enumerate(model.blocks):
        p = f"vit.layers.{i}."
        for key, mod in (
            ("norm1", b.norm1),
            ("proj", b.attn.proj),
            ("norm2", b.norm2),
            ("fc1", b.mlp.fc1),
            ("fc2", b.mlp.fc2),
        ):
            sd[p + names[key] + ".weight"], sd[p + names[key] + ".bias"] = mod.weight, mod.bias
        biases = b.attn.qkv.bias.chunk(3) if b.attn.qkv.bias is not None else (None,) * 3
        for key, w, bias in zip("qkv", b.attn.qkv.weight.chunk(3), biases):  # (C, C) each
            sd[p + names[key] + ".weight"] = w
            if bias is not None:
                sd[p + names[key] + ".bias"] = bias
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    if missing or unexpected:
        raise SystemExit(f"weights left over: missing {missing}, unexpected {unexpected}")
    return hf


def save(hf, timm_model, output: str) -> None:
    """``save_pretrained`` plus an image processor with timm's input size, mean, std and label names."""
    from transformers import ViTImageProcessor

    cfg = timm_model.pretrained_cfg
    names = cfg.get("label_names") or [str(i) for i in range(timm_model.num_classes)]
    hf.config.id2label = dict(enumerate(names))
    hf.config.label2id = {n: i for i, n in enumerate(names)}
    hf.save_pretrained(output)
    h, w = cfg["input_size"][1:]
    crop = float(cfg.get("crop_pct") or 1.0)
    kw = dict(
        image_mean=list(cfg["mean"]),
        image_std=list(cfg["std"]),
        resample=2 if cfg.get("interpolation") == "bilinear" else 3,
    )
    if crop < 1.0:  # timm resizes to size / crop_pct, then crops the center
        from transformers import DeiTImageProcessor

        DeiTImageProcessor(
            size={"height": round(h / crop), "width": round(w / crop)}, crop_size={"height": h, "width": w}, **kw
        ).save_pretrained(output)
    else:
        ViTImageProcessor(size={"height": h, "width": w}, **kw).save_pretrained(output)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a timm model (default: the bundled CIFAR-10 ViT)")
    p.add_argument("--checkpoint")
    p.add_argument("--data-dir", default=None, help="ImageFolder root or archive (default: the bundled images)")
    p.add_argument("--split", default="test")
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--thresholds", help="an LTMP thresholds file to load into both models (compared in float64)")
    p.add_argument("--output", required=True, help="folder for save_pretrained")
    args = p.parse_args()
    import ltmp
    from ltmp import data as ldata
    from ltmp.demo import BUNDLED_DATA, BUNDLED_MODEL
    from ltmp.runtime import create_model

    timm_model = (
        create_model(args.model or BUNDLED_MODEL, pretrained=args.checkpoint is None, checkpoint=args.checkpoint)
        .float()
        .eval()
    )
    hf = convert(timm_model)
    save(hf, timm_model, args.output)
    ds = ldata.eval_set(timm_model, args.data_dir or BUNDLED_DATA, args.split, args.images)
    loader = torch.utils.data.DataLoader(ds, batch_size=100, collate_fn=ldata.collate_skip)
    dtype = torch.float32
    if args.thresholds:
        dtype = torch.float64
        timm_model, hf = timm_model.double(), hf.double()
        ltmp.load_thresholds(timm_model, args.thresholds)
        ltmp.load_thresholds(hf, args.thresholds)
    agree = correct_timm = correct_hf = n = same_kept = 0
    diff = 0.0
    gmacs = []
    with torch.no_grad():
        for x, y, _, _ in loader:
            x = x.to(dtype)
            a, b = timm_model(x), hf(pixel_values=x).logits
            if args.thresholds:
                kept_a, kept_b = ltmp.stats(timm_model).kept, ltmp.stats(hf).kept  # (B, L) each
                same_kept += int((kept_a == kept_b).all(1).sum())
                gmacs.append(ltmp.gmacs(ltmp.vit_spec(hf), kept_b))
            diff = max(diff, float((a - b).abs().max()))
            correct_timm += int((a.argmax(1) == y).sum())
            correct_hf += int((b.argmax(1) == y).sum())
            agree += int((a.argmax(1) == b.argmax(1)).sum())
            n += len(y)
    what = (
        f"with {args.thresholds} ({float(torch.cat(gmacs).mean()):.4f} GMACs), float64" if args.thresholds else "dense"
    )
    print(
        f"{n} images, {what}: top-1 timm {100 * correct_timm / n:.2f}%, transformers {100 * correct_hf / n:.2f}%, "
        f"same prediction on {agree}; largest logit difference {diff:.2e}; wrote {args.output}"
    )
    if args.thresholds:
        print(f"same kept-token counts in every block on {same_kept} of {n} images")
    return 0 if agree == n and (not args.thresholds or same_kept == n) else 1


if __name__ == "__main__":
    sys.exit(main())
