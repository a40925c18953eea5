"""Where does a reduced forward spend its time? torch.profiler over batch-1 (or batch-N) eval forwards.

Prints the operators by self CPU time and the number of operator calls per forward, for the dense model and for
LTMP with thresholds calibrated to ``--target`` (as in benchmarks/speed.py).

    python benchmarks/profile_step.py --model cifar --target 0.7
    python benchmarks/profile_step.py --model deit-s --batch-size 32
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch.profiler import ProfilerActivity, profile

import ltmp
from ltmp.train import calibrate
from speed import load_images, load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cifar", choices=["cifar", "deit-s"])
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--method", default="ltmp")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--forwards", type=int, default=8)
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()
    dense = load_model(args.model)
    red = ltmp.patch(copy.deepcopy(dense), args.method)
    r = calibrate(red, load_images(dense, "train", 64), args.target, mode="quantile", iters=12)
    x = load_images(dense, "test", args.forwards * args.batch_size)
    batches = [x[i * args.batch_size:(i + 1) * args.batch_size] for i in range(args.forwards)]
    print(f"{args.model} {args.method}: calibrated r_FLOPs {r:.3f}")
    for name, m in (("dense", dense), (args.method, red)):
        m.eval()
        with torch.no_grad():
            for b in batches:
                m(b)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for b in batches:
                    m(b)
        events = prof.key_averages()
        calls = sum(e.count for e in events)
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n== {name}: {total / 1e3 / args.forwards:.2f} ms self CPU per forward, "
              f"{calls / args.forwards:.0f} operator calls per forward")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
