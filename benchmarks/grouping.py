"""Does running attention in groups of images of similar token counts pay off? Batched eval, interleaved rounds.

For each model and r_target (LTMP thresholds calibrated as in benchmarks/speed.py), times at batch 32: the dense
model, LTMP with attention on the whole padded batch (``ltmp.engine.TUNING`` with ``max_groups=1``), LTMP with
attention in up to 4 groups (the CPU's default, ``ltmp.engine.attend_in_groups``), and ToMe at LTMP's mean GMACs.
Prints time ratios to dense and the groups planned per block (the measurement behind ``TUNING["cpu"]``).

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
    """Runs the patched model with ``tuning`` as its device's entry of ``ltmp.engine.TUNING``."""

    def __init__(self, model: torch.nn.Module, device: str, tuning: dict):
        super().__init__()
        self.model, self.device, self.tuning = model, device, tuning

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        engine.TUNING[self.device] = self.tuning
        return self.model(x)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="deit-s,cifar")
    p.add_argument("--targets", default="0.7,0.5")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--group-macs", type=float, help="fixed cost of a group on this device (TUNING's group_macs)")
    args = p.parse_args()
    device = torch.device(args.device)
    tuned = engine.TUNING.get(device.type, engine.TUNING["default"])
    grouped = dict(group_macs=args.group_macs or tuned["group_macs"], max_groups=max(tuned["max_groups"], 4))
    whole = dict(group_macs=None, max_groups=1)
    print(f"device {device}, group cost {grouped['group_macs']} MACs", flush=True)
    for name in args.models.split(","):
        dense = load_model(name).to(device)
        spec = ltmp.vit_spec(dense)
        x = load_images(dense, "test", args.batch_size).to(device)
        for target in (float(t) for t in args.targets.split(",")):
            red, _ = calibrated(dense, target, device)
            plans = []
            real = engine.plan_groups
            engine.plan_groups = lambda *a, plans=plans, real=real: plans.append(real(*a)) or plans[-1]
            engine.TUNING[device.type] = grouped
            try:
                red(x)
            finally:
                engine.plan_groups = real
            rec = ltmp.stats(red)
            g = float(ltmp.gmacs(spec, rec.kept.cpu()).mean())
            models = {
                "dense": dense,
                "ltmp, whole batch": Grouping(red, device.type, whole),
                f"ltmp, <= {grouped['max_groups']} groups": Grouping(red, device.type, grouped),
                "tome (mean GMACs)": at_gmacs(dense, "tome", g),
            }
            t = compare_models(models, [x], warmup=1, reps=1, rounds=args.rounds)
            engine.TUNING[device.type] = tuned
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
