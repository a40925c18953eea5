"""Which eval token layout: packed rows against a padded batch, timed in the engine before issue #37, which had both.

Commit 6f767e8 (the parent of issue #37's engine) could run a padded eval batch three ways, chosen by its
``Execution`` knobs: the token rows packed between layers with attention in groups of similar counts (its
default), packed rows with attention on the whole padded batch (``max_buckets=1``), and a plain padded (B, N, C)
batch (``pack_above=1.0, max_buckets=1``). This script unpacks that commit's package (as benchmarks/ab.py does),
patches LTMP with thresholds calibrated to ``--target`` and times the three, paired round by round.

    python benchmarks/layout.py --model deit-s --batch-size 32 --target 0.5
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

from ab import load_base
from common import calibrated, load_images, load_model
from ltmp.bench import compare_models, paired_ratio


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="6f767e8", help="a commit with the Execution knobs pack_above and max_buckets")
    p.add_argument("--model", default="deit-s", choices=["cifar", "deit-s", "vit-b"])
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, Path(tmp))
        dense = load_model(args.model).eval()
        thresholds = calibrated(dense, args.target)[0].state_dict()
        x = load_images(dense, "test", args.batch_size)
        variants = {
            "packed rows, attention in groups": {},
            "packed rows, attention on the padded batch": dict(max_buckets=1),
            "padded batch": dict(max_buckets=1, pack_above=1.0),
        }
        models = {}
        for name, knobs in variants.items():
            m = base.patch(copy.deepcopy(dense), "ltmp").eval()
            m.load_state_dict(thresholds)
            for k, v in knobs.items():
                setattr(m.ltmp_config.execution, k, v)
            models[name] = m
        t = compare_models(models, x, warmup=2, reps=3, rounds=args.rounds)
    first = next(iter(variants))
    print(
        f"{args.model}, LTMP at r_FLOPs {args.target}, batch {args.batch_size}, commit {args.base}; time / '{first}':"
    )
    for name in list(variants)[1:]:
        r = paired_ratio(t, name, first)
        print(f"  {name}: {r['median']:.3f} (quartiles {r['p25']:.3f}-{r['p75']:.3f})")


if __name__ == "__main__":
    main()
