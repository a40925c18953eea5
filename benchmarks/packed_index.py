"""How LTMP packs a padded eval batch (docs/performance.md, "Operator calls"), and why.

1. The flat indices of the real tokens (``patching._packed_index``), two ways with the count known on the host:
   ``nonzero_static`` and a top-k over ``position - 2^24 * keep`` (distinct keys, smallest first).
2. Taking the real rows out and adding them back (``ltmp.ops.PackedRows``): ``index_select`` / ``index_add_`` /
   ``index_copy_`` into zeros against ``gather`` / ``scatter_add_`` with the index expanded to the row width.

Prints the aten calls each makes (``torch.profiler``, nested included) and its time per call, at the batch shapes
of the CIFAR ViT and the DeiT-S shape with about half the tokens padding.

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


def row_ops(flat, idx, wide, rows) -> dict:
    """Each way of ``PackedRows`` (take, add back, pad) as (index ops, expanded-index ops)."""
    return {
        "take": (lambda: flat.index_select(0, idx), lambda: flat.gather(0, wide)),
        "add back": (lambda: flat.index_add_(0, idx, rows), lambda: flat.scatter_add_(0, wide, rows)),
        "pad": (lambda: torch.zeros_like(flat).index_copy_(0, idx, rows),
                lambda: torch.zeros_like(flat).scatter_add_(0, wide, rows)),
    }


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
        width = 128 if tokens == 65 else 384  # the model width of the CIFAR ViT, of DeiT-S
        idx = nonzero_static()
        wide = idx.view(-1, 1).expand(-1, width)  # (T, C): made once per block and width
        flat = torch.randn(batch * tokens, width)  # (B * N, C)
        rows = torch.randn(idx.shape[0], width)  # (T, C)
        pairs = row_ops(flat, idx, wide, rows)
        assert torch.equal(pairs["take"][0](), pairs["take"][1]())
        assert torch.equal(pairs["pad"][0](), pairs["pad"][1]())
        for what, (index_op, expanded_op) in pairs.items():
            a, b = us_per_call(index_op), us_per_call(expanded_op)
            print(f"  {what:8s}: index ops {aten_calls(index_op)} calls {a:.1f} us, expanded index "
                  f"{aten_calls(expanded_op)} calls {b:.1f} us (time ratio {b / a:.2f})")


if __name__ == "__main__":
    main()
