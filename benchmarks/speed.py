"""Do reduced models really run faster? Time ratios to dense next to GMACs ratios (issue #5).

Two models:

- ``deit-s``: the DeiT-S shape (224x224, 196 patches + class token), random weights. Inputs are the bundled
  CIFAR-10 test images upsampled to 224 by DeiT's eval transform, so that images differ in how many patches look
  alike and kept counts vary across a batch.
- ``vit-b`` (not in the default set): the ViT-B/16 shape (224x224, 197 tokens, 768 wide), random weights, as
  ``deit-s``: a model large enough to keep a GPU busy.
- ``cifar``: the CIFAR-10 ViT of ``../shared/models/vit-cifar10`` (65 tokens) on the same images at 32x32; where
  that folder is missing, the package's bundled fp16 copy of it (same architecture, weights rounded to fp16).

For each r_target (0.7 and 0.5), LTMP's thresholds are calibrated without training (``calibrate(mode="quantile")``:
per-layer quantiles that merge a fraction f of set A and prune f/2 of the rest, f bisected to hit r_target on 64
calibration images of the bundled train split). ToMe and top-k pruning get the per-layer schedules closest to
LTMP's GMACs (``rate_schedule``); at batch 32 ToMe is also matched to LTMP's *executed* (padded) GMACs.

Timing: ``ltmp.bench.compare_models``: warm-up, then interleaved rounds (dense, ltmp, tome, ..., each round starting
one model later); ``ms`` is the median repetition, a time ratio the median over rounds of that round's ratio
(``ltmp.bench.paired_ratio``: a slow spell of the machine cancels); LTMP over ToMe likewise. Batch 1 runs
``--singles`` (8) different images per repetition (their kept counts differ); batch 32 runs one batch.

Training: a train-mode forward + backward of the patched model against the unpatched one at the same batch, the
backbone frozen and the input requiring grad. Memory: bytes saved for backward (``saved_tensors_hooks``), split
into token x token matrices (attention probabilities, B x H x N x N) and the rest, and on CUDA the peak allocated
memory.

Usage::

    python benchmarks/speed.py                      # both models, writes docs/speed.md and results/speed.json
    python benchmarks/speed.py --models cifar --quick

Runs unchanged on CUDA (``--device cuda``, the default when one is present). Never in CI. With ``--compile`` every
model runs under ``torch.compile`` (the warm-up forwards compile), ratios are to the compiled dense model, and the
batch-1 ``bound`` row is left out.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

import ltmp
from common import ROOT, at_gmacs, calibrated, cifar_model_name, device_name, load_images, load_model
from ltmp.adapters.timm import forward_cut
from ltmp.bench import _sync, compare_models, paired_ratio
from ltmp.runtime import compile_model, pick_device
from ltmp.thresholds import set_thresholds, threshold_tensors


@torch.no_grad()
def gmacs_of(model, spec, x: torch.Tensor) -> tuple[float, float, list[int]]:
    """Mean GMACs over the images of x, the executed (padded) GMACs, and the kept-count spread of the last block."""
    model(x)
    if getattr(model, "ltmp_config", None) is None:
        g = ltmp.dense_gmacs(spec)
        return g, g, []
    rec = ltmp.stats(model)
    return (
        float(ltmp.gmacs(spec, rec.kept.cpu()).mean()),
        ltmp.gmacs_executed(spec, rec.padded),
        rec.kept[:, -1].tolist(),
    )


class Cut(torch.nn.Module):
    """The zero-overhead bound at batch 1: the dense model on the token counts LTMP keeps for each image, tokens
    simply cut off after each block's attention (``ltmp.adapters.timm.forward_cut``), no reduction step."""

    def __init__(self, dense: torch.nn.Module, counts: dict[int, list[int]]):
        super().__init__()
        self.dense, self.counts = dense, counts  # counts: input data_ptr -> tokens leaving each block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward_cut(self.dense, x, self.counts[x.data_ptr()])


def kept_counts(model, spec, x: torch.Tensor) -> list[int]:
    """Tokens (prefix included) leaving each block for one image."""
    model(x)
    return [int(k) + spec.num_prefix for k in ltmp.stats(model).kept[0]]


