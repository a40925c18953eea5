"""The ``ltmp`` command: a thin argparse layer over the library."""
from __future__ import annotations

import argparse
import sys


class CLIError(Exception):
    """A user error: printed as one line, exit code 2, no traceback."""


def _create_model(name: str, pretrained: bool = False, checkpoint: str | None = None):
    import timm

    try:
        model = timm.create_model(name, pretrained=pretrained)
    except RuntimeError as e:
        if "Unknown model" in str(e) or "not found" in str(e):
            raise CLIError(f"unknown model '{name}'; list models with: python -c \"import timm; "
                           f"print(timm.list_models('vit*'))\"") from None
        raise
    return model


def cmd_flops(args) -> int:
    import ltmp

    model = _create_model(args.model)
    spec = ltmp.vit_spec(model)
    print(f"{args.model}: {ltmp.dense_gmacs(spec):.3f} GMACs per image (fvcore convention, LayerNorm included), "
          f"{spec.num_patches} patches + {spec.num_prefix} prefix tokens, depth {spec.depth}, "
          f"embed dim {spec.embed_dim}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ltmp", description="Learned Thresholds token Merging and Pruning for timm ViTs")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("flops", help="dense GMACs of a timm ViT (fvcore convention)")
    f.add_argument("--model", required=True, help="timm model name, e.g. deit_small_patch16_224")
    f.set_defaults(func=cmd_flops)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"ltmp: error: {e}", file=sys.stderr)
        return 2
