"""Where does a reduced forward spend its time? torch.profiler over batch-1 (or batch-N) eval forwards.

Prints the operators by self CPU time, the number of aten operator calls (all, and those not nested in another
aten call: the ones made from Python, each with its own dispatch) and of host synchronisations
(``ltmp.runtime.HostSyncs``) per forward, for the dense model and for LTMP with thresholds calibrated to
``--target`` (as in benchmarks/speed.py), or a fixed-rate ``--method`` at LTMP's GMACs. ``--summary`` prints one
line per model instead of the operator tables; ``--per-block`` adds the aten calls inside each block and outside
the blocks; ``--by-line N`` the N source lines whose torch calls take the most wall time (CPU; torch's own modules
are looked through, so a line of ltmp or timm gets the time of the functional calls it makes).

    python benchmarks/profile_step.py --model cifar --target 0.7
    python benchmarks/profile_step.py --model deit-s --batch-size 32
    python benchmarks/profile_step.py --model deit-s --batch-size 32 --device cuda   # + GPU kernel time
    python benchmarks/profile_step.py --method tome --batch-size 32 --summary --tome-ref /path/to/ToMe

``--tome-ref DIR`` (a checkout of facebookresearch/ToMe, not part of ltmp) also profiles the reference ToMe's own
timm patch with the same per-layer r as ``--method tome``.

On CUDA it also prints the wall time per forward next to the summed kernel time: a forward whose wall time is far
above its kernel time is bound by launching operators, not by the GPU.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile, record_function

import ltmp
from common import at_gmacs, calibrated, load_images, load_model, mean_gmacs, reference_tome
from ltmp import engine
from ltmp.bench import allocator
from ltmp.runtime import HostSyncs, compile_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cifar", choices=["cifar", "deit-s", "vit-b"])
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--method", default="ltmp")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--forwards", type=int, default=8)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--device", default="cpu")
    p.add_argument("--summary", action="store_true", help="no operator tables")
    p.add_argument("--per-block", action="store_true", help="also the aten calls of each block and outside them")
    p.add_argument(
        "--by-line",
        type=int,
        default=0,
        metavar="N",
        help="also the N source lines whose torch calls take the most time (CPU)",
    )
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--max-groups", type=int, help="ltmp.engine.TUNING's max_groups (1: attention never in groups)")
    p.add_argument(
        "--tome-ref", help="a checkout of facebookresearch/ToMe: also profile its timm patch (with --method tome)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="both models under ltmp.runtime.compile_model (the first "
        "forwards compile; the counts are of compiled forwards)",
    )
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dense = load_model(args.model).to(device)
    learned = ltmp.METHODS[args.method][1] == "threshold"
    red, r = calibrated(dense, args.target, device, method=args.method if learned else "ltmp")
    x = load_images(dense, "test", args.forwards * args.batch_size).to(device)
    if not learned:  # a fixed-rate method at LTMP's GMACs on these images
        red = at_gmacs(dense, args.method, mean_gmacs(red, x))
    if args.max_groups is not None:
        engine.TUNING[device.type] = dict(
            engine.TUNING.get(device.type, engine.TUNING["default"]), max_groups=args.max_groups
        )
    batches = [x[i * args.batch_size : (i + 1) * args.batch_size] for i in range(args.forwards)]
    print(
        f"{args.model} {args.method}: calibrated r_FLOPs {r:.3f}"
        + ("" if learned else " (LTMP's; matched GMACs)")
        + ("" if cuda else f"; {allocator()}")
    )
    models = [("dense", dense), (args.method, red)]
    if args.by_line and args.compile:
        p.error("--by-line times eager calls; run it without --compile")
    if args.tome_ref:
        if args.method != "tome":
            p.error("--tome-ref needs --method tome (the reference runs ToMe's r schedule)")
        models.append(("tome-ref", reference_tome(dense, args.tome_ref, red.ltmp_config.rate).to(device)))
    for name, m in models:
        m.eval()
        if args.compile:
            m = compile_model(m, device)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            for b in batches:
                m(b)
            walls = []
            for _ in range(5):  # median of 5 unprofiled passes over the batches
                if cuda:
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                for b in batches:
                    m(b)
                if cuda:
                    torch.cuda.synchronize(device)
                walls.append((time.perf_counter() - t) / args.forwards)
            wall = statistics.median(walls)
            with HostSyncs() as syncs:
                for b in batches:
                    m(b)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof, marked_blocks(m, args.per_block):
                for b in batches:
                    m(b)
        events = prof.key_averages()
        calls = sum(e.count for e in events if e.key.startswith("aten::"))  # not kernels, not CUDA runtime calls
        outer = sum(
            1
            for e in prof.events()
            if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
        )  # made from Python, not nested
        total = sum(e.self_cpu_time_total for e in events)
        kernels = ""
        if cuda:
            # kernel events only (the ops that launch them repeat their time), as the table's "Self CUDA" total
            dev_us = sum(
                e.self_device_time_total
                for e in events
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation
            )
            kernels = f", {dev_us / 1e3 / args.forwards:.2f} ms of GPU kernels"
        print(
            f"\n== {name}: {1000 * wall:.2f} ms wall per forward (unprofiled){kernels}, "
            f"{total / 1e3 / args.forwards:.2f} ms self CPU, "
            f"{calls / args.forwards:.0f} aten operator calls ({outer / args.forwards:.0f} not nested in another) "
            f"and {syncs.count / args.forwards:g} host "
            f"synchronisations per forward" + (f" ({syncs.calls})" if syncs.calls else "")
        )
        if args.per_block:
            per_block, outside = block_calls(prof, args.forwards)
            print(f"   aten calls per block: {per_block}; outside the blocks: {outside:g}")
        if args.by_line:
            with (
                torch.no_grad(),
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp),
                TimedLines() as lines,
            ):
                for b in batches:
                    m(b)
            print(f"   per source line (ms per forward, calls; {lines.total() / args.forwards:.1f} ms in torch calls):")
            for where, (sec, n) in lines.top(args.by_line):
                print(f"   {1e3 * sec / args.forwards:9.2f} {n / args.forwards:6g}  {where}")
        if not args.summary:
            print(
                events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=args.rows)
            )


BLOCK = "profile_step.block"


@contextlib.contextmanager
def marked_blocks(model, on: bool):
    """Each transformer block's forward inside a ``record_function`` range (a patched model runs its blocks
    through ``ltmp.engine.block``, a timm model or the reference ToMe through the block modules)."""
    if not on:
        yield
        return
    import ltmp.engine

    def marked(fn):
        def run(*args, **kwargs):
            with record_function(BLOCK):
                return fn(*args, **kwargs)

        return run

    patched = hasattr(model, "ltmp_config")
    block_fn = ltmp.engine.block
    if patched:
        ltmp.engine.block = marked(block_fn)
    else:
        for blk in model.blocks:
            blk.forward = marked(blk.forward)
    try:
        yield
    finally:
        if patched:
            ltmp.engine.block = block_fn
        else:
            for blk in model.blocks:
                del blk.forward


class TimedLines(TorchFunctionMode):
    """Wall time of the outermost torch calls (functions, methods, modules' functional calls), summed per source
    line outside torch itself: on the CPU every call finishes before it returns, so this is where the host time
    goes, line by line."""

    def __init__(self):
        super().__init__()
        self.stats: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        self._depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth:
            return func(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back
        where = "?" if frame is None else f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        self._depth += 1
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            entry = self.stats[f"{where} {getattr(func, '__name__', func)}"]
            entry[0] += time.perf_counter() - start
            entry[1] += 1
            self._depth -= 1

    def total(self) -> float:
        return 1e3 * sum(sec for sec, _ in self.stats.values())

    def top(self, n: int) -> list:
        return sorted(self.stats.items(), key=lambda kv: -kv[1][0])[:n]


TORCH_DIR = str(Path(torch.__file__).parent) + os.sep  # not torchvision/


def block_calls(prof, forwards: int) -> tuple[list[float], float]:
    """aten calls inside each block's range (per forward, in block order) and outside every block."""
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == BLOCK)
    calls = [0] * len(ranges)
    outside = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        i = bisect.bisect_right(ranges, (e.time_range.start, math.inf)) - 1
        if i >= 0 and e.time_range.end <= ranges[i][1]:
            calls[i] += 1
        else:
            outside += 1
    depth = len(ranges) // forwards
    per_block = [sum(calls[f * depth + i] for f in range(forwards)) / forwards for i in range(depth)]
    return [round(c, 1) for c in per_block], outside / forwards


if __name__ == "__main__":
    main()
