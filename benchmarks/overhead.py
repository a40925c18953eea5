"""Where batch-1 time goes besides arithmetic (the numbers behind docs/performance.md, "Why batch 1 ...").

1. One reduction step in isolation at the DeiT-S shape (197 tokens, 384 channels, 6 heads), at 1 and N threads.
2. GEMM scaling: a 384 -> 1536 linear at 98 and 197 tokens, and at a fixed vs varying token count.
3. LTMP (calibrated to r_FLOPs 0.7 on 16 images) and ToMe at the same GMACs against dense, 8 images at batch 1,
   with 1 and with 2 threads.
4. The modules that do nothing in eval (timm's dropouts and identities) in one batch-1 LTMP forward on the CIFAR-10
   ViT: how many it calls, the time of one call of each, and their share of the forward.

    python benchmarks/overhead.py
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter

import torch

import ltmp
from common import at_gmacs, calibrated, load_images, load_model
from ltmp.bench import compare_models, paired_ratio
from ltmp.config import ReduceConfig
from ltmp.engine import plan
from ltmp.step import Layout, TokenState, reduce_step


def per_call_us(fn, n: int) -> float:
    for _ in range(max(3, n // 10)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def thread_counts():
    """Yields 1 and the process's thread count (once if equal), with torch set to each; restores it after."""
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            yield n
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    N, C, H, D = 197, 384, 6, 64
    x, metric = torch.randn(N, C), torch.randn(1, N, D)  # one image's token rows, its keys summed over heads
    importance = torch.randn(1, H, N, N).softmax(-1).mean(dim=(1, 2))
    state = TokenState(size=torch.ones(N), layout=Layout(1, N))
    cfg = ReduceConfig(method="ltmp")
    p = plan(cfg, training=False, device=x.device.type, keep_one=False)
    mt, pt = torch.tensor(0.3), torch.tensor(0.5 / N)

    def step():
        return reduce_step(x, state, cfg, p, 0, importance.clone(), metric, mt, pt, 0)

    kept = step()[0].shape[0]
    for n in thread_counts():  # its operators are small: a second thread can cost more than it saves
        us = statistics.median(per_call_us(step, 200) for _ in range(5))
        print(f"1. one LTMP reduction step, batch 1, DeiT-S shape ({N} -> {kept} tokens), {n} thread(s): {us:.0f} us")

    lin = torch.nn.Linear(384, 1536)
    xs = {m: torch.randn(1, m, 384) for m in range(90, 200)}
    t98 = statistics.median(per_call_us(lambda: lin(xs[98]), 200) for _ in range(5))
    t197 = statistics.median(per_call_us(lambda: lin(xs[197]), 200) for _ in range(5))
    print(
        f"2. linear 384->1536: 98 tokens {t98:.0f} us, 197 tokens {t197:.0f} us, ratio {t98 / t197:.3f} "
        f"(token ratio {98 / 197:.3f})"
    )
    rng = random.Random(0)
    varied = [rng.randint(90, 190) for _ in range(100)]
    mean_m = round(statistics.mean(varied))
    fixed_us = statistics.median(per_call_us(lambda: [lin(xs[mean_m]) for _ in range(100)], 5) for _ in range(5))
    varied_us = statistics.median(per_call_us(lambda: [lin(xs[m]) for m in varied], 5) for _ in range(5))
    print(
        f"   100 calls at a fixed {mean_m} tokens {fixed_us / 1e3:.1f} ms, at varying counts (mean {mean_m}) "
        f"{varied_us / 1e3:.1f} ms, ratio {varied_us / fixed_us:.3f}"
    )

    dense = load_model("deit-s")
    spec = ltmp.vit_spec(dense)
    red, _ = calibrated(dense, 0.7)
    singles = [s[None] for s in load_images(dense, "test", 8)]
    g = statistics.mean(float(ltmp.gmacs(spec, (red.eval()(s), ltmp.stats(red).kept)[1])[0]) for s in singles)
    tome = at_gmacs(dense, "tome", g)
    for n in thread_counts():
        t = compare_models({"dense": dense, "ltmp": red, "tome": tome}, singles, warmup=1, reps=1, rounds=6)
        print(
            f"3. {n} thread(s), batch 1, GMACs ratio {g / ltmp.dense_gmacs(spec):.3f}: time ratio LTMP "
            f"{paired_ratio(t, 'ltmp', 'dense')['median']:.3f}, ToMe {paired_ratio(t, 'tome', 'dense')['median']:.3f}"
            f" (dense {1000 * t['dense']['median'] / len(singles):.1f} ms per image)"
        )

    small = load_model("cifar")
    red, _ = calibrated(small, 0.5)
    x = load_images(small, "test", 1)  # (1, 3, H, W)
    calls = Counter()
    hook = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.update([type(m).__name__]))
    red(x)
    hook.remove()
    spec = ltmp.vit_spec(small)
    t = torch.randn(spec.num_prefix + spec.num_patches, spec.embed_dim)  # (N, C): one image's rows
    idle = {"Dropout": torch.nn.Dropout(0.0).eval(), "Identity": torch.nn.Identity()}
    us = {k: statistics.median(per_call_us(lambda m=m: m(t), 20000) for _ in range(5)) for k, m in idle.items()}
    fwd = statistics.median(per_call_us(lambda: red(x), 50) for _ in range(5))
    spent = sum(calls[k] * us[k] for k in idle)
    print(
        f"4. one batch-1 LTMP forward on the CIFAR-10 ViT, {torch.get_num_threads()} thread(s): "
        + ", ".join(f"{calls[k]} {k} calls of {us[k]:.2f} us" for k in idle)
        + f": {spent:.0f} us of {fwd:.0f} us ({spent / fwd:.1%})"
    )


if __name__ == "__main__":
    main()
