"""Why LTMP's packed index is ``nonzero_static`` and not a top-k (docs/performance.md, "Operator calls").

The flat indices of a padded eval batch's real tokens (``patching._packed_index``), two ways with the count known
on the host: ``nonzero_static`` and a top-k over ``position - 2^24 * keep`` (distinct keys, smallest first). Prints
the aten calls each makes (``torch.profiler``, nested included) and its time per call, at the batch shapes of the
CIFAR ViT and the DeiT-S shape with about half the tokens padding.

    python benchmarks/packed_index.py
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile


def aten_calls(fn) -> int:
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def us_per_call(fn, n: int = 200) -> float:
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for batch, tokens in ((32, 65), (32, 197), (256, 197)):
        keep = (torch.rand(batch * tokens) < 0.5).float()  # (B * N,) 1 real, 0 padding
        real = int(keep.sum())
        pos = torch.arange(keep.numel(), dtype=keep.dtype)

        def nonzero_static(keep=keep, real=real):
            return torch.nonzero_static(keep, size=real).squeeze(1)

        def topk(keep=keep, real=real, pos=pos):
            return torch.add(pos, keep, alpha=-2.0 ** 24).topk(real, largest=False).indices

        assert torch.equal(nonzero_static(), topk())
        a, b = us_per_call(nonzero_static), us_per_call(topk)
        print(f"batch {batch} x {tokens} tokens: nonzero_static {aten_calls(nonzero_static)} calls {a:.1f} us, "
              f"top-k {aten_calls(topk)} calls {b:.1f} us (time ratio {b / a:.2f})")


if __name__ == "__main__":
    main()
