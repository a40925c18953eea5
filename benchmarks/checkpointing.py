"""Gradient checkpointing of a patched model in train mode: the peak memory of one training step with and without
``set_grad_checkpointing(True)``, and its time.

One threshold-training step (``ltmp train``'s mode: train-mode masks, the backbone frozen, thresholds learning) of
LTMP at its initial thresholds, forward and backward, each setting in a fresh process; the peak resident memory of
that process (``ru_maxrss``) after the step, less the peak before it, is the step's memory.

    python benchmarks/checkpointing.py                       # the bundled CIFAR-10 ViT, batch 128
    python benchmarks/checkpointing.py --model deit-s --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

import ltmp
from common import load_images, load_model


def step(model_name: str, batch: int, on: bool) -> dict:
    """One training step in this process: its added peak memory (MiB) and time (s)."""
    dense = load_model(model_name)
    x = load_images(dense, "train", batch)
    model = ltmp.patch(dense, "ltmp", merge_threshold=0.9, prune_threshold=0.002)
    model.eval()
    model.training = True  # ltmp.train.threshold_training_mode: masks, no dropout
    for name, p in model.named_parameters():
        p.requires_grad_("threshold" in name)
    model.set_grad_checkpointing(on)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    loss = model(x).logsumexp(-1).mean() + ltmp.budget_loss(model, 0.5)
    loss.backward()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"checkpointing": on, "step_mib": round(peak - before, 1), "seconds": round(seconds, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cifar", choices=["cifar", "deit-s", "vit-b"])
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(step(args.model, args.batch_size, args.child == "on")))
        return
    rows = []
    for setting in ("off", "on"):
        cmd = [sys.executable, __file__, "--model", args.model, "--batch-size", str(args.batch_size)]
        out = subprocess.run([*cmd, "--child", setting], check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    off, on = rows
    print(
        f"{args.model}, batch {args.batch_size}, one LTMP threshold-training step ({torch.get_num_threads()} "
        f"threads): memory {off['step_mib']:.0f} MiB without checkpointing, {on['step_mib']:.0f} MiB with "
        f"({on['step_mib'] / off['step_mib']:.2f}x); time {off['seconds']:.2f} s and {on['seconds']:.2f} s"
    )


if __name__ == "__main__":
    main()
