"""Why ``--deployed openvino`` turns off OpenVINO's MHA kernels ("snippets"), and what that costs.

1. Without ltmp: one attention block as timm writes it (qkv linear, heads split, softmax attention, heads merged,
   projection), exported to ONNX for N tokens and compiled by OpenVINO for the CPU with its default settings and
   with ``SNIPPETS_MODE: DISABLE``. Prints, per head count, the token counts whose outputs differ from eager by
   more than 1e-4, for a static token count and for one exported as a dynamic dimension.
2. ``--time MODEL``: the dense, LTMP (calibrated to r_FLOPs 0.5) and ToMe (at LTMP's GMACs) graphs of
   benchmarks/deployed.py compiled both ways, timed one image at a time over ``--images`` bundled test images in
   interleaved rounds with 1 and 2 threads; prints each graph's time with the kernels off over on, paired by round,
   and how far each one's logits are from eager.

    python benchmarks/openvino_check.py --time deit-s
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from ltmp.bench import compare_models, paired_ratio
from ltmp.export import OPENVINO_CONFIG


class Attention(torch.nn.Module):
    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, heads * head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))  # (B, N, C)


class OpenVino(torch.nn.Module):
    """``ltmp bench --deployed openvino``'s compiled graph, with the fused attention kernels on or off."""

    def __init__(self, path: Path, threads: int, snippets: bool):
        super().__init__()
        import openvino as ov

        config = {k: v for k, v in OPENVINO_CONFIG.items() if not snippets or k != "SNIPPETS_MODE"}
        config["INFERENCE_NUM_THREADS"] = threads
        self.__dict__["compiled"] = ov.Core().compile_model(str(path), "CPU", config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.compiled(x.numpy())[0])


def wrong_counts(heads: int, dynamic: bool, snippets: bool, folder: str, counts=range(1, 13)) -> list[int]:
    torch.manual_seed(0)
    block, bad = Attention(heads, 32).eval(), []
    path = Path(folder) / "attention.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamic:
            torch.onnx.export(
                block,
                (torch.randn(1, 7, heads * 32),),
                path,
                dynamo=True,
                verbose=False,
                dynamic_shapes=({1: torch.export.Dim("tokens", min=1)},),
            )
            runner = OpenVino(path, 1, snippets)
        for n in counts:
            x = torch.randn(1, n, heads * 32)
            if not dynamic:
                torch.onnx.export(block, (x,), path, dynamo=True, verbose=False)
                runner = OpenVino(path, 1, snippets)
            with torch.no_grad():
                if (runner(x) - block(x)).abs().max() > 1e-4:
                    bad.append(n)
    return bad


def time_both(name: str, images: int) -> None:
    from common import deployed_models
    from ltmp.export import deploy

    dense, xs, mine, tome = deployed_models(name, images)
    singles = [x[None] for x in xs]
    with tempfile.TemporaryDirectory() as folder:
        files = {
            label: deploy(m, singles[0], "openvino", folder, label)
            for label, m in (("dense", dense), ("ltmp", mine), ("tome", tome))
        }
        for threads in (1, 2):
            models = {
                f"{label} {s}": OpenVino(p, threads, s == "on") for label, p in files.items() for s in ("on", "off")
            }
            with torch.no_grad():
                t = compare_models(models, singles, warmup=2, reps=2, rounds=3)
            with torch.no_grad():
                eager = {"dense": dense, "ltmp": mine, "tome": tome}
                gap = {
                    k: max(float((m(x) - eager[k.split()[0]](x)).abs().max()) for x in singles)
                    for k, m in models.items()
                }
            for label in files:
                r = paired_ratio(t, f"{label} off", f"{label} on")
                print(
                    f"{name} {label} {threads} thr: snippets on {1000 * t[label + ' on']['median'] / images:.2f} ms, "
                    f"off {1000 * t[label + ' off']['median'] / images:.2f} ms per image; off / on {r['median']:.3f} "
                    f"(IQR {r['p25']:.3f}-{r['p75']:.3f}); largest |logit difference| from eager: on "
                    f"{gap[label + ' on']:.1e}, off {gap[label + ' off']:.1e}",
                    flush=True,
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time", choices=["deit-s", "cifar"], help="also time this model's graphs both ways")
    ap.add_argument("--images", type=int, default=20)
    args = ap.parse_args()
    import openvino as ov

    print(f"OpenVINO {ov.__version__}; token counts 1-12 whose attention output differs from eager by > 1e-4:")
    with tempfile.TemporaryDirectory() as folder:
        for heads in (3, 4, 6):
            for dynamic in (False, True):
                found = {s: wrong_counts(heads, dynamic, s == "on", folder) for s in ("on", "off")}
                print(
                    f"  {heads} heads, {'dynamic' if dynamic else 'static'} token count: snippets on {found['on']}, "
                    f"off {found['off']}",
                    flush=True,
                )
    if args.time:
        time_both(args.time, args.images)


if __name__ == "__main__":
    main()