def saved_bytes(model, x: torch.Tensor, n_tokens: int) -> dict:
    """Bytes that autograd saves for backward in one forward (the model's own parameters excluded), split into
    token x token matrices (n_tokens x n_tokens: train mode keeps every token) and the rest."""
    B = x.shape[0]
    seen: dict[int, tuple[int, bool]] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved weights cost no extra memory

    def pack(t):
        # token x token matrices: attention (B, H, N, N) or (B*H, N, N), similarities (B, N, N) (not the input
        # image); a storage saved once as such and once as a view of another shape counts as one
        attn_like = t.dim() >= 3 and t.shape[0] % B == 0 and t.shape[-1] == t.shape[-2] == n_tokens
        ptr = t.untyped_storage().data_ptr()
        if ptr in params:
            return t
        seen[ptr] = (t.untyped_storage().nbytes(), attn_like or seen.get(ptr, (0, False))[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    attn = sum(n for n, a in seen.values() if a)
    return {"attention": attn, "other": sum(n for n, a in seen.values() if not a)}


def train_step_time(models: dict, x: torch.Tensor, reps: int, rounds: int) -> dict:
    """Median seconds of forward + backward (to the input and the thresholds), interleaved."""
    times = {k: [] for k in models}
    for m in models.values():
        m.train()
    for _ in range(rounds):
        for name, m in models.items():
            for i in range(reps + 1):
                xi = x.detach().requires_grad_(True)
                t = time.perf_counter()
                m(xi).float().sum().backward()
                _sync(x.device)
                if i:  # the first of each round warms up
                    times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def frozen(model):
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith(("merge_threshold", "prune_threshold")))
    return model


def run_model(name: str, args, device) -> dict:
    dense = load_model(name).to(device)
    spec = ltmp.vit_spec(dense)
    g_dense = ltmp.dense_gmacs(spec)
    calib = load_images(dense, "train", 64).to(device)
    test = load_images(dense, "test", max(args.batch_size, args.singles)).to(device)
    singles = [test[i : i + 1] for i in range(args.singles)]
    batch = test[: args.batch_size]
    out = {"model": name, "gmacs_dense": g_dense, "batch_size": len(batch), "targets": []}
    print(f"== {name}: dense {g_dense:.4f} GMACs", flush=True)
    for target in args.targets:
        ltmp_m, r = calibrated(dense, target, device, images=calib)
        g1 = statistics.mean(gmacs_of(ltmp_m, spec, s)[0] for s in singles)
        gb, gb_exec, spread = gmacs_of(ltmp_m, spec, batch)

        row = {"r_target": target, "r_calibrated": r, "kept_last_block": spread, "batch": {}, "ltmp_vs": {}}
        print(
            f"-- r_target {target}: calibrated r_FLOPs {r:.3f}; batch-{len(batch)} kept after the last block "
            f"min {min(spread)} / median {statistics.median(spread)} / max {max(spread)}",
            flush=True,
        )
        for bs, x, g in (("1", singles, g1), (str(len(batch)), batch, gb)):
            # the baselines match LTMP's mean GMACs over these images (and, batched, its executed GMACs)
            ms = {
                "dense": dense,
                "ltmp": ltmp_m.eval(),
                "tome": at_gmacs(dense, "tome", g),
                "topk-prune": at_gmacs(dense, "topk-prune", g),
            }
            if bs != "1":
                ms["tome@exec"] = at_gmacs(dense, "tome", gb_exec)
            elif not args.compile:  # the bound looks its counts up by input address: eager only
                ms["bound"] = Cut(dense, {s.data_ptr(): kept_counts(ltmp_m, spec, s) for s in singles})
            timed = ms
            if args.compile:  # every model as --compile compiles it (ltmp.runtime.compile_model)
                timed = {k: compile_model(m, device) for k, m in ms.items()}
            t = compare_models(timed, x, warmup=args.warmup, reps=args.reps, rounds=args.rounds)
            res = {}
            for k, m in ms.items():
                if bs == "1":
                    g = g1 if k in ("ltmp", "bound") else statistics.mean(gmacs_of(m, spec, s)[0] for s in singles)
                    g_exec = g
                else:
                    g, g_exec, _ = gmacs_of(m, spec, x)
                ratio = paired_ratio(t, k, "dense")
                res[k] = {
                    "ms": 1000 * t[k]["median"],
                    "iqr_ms": [1000 * t[k]["p25"], 1000 * t[k]["p75"]],
                    "time_ratio": ratio["median"],
                    "time_ratio_iqr": [ratio["p25"], ratio["p75"]],
                    "gmacs_ratio": g / g_dense,
                    "gmacs_executed_ratio": g_exec / g_dense,
                }
                print(
                    f"   batch {bs:>2} {k:<10} {res[k]['ms']:9.2f} ms  time {res[k]['time_ratio']:.3f}  "
                    f"GMACs {res[k]['gmacs_ratio']:.3f} (executed {res[k]['gmacs_executed_ratio']:.3f})",
                    flush=True,
                )
            row["batch"][bs] = res
            row["ltmp_vs"][bs] = vs = {b: paired_ratio(t, "ltmp", b) for b in ("tome", "tome@exec") if b in t}
            print(
                f"   batch {bs:>2} ltmp / "
                + ", ltmp / ".join(f"{b} {v['median']:.3f} (IQR {v['p25']:.3f}-{v['p75']:.3f})" for b, v in vs.items()),
                flush=True,
            )
        out["targets"].append(row)
    # training cost and memory, with the thresholds of the last target
    plain = frozen(copy.deepcopy(dense))
    patched = frozen(ltmp.patch(copy.deepcopy(dense), "ltmp"))
    set_thresholds(patched, threshold_tensors(ltmp_m))
    xt = batch[: args.train_batch]
    timed = {"timm": plain, "ltmp-train": patched}
    if args.compile:
        timed = {k: compile_model(m, device, train=True) for k, m in timed.items()}
    tt = train_step_time(timed, xt, reps=args.train_reps, rounds=args.train_rounds)
    mem = {}
    for k, m in (("timm", plain), ("ltmp-train", patched)):
        m.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        mem[k] = saved_bytes(m, xt.detach().requires_grad_(True), spec.num_patches + spec.num_prefix)
        if device.type == "cuda":
            mem[k]["cuda_peak_forward"] = torch.cuda.max_memory_allocated(device) - base
    n_tok = spec.num_patches + spec.num_prefix
    act_bytes = 2 if args.amp else xt.element_size()  # activations are bf16 under --amp
    btc = xt.shape[0] * n_tok * spec.embed_dim * act_bytes * spec.depth
    out["train"] = {
        "batch": xt.shape[0],
        "timm_ms": 1000 * tt["timm"],
        "ltmp_ms": 1000 * tt["ltmp-train"],
        "ratio": tt["ltmp-train"] / tt["timm"],
        "saved_bytes": mem,
        "btc_bytes_all_blocks": btc,
    }
    print(
        f"   train fwd+bwd batch {xt.shape[0]}: timm {1000 * tt['timm']:.1f} ms, ltmp {1000 * tt['ltmp-train']:.1f} "
        f"ms, ratio {out['train']['ratio']:.3f}; saved for backward (MiB): timm "
        f"{mem['timm']['attention'] / 2**20:.1f} attention + {mem['timm']['other'] / 2**20:.1f} other, ltmp "
        f"{mem['ltmp-train']['attention'] / 2**20:.1f} + {mem['ltmp-train']['other'] / 2**20:.1f} "
        f"(B*T*C*L = {btc / 2**20:.1f})",
        flush=True,
    )
    return out


def markdown(result: dict) -> str:
    env = result["env"]
    amp = (", bf16 autocast" if env.get("amp") else "") + (
        ", every model under torch.compile as `--compile` does" if env.get("compiled") else ""
    )
    cmd = result["command"].split()  # runs before "singles" was recorded: from the command line
    singles = result.get("singles", int(cmd[cmd.index("--singles") + 1]) if "--singles" in cmd else 8)
    lines = [
        f"Measured on: {env['device_name']}{amp}, torch {env['torch']}, timm {env['timm']}. Produced by "
        f"`{result['command']}`. `ms` is one timed repetition: {singles} different images one at a time "
        "(batch 1), "
        f"or one batch of {result['models'][0].get('batch_size', 32)}; medians over interleaved rounds. "
        f"Time and GMACs ratios are to the dense model; a time ratio is the median over rounds of that "
        f"round's ratio (quartiles in parentheses where recorded), so that a slow spell of the machine cancels "
        f"(so the ratio of two `ms` values is not the time ratio); "
        f"baselines are matched to LTMP's mean GMACs, `tome@exec` to its executed (padded) GMACs."
        + (
            ""
            if env.get("compiled")
            else " `bound` (batch 1): the dense model on LTMP's per-image token counts "
            "with tokens simply cut off after each block's attention and no reduction step, the time those "
            "counts cost with zero overhead."
        ),
        "",
    ]
    for m in result["models"]:
        lines += [
            f"### {m['model']} (dense {m['gmacs_dense']:.4f} GMACs)",
            "",
            "| r_target | method | batch | ms | time ratio | GMACs ratio | executed GMACs ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in m["targets"]:
            for bs, res in row["batch"].items():
                for k, v in res.items():
                    if k == "dense":
                        continue
                    iqr = " ({:.3f}-{:.3f})".format(*v["time_ratio_iqr"]) if "time_ratio_iqr" in v else ""
                    lines.append(
                        f"| {row['r_target']} | {k} | {bs} | {v['ms']:.2f} | {v['time_ratio']:.3f}{iqr} | "
                        f"{v['gmacs_ratio']:.3f} | {v['gmacs_executed_ratio']:.3f} |"
                    )
            big = list(row["batch"])[-1]
            lines.append(
                f"| {row['r_target']} | dense | 1 / {big} | {row['batch']['1']['dense']['ms']:.2f} / "
                f"{row['batch'][big]['dense']['ms']:.2f} | 1 | 1 | 1 |"
            )
        vs = [
            f"r {row['r_target']} batch {bs}: "
            + ", ".join(f"/ {b} {v['median']:.3f} ({v['p25']:.3f}-{v['p75']:.3f})" for b, v in per.items())
            for row in m["targets"]
            for bs, per in row.get("ltmp_vs", {}).items()
        ]
        if vs:
            lines += ["", "LTMP's time over the baselines', round by round (median, quartiles): " + "; ".join(vs) + "."]
        t = m["train"]
        mem = t["saved_bytes"]
        lines += [
            "",
            f"Train-mode forward + backward at batch {t['batch']} (backbone frozen, input requires grad): "
            f"timm {t['timm_ms']:.1f} ms, patched LTMP {t['ltmp_ms']:.1f} ms, ratio **{t['ratio']:.3f}**. "
            f"Saved for backward: timm {mem['timm']['attention'] / 2**20:.1f} MiB token x token matrices + "
            f"{mem['timm']['other'] / 2**20:.1f} MiB other; LTMP "
            f"{mem['ltmp-train']['attention'] / 2**20:.1f} + {mem['ltmp-train']['other'] / 2**20:.1f} MiB "
            f"(B x T x C x L at this batch: {t['btc_bytes_all_blocks'] / 2**20:.1f} MiB).",
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="deit-s,cifar")
    p.add_argument("--targets", default="0.7,0.5")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--singles", type=int, default=8, help="images timed one by one at batch 1")
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=1, help="timed repetitions per model per round")
    p.add_argument("--train-reps", type=int, default=2)
    p.add_argument("--train-rounds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (dense, ltmp, tome, ...)")
    p.add_argument("--threads", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", action="store_true", help="run everything under bf16 autocast (as GPU users deploy)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="time every model under torch.compile (ratios to the compiled dense model; no bound row)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    p.add_argument("--json", default=str(ROOT / "results" / "speed.json"))
    p.add_argument("--out", help="write the markdown tables here (e.g. docs/speed.md)")
    p.add_argument("--from-json", help="only rewrite --out from an earlier run's JSON (no timing)")
    args = p.parse_args()
    if args.from_json:
        Path(args.out).write_text(markdown(json.loads(Path(args.from_json).read_text())) + "\n")
        return 0
    args.targets = [float(t) for t in args.targets.split(",")]
    if args.quick:
        args.reps, args.rounds, args.train_reps, args.train_rounds, args.warmup = 1, 1, 1, 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    name = device_name(device)
    result = {
        "command": "python benchmarks/speed.py " + " ".join(sys.argv[1:]),
        "singles": args.singles,
        "env": {
            "device": str(device),
            "device_name": name,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "timm": timm.__version__,
            "cifar_model": cifar_model_name(),
        },
        "models": [],
    }
    result["env"]["amp"] = "bf16" if args.amp else ""
    result["env"]["compiled"] = args.compile
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
        result["models"] = [run_model(m, args, device) for m in args.models.split(",")]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(markdown(result) + "\n")
    print(f"wrote {args.json}" + (f" and {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
