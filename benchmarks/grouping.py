"""Does running attention in groups of similar token counts pay off? Batched eval, one run, interleaved rounds.

For each model and r_target (LTMP thresholds calibrated as in benchmarks/speed.py), times at batch 32: the dense
model, LTMP with attention on the whole padded batch (``ltmp_config.execution.max_buckets = 1``), LTMP with
attention in up to 4 groups (the CPU's default; ``ltmp.engine.plan_buckets``), and ToMe at LTMP's mean GMACs.
Prints time ratios to dense and the groups planned per block.

    python benchmarks/grouping.py                   # deit-s and cifar, r_target 0.7 and 0.5 (about 5 minutes)
    python benchmarks/grouping.py --models deit-s --targets 0.5
    python benchmarks/grouping.py --device cuda --group-macs 1e6     # try grouping on a GPU (off by default there)
"""

from __future__ import annotations

import argparse

import torch

import ltmp
from common import at_gmacs, calibrated, load_images, load_model
from ltmp import engine
from ltmp.bench import compare_models, paired_ratio


class Grouping(torch.nn.Module):
    """Runs the patched model with at most ``max_buckets`` attention groups."""

    def __init__(self, model: torch.nn.Module, max_buckets: int):
        super().__init__()
        self.model, self.max_buckets = model, max_buckets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.model.ltmp_config.execution.max_buckets = self.max_buckets
        return self.model(x)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="deit-s,cifar")
    p.add_argument("--targets", default="0.7,0.5")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--group-macs",
        type=float,
        help="fixed cost of a group on this device (ltmp.Execution.group_macs); needed on GPUs, where "
        "grouping is off by default",
    )
    args = p.parse_args()
    device = torch.device(args.device)
    tuned = engine.TUNING.get(device.type, engine.TUNING["default"])
    execution = ltmp.Execution(
        group_macs=args.group_macs if args.group_macs is not None else tuned["group_macs"],
        max_buckets=max(tuned["max_buckets"], 4),
    )
    print(f"device {device}, group cost {execution.group_macs} MACs", flush=True)
    default = execution.max_buckets
    for name in args.models.split(","):
        dense = load_model(name).to(device)
        spec = ltmp.vit_spec(dense)
        x = load_images(dense, "test", args.batch_size).to(device)
        for target in (float(t) for t in args.targets.split(",")):
            red, _ = calibrated(dense, target, device)
            red.ltmp_config.execution = execution
            plans = []
            real = engine.plan_buckets
            engine.plan_buckets = lambda *a, plans=plans, real=real: plans.append(real(*a)) or plans[-1]
            try:
                red(x)
            finally:
                engine.plan_buckets = real
            rec = ltmp.stats(red)
            g = float(ltmp.gmacs(spec, rec.kept.cpu()).mean())
            tome = at_gmacs(dense, "tome", g)
            models = {
                "dense": dense,
                "ltmp, whole batch": Grouping(red, 1),
                f"ltmp, <= {default} groups": Grouping(red, default),
                "tome (mean GMACs)": tome,
            }
            t = compare_models(models, [x], warmup=1, reps=1, rounds=args.rounds)
            execution.max_buckets = default
            groups = [0 if p is None else len(p) for p in plans]
            print(
                f"== {name} r_target {target}: GMACs ratio {g / ltmp.dense_gmacs(spec):.3f}, executed "
                f"{ltmp.gmacs_executed(spec, rec.padded) / ltmp.dense_gmacs(spec):.3f}; groups per block "
                f"{groups}"
            )
            for k, v in t.items():
                ratio = paired_ratio(t, k, "dense")["median"]
                print(f"   {k:<20} {1000 * v['median']:8.2f} ms  time ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
