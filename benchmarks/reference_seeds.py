"""Given the same recipe and learning rates, do this project's LTP thresholds swing and collapse as the authors' do?

A collapsed block is one whose prune threshold passes every importance score, so it prunes every patch token of
every image; its thresholds then get little gradient, though at high rates they can come back. At the setting of
``--scale`` (``benchmarks/reference_pipeline.py``'s learning-rate settings: ``10x`` is 10 times the paper's rates
scaled to one epoch here), for each seed, this script trains:

- the authors' code: ``reference_pipeline.py``'s train stage (their ``tools/train.py``, its recipe, r_target 0.5,
  one epoch), whose ``thresholds.jsonl`` keeps every step's thresholds (before their [0, 1] clamp);
- this project's code: ``ltmp train --recipe paper`` at the same rates, budget and seed, which, like the reference,
  trains on through a collapsed block (its ``log.jsonl`` keeps every step's thresholds).

``HIGH`` is checked first: each block's 99th percentile of patch-token importance on the unreduced model
(``importance_p99``, kept as ``importance_p99``) must lie below it. For each run it records how many steps ran, the
steps at which some prune threshold was at or above ``HIGH`` (a jump that prunes nearly a whole block), the longest
such spell of one block, how many spells ended before the last step and their median length, the spells still on at
the last step (their steps and values), the thresholds' range and the final thresholds; ``--json`` keeps them, with
the seeds and parity steps it holds from earlier calls at the same setting. Runs are kept under ``--runs`` and reused.

    python benchmarks/reference_seeds.py --reference PATH --python REF_PYTHON [--scale 10x] [--seeds 0 1 2]
        [--runs runs/reference-seeds] [--json results/reference_seeds.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reference_pipeline import DATA, R_TARGET, _ref, learning_rates, ltmp_train, write_json  # noqa: E402

#: a prune threshold at or above this prunes more than 99% of its block's patch tokens: it is above every block's
#: 99th percentile of patch-token importance on the unreduced model (:func:`importance_p99`, kept in the JSON)
HIGH = 0.2


def importance_p99(n: int = 256) -> list[float]:
    """Each block's 99th percentile of patch-token importance (eq. 17) on the unreduced bundled CIFAR-10 ViT, over
    ``n`` test images, read through ``ReduceConfig.capture`` (prune thresholds at -inf: nothing is pruned)."""
    import math
    import warnings

    import torch

    import ltmp
    from common import load_images, load_model

    with warnings.catch_warnings():  # "reduces no tokens": as asked
        warnings.simplefilter("ignore")
        model = ltmp.patch(load_model("cifar"), "ltp", prune_threshold=-math.inf)
    captured = []
    model.ltmp_config.capture = captured.append
    with torch.no_grad():
        model(load_images(model, "test", n))
    return [round(float(c.scores[c.candidates].quantile(0.99)), 4) for c in captured]


def summary(steps: list[list[float]]) -> dict:
    """What a run's per-step prune thresholds (steps x blocks) show. A spell is a block's run of steps at or above
    ``HIGH``; one still running at the last step is open."""
    high = [i + 1 for i, t in enumerate(steps) if max(t) >= HIGH]
    final = [round(t, 4) for t in steps[-1]] if steps else []
    spells, open_ = [], []  # (length, block from 1)
    for b in range(len(final)):
        run = 0
        for t in steps:
            if t[b] >= HIGH:
                run += 1
            elif run:
                spells.append((run, b + 1))
                run = 0
        if run:
            open_.append((run, b + 1))
    lengths = sorted(n for n, _ in spells)
    low, top = (min(min(t) for t in steps), max(max(t) for t in steps)) if steps else (None, None)
    return {
        "steps": len(steps),
        "high_steps": high,
        "final": final,
        "ends_high": [b for _, b in open_],  # blocks still (nearly) emptied at the end
        "longest_high": max(spells + open_, default=(0, None)),  # (steps in a row, block)
        "spells": len(spells),  # ended before the last step
        "median_spell": lengths[len(lengths) // 2] if lengths else None,
        "open_at_end": [[b, n, [round(t[b - 1], 4) for t in steps[-n:]]] for n, b in open_],  # block, steps, values
        "range": [low, top],
    }


def parity(args, runs: Path, step: int) -> dict:
    """Both codes' prune-threshold gradients at the authors' seed-0 thresholds after ``step`` (clamped to [0, 1], as
    their script clamps them), on the batch of ``gradient_parity.py`` (128 training images, no augmentation), each
    with its training loss: the reference through ``reference_pipeline.py``'s grad stage, this project's as ``ltmp
    train --recipe paper`` forms it (``ltmp.options.RECIPES["paper"]``: the reference's train-mode softmax, eq. 17
    over every query row, label smoothing 0.1, the budget over all tokens pooled over the batch)."""
    import torch
    import torch.nn.functional as F

    import gradient_parity as gp
    import ltmp
    from ltmp.flops import budget_loss_value
    from ltmp.options import RECIPES
    from ltmp.patching import blocks
    from ltmp.record import mean_r_flops
    from ltmp.train import threshold_training_mode

    trace = (runs / f"authors-ltp-{args.scale}-s0" / "thresholds.jsonl").read_text().splitlines()
    thresholds = [min(max(t, 0.0), 1.0) for t in json.loads(trace[step - 1])[0]]
    model = gp.load_model()
    images, labels = gp.reference_batch(gp.load_reference(), model)
    folder = runs / f"parity-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"images": images, "labels": labels, "prune": thresholds}, folder / "grad_in.pt")
    run = argparse.Namespace(python=args.python, reference=args.reference, runs=str(runs))
    _ref(run, "grad", folder.name, "ltp", args.scale, str(DATA))
    theirs = json.loads((folder / "grad_out.json").read_text())
    paper = RECIPES["paper"]
    ours = {}
    for form in dict.fromkeys((paper["mask_grad"], "eps")):  # the preset's form, and the eps form of the gradient
        ltmp.patch(model, "ltp", tau=paper["tau"], prune_threshold=0.0, mask_grad=form)
        model.ltmp_config.importance_rows = paper["importance_rows"]
        params = [blk.prune_threshold for blk in blocks(model)]
        with torch.no_grad():
            for p, t in zip(params, thresholds):
                p.fill_(t)
        threshold_training_mode(model)
        ce = F.cross_entropy(model(images), labels, label_smoothing=paper["label_smoothing"])
        r = mean_r_flops(model, paper["budget_tokens"], paper["budget_pool"])
        losses = {"ce": ce, "budget": gp.LAMBDA * budget_loss_value(r, R_TARGET)}
        ours[form] = {"r_flops": float(r), "ce_loss": float(ce), **gp.threshold_grads(losses, params)}
        ltmp.unpatch(model)
    return {"step": step, "thresholds": thresholds, "authors": theirs, "ours": ours}


def authors(args, folder: Path, seed: int) -> dict:
    if not (folder / "last.pth.tar").exists():
        from ltmp import data as ldata

        run = argparse.Namespace(python=args.python, reference=args.reference, runs=str(folder.parent))
        _ref(run, "train", folder.name, "ltp", args.scale, str(ldata.resolve_root(str(DATA))), seed)
    return summary([json.loads(line)[0] for line in (folder / "thresholds.jsonl").read_text().splitlines()])


def ours(args, folder: Path, seed: int) -> dict:
    why = ltmp_train(folder, "ltp", args.scale, seed)
    log = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    return {**summary([row["prune"] for row in log if "prune" in row]), "stopped": why}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", required=True, help="a checkout of github.com/Mxbonn/ltmp")
    p.add_argument("--python", required=True, help="the Python of its environment (see reference_pipeline.py)")
    p.add_argument("--scale", default="10x")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs", default=str(HERE.parent / "runs" / "reference-seeds"))
    p.add_argument("--json", default=str(HERE.parent / "results" / "reference_seeds.json"))
    p.add_argument(
        "--parity", type=int, nargs="+", default=[], help="also compare gradients at these steps' thresholds"
    )
    args = p.parse_args()
    runs = Path(args.runs)
    result = {"scale": args.scale, "lr": dict(zip(("prune", "merge"), learning_rates(args.scale))), "high": HIGH}
    result["importance_p99"] = p99 = importance_p99()
    before = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
    # seeds and parity steps measured before at these rates and HIGH stay unless measured again
    same = all(before.get(k) == result[k] for k in ("scale", "lr", "high"))
    result.update({k: v for k, v in before.items() if same and k.startswith(("ours-", "authors-", "parity"))})
    print(f"99th percentile of patch-token importance per block (unreduced, 256 test images): {p99}", flush=True)
    if max(p99) >= HIGH:
        raise SystemExit(f"HIGH = {HIGH} is not above every block's 99th percentile of importance ({max(p99)})")
    for seed in args.seeds:
        for code, fn in (("ours", ours), ("authors", authors)):
            result[f"{code}-s{seed}"] = r = fn(args, runs / f"{code}-ltp-{args.scale}-s{seed}", seed)
            print(
                f"{code} seed {seed}: {r['steps']} steps"
                + (f", {r['stopped']}" if r.get("stopped") else "")
                + f"; a threshold >= {HIGH} at {len(r['high_steps'])} steps (first {r['high_steps'][:5]}), "
                f"at most {r['longest_high'][0]} in a row (block {r['longest_high'][1]}); {r['spells']} spells "
                f"ended (median {r['median_spell']} steps); still on at the end: "
                + (", ".join(f"block {b} for the last {n} steps ({v})" for b, n, v in r["open_at_end"]) or "none")
                + f"; range {r['range'][0]:.4g} to {r['range'][1]:.4g}",
                flush=True,
            )
            write_json(args.json, result)
    for step in args.parity:
        result.setdefault("parity", {})[str(step)] = r = parity(args, runs, step)
        a = r["authors"]
        for form, o in r["ours"].items():
            for part in ("ce", "budget"):
                print(f"step {step}, this project's {form} form: {part} gradients, block by block (authors / ours):")
                print("  " + ", ".join(f"{x:.3g} / {y:.3g}" for x, y in zip(a[part], o[part])))
            print(
                f"  r_FLOPs {a['r_flops']:.4f} / {o['r_flops']:.4f}, "
                f"cross-entropy {a['ce_loss']:.4f} / {o['ce_loss']:.4f}"
            )
        write_json(args.json, result)


if __name__ == "__main__":
    main()
