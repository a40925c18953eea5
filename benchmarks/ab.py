"""A/B: this checkout's ltmp against another commit's, on the same model, thresholds and images, in one process.

The other commit's ``src/ltmp`` is unpacked (``git archive``) into a temporary folder as the package ``ltmp_base``
(ltmp imports itself relatively, so both load side by side). LTMP gets thresholds calibrated to ``--target`` with
this checkout's code, loaded into both; a fixed-rate ``--method`` gets the schedule at LTMP's GMACs. Prints whether
both keep the same tokens, their largest logit difference, and paired time ratios (``ltmp.bench.paired_ratio``):
each against dense, and this checkout against the other commit.

    python benchmarks/ab.py --base HEAD~1 --model deit-s --batch-size 32
    python benchmarks/ab.py --base 8fc40c6 --model cifar --batch-size 1 --method tome
    python benchmarks/ab.py --base 051fca3 --model cifar --batch-size 64 --train   # train fwd + bwd, new / base
    python benchmarks/ab.py --base 0f8a7e2 --model cifar --method tome --deployed onnx --threads 2

``--deployed RUNTIME`` times the three models exported for a deployment runtime instead, each package exporting its
own (``ltmp.export.deploy``), one image at a time as ``ltmp bench --deployed`` does (``--threads``): the ratio of the
two deployed engines in the same interleaved rounds, where two runs of ``benchmarks/deployed.py`` would compare ratios
to dense from different hours.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import ltmp
from common import ROOT, at_gmacs, calibrated, load_images, load_model, mean_gmacs
from ltmp.bench import allocator, compare_models, paired_ratio
from ltmp.export import RUNTIMES


def load_base(commit: str, folder: Path):
    """The package ``ltmp_base``: ``src/ltmp`` at ``commit``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "src/ltmp"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    (folder / "src" / "ltmp").rename(folder / "ltmp_base")
    sys.path.insert(0, str(folder))
    return importlib.import_module("ltmp_base")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against")
    p.add_argument("--model", default="cifar", choices=["cifar", "deit-s", "vit-b"])
    p.add_argument("--method", default="ltmp")
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=32, help="1: 8 single images per repetition")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--train", action="store_true", help="time a train-mode forward + backward (LTMP) instead")
    p.add_argument("--deployed", choices=sorted(RUNTIMES), help="time the models exported for this runtime instead")
    p.add_argument("--threads", type=int, default=1, help="with --deployed: the runtime's threads")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_pkg = load_base(args.base, Path(tmp))
        if args.train:
            return train_ab(args, base_pkg)
        dense = load_model(args.model).eval()
        new, r = calibrated(dense, args.target, "cpu")
        x = load_images(dense, "test", max(args.batch_size, 8))
        if args.method == "ltmp":
            base = base_pkg.patch(copy.deepcopy(dense), "ltmp").eval()
            base.load_state_dict(new.state_dict())
        else:
            new = at_gmacs(dense, args.method, mean_gmacs(new, x))
            key = "r" if args.method == "tome" else "k"
            base = base_pkg.patch(copy.deepcopy(dense), args.method, **{key: new.ltmp_config.rate}).eval()
        inputs = x[: args.batch_size] if args.batch_size > 1 else [x[i : i + 1] for i in range(8)]
        with torch.no_grad():
            a, b = new(x[:8]), base(x[:8])
            same = torch.equal(ltmp.stats(new).kept, base_pkg.stats(base).kept)
            print(
                f"{args.model} {args.method} (calibrated r_FLOPs {r:.3f}), batch {args.batch_size}, this checkout "
                f"against {args.base}: same kept counts {same}, max |logit difference| "
                f"{float((a - b).abs().max()):.2e}; {allocator()}"
            )
            models = {"dense": dense, "new": new, "base": base}
            if args.deployed:
                models = deployed(models, base_pkg, x[:1], args.deployed, args.threads, Path(tmp))
                inputs = [x[i : i + 1] for i in range(8)]
                print(f"  deployed for {args.deployed}, {args.threads} thread(s), one image at a time")
            timed = compare_models(models, inputs, warmup=1, reps=args.reps, rounds=args.rounds)
    for num, den in (("new", "dense"), ("base", "dense"), ("new", "base")):
        v = paired_ratio(timed, num, den)
        print(f"  {num} / {den}: {v['median']:.3f} (quartiles {v['p25']:.3f}-{v['p75']:.3f})")
    return 0


def deployed(models: dict, base_pkg, example: torch.Tensor, runtime: str, threads: int, folder: Path) -> dict:
    """The models exported for ``runtime`` (the base by its own package's export) and loaded with ``threads``."""
    out = {}
    for name, m in models.items():
        export = importlib.import_module(f"{(base_pkg if name == 'base' else ltmp).__name__}.export")
        out[name] = export.load_deployed(export.deploy(m, example, runtime, folder, name), runtime, threads)
    return out


def train_ab(args, base_pkg) -> int:
    """Paired time of one train step (masked forward, a loss on the logits and r_FLOPs, backward to the
    thresholds), this checkout against the base, alternating, after 2 warm-up pairs."""
    dense = load_model(args.model)
    x = load_images(dense, "test", args.batch_size)
    pairs = []
    for pkg in (ltmp, base_pkg):
        m = pkg.patch(copy.deepcopy(dense), "ltmp", merge_threshold=0.9, prune_threshold=0.01).train()
        for n, q in m.named_parameters():
            q.requires_grad_(n.endswith("threshold"))
        pairs.append((m, pkg.stats))

    def step(m, stats) -> float:
        t0 = time.perf_counter()
        (m(x).logsumexp(1).mean() + stats(m).keep_frac.mean()).backward()
        return time.perf_counter() - t0

    ratios = [step(*pairs[0]) / step(*pairs[1]) for _ in range(2 + args.rounds * args.reps)][2:]
    q = statistics.quantiles(ratios, n=4)
    print(
        f"{args.model} ltmp train step, batch {args.batch_size}, this checkout / {args.base}: "
        f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, {len(ratios)} pairs)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
