"""Do the CUDA paths compute what the CPU paths compute? A check for a lent GPU machine (issue #5), never in CI.

For the CIFAR-10 ViT and the DeiT-S shape of benchmarks/speed.py (random weights, 224x224), with LTMP thresholds
calibrated on the CPU (``calibrate(mode="quantile")``, r_target 0.6) and copied to the GPU, it compares in fp32
(TF32 off):

- eval, batch 16: logits of CUDA vs CPU, and the kept token counts per image and block;
- eval on CUDA: the padded batch of 16 against the same images one at a time (padding changes nothing);
- train mode: the loss ``CE + budget_loss`` and the gradients that reach the thresholds, CUDA vs CPU in float64
  (same function) and fp32 CUDA against the float64 reference (precision);
- ToMe (r=4) and top-k pruning (k=4) eval logits, CUDA vs CPU;
- bf16 autocast on CUDA: eval stays finite and keeps about as many tokens as fp32 (within 5%: bf16 activations
  alone moved the DeiT-S count by 3.7% in a CPU dry run, bf16 similarities had moved it by 14%), the padded batch
  keeps the same counts as one image at a time (most images: bf16 rounding differs between batch shapes), and a
  train step's threshold gradients are finite.

Decisions taken right at a threshold can flip between devices (different float rounding); logits are compared on
the images whose kept counts agree in every block, and the number that differ is printed. Exits 1 if a check fails.

    python benchmarks/cuda_check.py                 # needs a CUDA device
    python benchmarks/cuda_check.py --device cpu    # dry run of the script itself
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F

import ltmp
from common import calibrated, load_images, load_model
from ltmp.thresholds import set_thresholds, threshold_tensors

FAILED: list[str] = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name:<58} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def kept(model) -> torch.Tensor:
    return ltmp.stats(model).kept.cpu()  # (B, L)


@torch.no_grad()
def closest_margin(model, x: torch.Tensor) -> str:
    """How close the nearest similarity and importance scores come to their block's thresholds: a hard decision
    this close can flip between devices, thread counts or library versions (float sums in another order)."""
    cap = model.ltmp_config.capture = []
    try:
        model.eval()(x)
    finally:
        model.ltmp_config.capture = None
    th = {n: p.item() for n, p in model.named_parameters() if n.endswith("_threshold")}
    merge = min(
        float((c.scores[c.candidates] - th[f"blocks.{c.layer}.merge_threshold"]).abs().min())
        for c in cap
        if c.op == "merge" and c.candidates.any()
    )
    prune = min(
        float((c.scores[c.candidates] - th[f"blocks.{c.layer}.prune_threshold"]).abs().min())
        for c in cap
        if c.op == "prune" and c.candidates.any()
    )
    return f"similarity {merge:.1e}, importance {prune:.1e} (absolute)"


def run(name: str, cuda: torch.device) -> None:
    dense = load_model(name)
    cpu_m, _ = calibrated(dense, 0.6)
    gpu_m = ltmp.patch(copy.deepcopy(dense), "ltmp").to(cuda)
    set_thresholds(gpu_m, {k: v.to(cuda) for k, v in threshold_tensors(cpu_m).items()})
    x = load_images(dense, "test", 16)  # (16, 3, H, W)
    y = torch.arange(16) % 10
    xg, yg = x.to(cuda), y.to(cuda)

    print(f"     {name}: closest score to a threshold (eval, CPU): {closest_margin(cpu_m, x)}")
    with torch.no_grad():
        out_c, k_c = cpu_m.eval()(x), kept(cpu_m)
        out_g, k_g = gpu_m.eval()(xg), kept(gpu_m)
        same = (k_c == k_g).all(1)  # (16,) images whose counts agree in every block
        check(
            f"{name}: eval kept counts CUDA == CPU",
            int(same.sum()) >= 14,
            f"{int(same.sum())}/16 images identical in all blocks; mean kept last block CPU "
            f"{k_c[:, -1].float().mean():.2f} CUDA {k_g[:, -1].float().mean():.2f}",
        )
        e = rel(out_g[same.to(cuda)], out_c[same])
        check(
            f"{name}: eval logits CUDA vs CPU (same counts)",
            int(same.sum()) >= 14 and e < 1e-4,
            f"rel err {e:.2e} (< 1e-4) over {int(same.sum())} images",
        )

        one = [(gpu_m(xg[i : i + 1]), kept(gpu_m)) for i in range(16)]
        singles, k_s = torch.cat([o for o, _ in one]), torch.cat([k for _, k in one])  # (16, classes), (16, L)
        same_s = (k_s == k_g).all(1)
        e = rel(out_g[same_s.to(cuda)], singles[same_s.to(cuda)])
        check(
            f"{name}: CUDA padded batch == one at a time",
            int(same_s.sum()) >= 14 and e < 1e-4,
            f"{int(same_s.sum())}/16 same counts, rel err {e:.2e} (< 1e-4)",
        )

        for method, kw in (("tome", {"r": 4}), ("topk-prune", {"k": 4})):
            mc = ltmp.patch(copy.deepcopy(dense), method, **kw).eval()
            mg = copy.deepcopy(mc).to(cuda)
            e = rel(mg(xg), mc(x))
            check(f"{name}: {method} eval logits CUDA vs CPU", e < 1e-4, f"rel err {e:.2e} (< 1e-4)")

    grads = {}  # (device, dtype) -> (loss, threshold gradients)
    for dev, m0, xi, yi in (("cpu", cpu_m, x, y), ("cuda", gpu_m, xg, yg)):
        for dt in (torch.float32, torch.float64):
            m = copy.deepcopy(m0).to(dt).train()
            loss = F.cross_entropy(m(xi.to(dt)), yi) + ltmp.budget_loss(m, 0.6)
            loss.backward()
            grads[dev, dt] = (
                float(loss.detach()),
                torch.cat(
                    [p.grad.flatten().double().cpu() for n, p in m.named_parameters() if n.endswith("_threshold")]
                ),
            )
    f32, f64 = torch.float32, torch.float64
    lc, lg = grads["cpu", f32][0], grads["cuda", f32][0]
    check(f"{name}: train loss CUDA vs CPU", abs(lg - lc) < 1e-5 * abs(lc), f"{lc:.6f} vs {lg:.6f}")
    ref = grads["cpu", f64][1]
    e64 = rel(grads["cuda", f64][1], ref)
    check(
        f"{name}: threshold gradients CUDA vs CPU, float64",
        e64 < 1e-9 and ref.abs().sum() > 0,
        f"rel err {e64:.2e} (< 1e-9), |grad| sum {ref.abs().sum():.3e}",
    )
    e32, c32 = rel(grads["cuda", f32][1], ref), rel(grads["cpu", f32][1], ref)
    check(
        f"{name}: threshold gradients fp32 CUDA vs float64",
        e32 < 1e-3,
        f"rel err {e32:.2e} (< 1e-3); fp32 CPU: {c32:.2e}",
    )

    with torch.no_grad(), torch.autocast(cuda.type, dtype=torch.bfloat16):
        out_b = gpu_m.eval()(xg)
    k_b = kept(gpu_m)  # (16, L)
    kb = k_b[:, -1].float().mean()
    ok = bool(torch.isfinite(out_b).all()) and abs(kb / k_g[:, -1].float().mean() - 1) < 0.05
    check(
        f"{name}: bf16 autocast eval (CUDA)",
        ok,
        f"finite; mean kept last block {kb:.2f} vs fp32 "
        f"{k_g[:, -1].float().mean():.2f} (within 5%); logits rel err to fp32 {rel(out_b.float(), out_g):.2e}",
    )
    k_1 = []
    with torch.no_grad(), torch.autocast(cuda.type, dtype=torch.bfloat16):
        for i in range(16):
            gpu_m(xg[i : i + 1])
            k_1.append(kept(gpu_m))
    n = int((torch.cat(k_1) == k_b).all(1).sum())  # (16, L) against (16, L)
    check(
        f"{name}: bf16 padded batch vs one at a time: kept counts",
        n >= 12,
        f"{n}/16 images identical in all blocks (>= 12; bf16 rounding differs between batch shapes)",
    )
    gpu_m.train()
    gpu_m.zero_grad()
    with torch.autocast(cuda.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(gpu_m(xg), yg) + ltmp.budget_loss(gpu_m, 0.6)
    loss.backward()
    g = torch.cat([p.grad.flatten() for n, p in gpu_m.named_parameters() if n.endswith("_threshold")])
    check(
        f"{name}: bf16 autocast train step",
        bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0,
        f"loss {float(loss.detach()):.4f}, threshold gradients finite, |grad| sum {float(g.abs().sum()):.3e}",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="'cpu' only dry-runs this script (CPU against CPU)")
    cuda = torch.device(p.parse_args().device)
    if cuda.type == "cuda" and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(cuda) if cuda.type == "cuda" else "CPU (dry run)"
    print(f"{name}, torch {torch.__version__}, timm {__import__('timm').__version__}")
    for name in ("cifar", "deit-s"):
        run(name, cuda)
    print(f"{len(FAILED)} failed" + (": " + ", ".join(FAILED) if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
