"""The ``ltmp`` command: a thin argparse layer over the library (``python -m ltmp`` is the same)."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import sys
import tempfile
import threading
import warnings
from pathlib import Path

from ._version import __version__
from .config import FIXED_RATE, LEARNED, MASK_GRADS, MERGE_GRADS
from .errors import LtmpError, first_line
from .options import AUGMENTS, CHOICES, LABELS, RECIPES


class CLIError(LtmpError):
    """A user error: printed as one line, exit code 2, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (usage text only on --help)."""

    def error(self, message: str):
        self.exit(2, f"ltmp: error: {message} (see: {self.prog} --help)\n")


def number(
    kind: type, low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False
):
    """An argparse type: an int or finite float within [low, high] (open ends where asked); refused when parsed,
    not clamped later. Counts are >= 1 or >= 0, learning rates >= 0, tau > 0, fractions in their ranges."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"takes {'an integer' if kind is int else 'a number'}, got '{text}'"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"takes a finite number, got '{text}'")

        def show(bound):
            return f"{bound:g}" if isinstance(bound, float) else str(bound)

        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            where = (
                f"lie in {'(' if low_open else '['}{show(low)}, {show(high)}{')' if high_open else ']'}"
                if low is not None and high is not None
                else f"be {'>' if low_open else '>='} {show(low)}"
                if low is not None
                else f"be {'<' if high_open else '<='} {show(high)}"
            )
            raise argparse.ArgumentTypeError(f"must {where}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


COUNT = number(int, 1)  # images, steps, batch sizes, repetitions
WORKERS = number(int, 0, 256)  # processes, threads
SEED = number(int, 0, 2**63, high_open=True)
RATE = number(float, 0, 1, low_open=True)  # r_target
NONNEG = number(float, 0)  # learning rates, lambda
POSITIVE = number(float, 0, low_open=True)  # tau, epochs, GMACs
FINITE = number(float)  # initial thresholds


def _rates(text: str | None):
    if text is None:
        return None
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise CLIError(f"--r/--k takes an int or a comma-separated list of ints per layer, got '{text}'") from None
    if any(v < 0 for v in vals):
        raise CLIError(f"--r/--k takes tokens per layer, 0 or more, got '{text}'")
    return vals[0] if len(vals) == 1 else vals


def _check_rates(model, flag: str):
    """Refuse a fixed rate above what the model's tokens allow in a block that has all of them (``--r 99`` on 64
    patch tokens) rather than let the engine clamp it. Later blocks remove at most what is left to them, as ToMe
    does (:func:`ltmp.flops.schedule_counts`)."""
    from .config import METHODS
    from .flops import schedule_counts, vit_spec
    from .patching import keeps_one

    cfg = model.ltmp_config
    n, per_token = vit_spec(model).num_patches, len(METHODS[cfg.method][0])

    def fits(r: int) -> bool:
        return n - schedule_counts(cfg.method, [r], n, keeps_one(model))[0] == r * per_token

    for layer, r in enumerate(cfg.rate):
        if not fits(r):
            cap = max(v for v in range(n + 1) if fits(v))
            raise CLIError(
                f"{flag} {r} (block {layer + 1}) asks for more tokens than this model has: with its {n} "
                f"patch tokens, {cfg.method} removes at most {cap * per_token} per block ({flag} {cap}); "
                f"pass {flag} {cap} or less"
            )
    return model


def _add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        help="timm model name (deit_small_patch16_224), local-dir:PATH, hf:DIR_OR_NAME or open_clip:ARCH"
        + ("" if required else " (default: the bundled CIFAR-10 ViT, pretrained)"),
    )
    p.add_argument(
        "--pretrained",
        action="store_true",
        help="load timm's pretrained weights (local-dir: and hf: folders always load their own)",
    )
    p.add_argument("--checkpoint", help="weights file: timm, torch or safetensors state dict")


LABELS_HELP = (
    "how the data's class folders map to the model's classes where they do not match its class names: names (by "
    "name; folders it does not know are left out) or order (the sorted folders as its classes 0, 1, ...)"
)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        required=True,
        help="ImageFolder root with train/ and val/ splits, or a .tar.gz archive of that layout",
    )
    p.add_argument("--val-split", default="val", help="validation split folder (CIFAR-10 layout: test)")
    p.add_argument("--labels", choices=LABELS, help=LABELS_HELP)
    p.add_argument("--batch-size", type=COUNT, default=128)
    p.add_argument("--workers", type=WORKERS, default=2, help="data loader processes")
    p.add_argument(
        "--amp",
        nargs="?",
        const="auto",
        default="",
        choices=["auto", "bf16", "fp16"],
        help="mixed precision: bf16 where supported (CPU, recent GPUs), else fp16; or name it",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")


def cmd_flops(args) -> int:
    from .flops import dense_gmacs, vit_spec
    from .runtime import create_model

    model = create_model(args.model)
    spec = vit_spec(model)
    print(
        f"{args.model}: {dense_gmacs(spec):.3f} GMACs per image (fvcore convention, LayerNorm included), "
        f"{spec.num_patches} patches + {spec.num_prefix} prefix tokens, depth {spec.depth}, "
        f"embed dim {spec.embed_dim}"
    )
    return 0


def train_config(args):
    """The ``ltmp train`` arguments as a TrainConfig: the options given, then the recipe's values (``--recipe``),
    then TrainConfig's defaults."""
    from .train import TrainConfig

    given = dict(
        model=args.model,
        pretrained=args.pretrained,
        checkpoint=args.checkpoint,
        data_dir=args.data_dir,
        output=args.output,
        r_target=args.r_target,
        method=args.method,
        importance=args.importance,
        tau=args.tau,
        lam=args.lam,
        budget=args.budget,
        optimizer=args.optimizer,
        lr_prune=args.lr_prune,
        lr_merge=args.lr_merge,
        merge_init=args.merge_init,
        prune_init=args.prune_init,
        mask_grad=args.mask_grad,
        merge_grad=args.merge_grad,
        calibrate=args.calibrate,
        distill=args.distill,
        settle=args.settle,
        stop_collapsed=args.stop_collapsed,
        check_first_step=args.check_first_step,
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps=args.steps,
        val_split=args.val_split,
        holdout=args.holdout,
        max_train_images=args.max_train_images,
        augment=args.augment,
        amp=args.amp,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        workers=args.workers,
        device=args.device,
        eval_after=not args.no_eval,
        compile=args.compile,
        label_smoothing=args.label_smoothing,
        combine=args.combine,
        importance_rows=args.importance_rows,
        train_order=args.train_order,
        budget_tokens=args.budget_tokens,
        budget_pool=args.budget_pool,
        clamp=args.clamp,
        labels=args.labels,
    )
    # the recipe's values where an option was not given, TrainConfig's defaults for the rest
    return TrainConfig(
        **{**RECIPES[args.recipe], **{k: v for k, v in given.items() if v is not None}}, recipe=args.recipe
    )


#: ``ltmp train`` warns when training ends further than this from its r_target before the settle step.
OFF_BUDGET = 0.05


def cmd_train(args) -> int:
    from .train import train

    cfg = train_config(args)
    result = train(cfg, resume=args.resume, progress=not args.quiet, overwrite=args.overwrite)
    if "thresholds" in result:
        print(
            f"thresholds: {result['thresholds']}  (steps {result['steps']}, last batch r_FLOPs "
            f"{result['r_flops']:.3f}, target {cfg.r_target})"
        )
    if (
        "settle" not in result
        and result.get("r_flops") is not None
        and abs(result["r_flops"] - cfg.r_target) > OFF_BUDGET
    ):
        print(
            f"ltmp: warning: training ended at r_FLOPs {result['r_flops']:.3f} (last batch) for r_target "
            f"{cfg.r_target}: train longer (--steps) or at another learning rate",
            file=sys.stderr,
        )
    if "settle" in result:
        st = result["settle"]
        print(
            f"settle: r_FLOPs {st['r_flops_trained']:.3f} on {st['on']}; "
            + (
                f"shifted the thresholds by {st['shift']:+.4f} to {st['r_flops']:.3f}"
                if st["shift"]
                else "within 0.01 of the target, kept"
            )
        )
        if abs(st["r_flops_trained"] - cfg.r_target) > OFF_BUDGET:
            print(
                f"ltmp: warning: training ended at r_FLOPs {st['r_flops_trained']:.3f} for r_target {cfg.r_target}; "
                f"the settle step's shift ({st['shift']:+.3f}), not training, met the budget: train longer (--steps) "
                f"or at another learning rate",
                file=sys.stderr,
            )
        if not st["met"]:
            print(
                f"ltmp: warning: no shared shift reaches r_target {cfg.r_target} on these images (closest "
                f"{st['r_flops']:.3f}); retrain with another --lr-merge/--lr-prune or --method",
                file=sys.stderr,
            )
    if "allocation" in result:
        from .analysis import format_allocation

        print(format_allocation(result["allocation"]))
    if "eval" in result:
        print(format_eval(result["eval"]))
    return 0


def format_eval(r: dict) -> str:
    lo, hi = r["top1_ci95"]
    return (
        f"{r['method']}: top-1 {r['top1']:.2f}% (95% CI {lo:.2f}-{hi:.2f}), top-5 {r['top5']:.2f}%, "
        f"{r['gmacs']:.4f} GMACs ({100 * r['gmacs_ratio']:.1f}% of dense {r['gmacs_dense']:.4f}), executed "
        f"{r['gmacs_executed']:.4f} GMACs, r_FLOPs {r['r_flops']:.3f}, {r['images']} images"
        + (f", {r['skipped']} unreadable skipped" if r["skipped"] else "")
    )


def _eval_json(path: str, flag: str) -> dict:
    """An eval.json written by ``ltmp eval --json`` or ``ltmp train``, for --match and --compare."""
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CLIError(
            f"{flag} {path}: cannot read it as JSON ({type(e).__name__}); pass an eval.json written by "
            f"ltmp eval --json or ltmp train"
        ) from None
    missing = [k for k in ("gmacs", "correct", "method", "top1") if k not in res]
    if missing:
        raise CLIError(
            f"{flag} {path} has no '{missing[0]}'; pass an eval.json written by ltmp eval --json or ltmp train"
        )
    return res


def cmd_eval(args) -> int:
    from torch.utils.data import DataLoader

    from . import data as ldata
    from .evaluate import evaluate
    from .runtime import compile_model, create_model, label_names, pick_device

    _check_reduction_args(args)
    gmacs = args.match_gmacs if args.match is None else _eval_json(args.match, "--match")["gmacs"]
    shape = None
    if args.follow:  # the rate spread over the layers like the tokens that run removed, at its GMACs by default
        if args.method not in FIXED_RATE:
            raise CLIError(f"--follow spreads a fixed rate like another run; pass --method {' or '.join(FIXED_RATE)}")
        followed = _eval_json(args.follow, "--follow")
        shape = [layer["merged"] + layer["pruned"] for layer in followed["per_layer"]]
        gmacs = followed["gmacs"] if gmacs is None else gmacs
    model = _reduced_model(
        args,
        create_model(args.model, args.pretrained, args.checkpoint, (args.data_dir, args.val_split)),
        gmacs,
        dense_ok=True,
        shape=shape,
    )
    dataset = ldata.eval_set(model, args.data_dir, args.val_split, args.max_images, label_names(model), args.labels)
    if args.compare:
        other = _eval_json(args.compare, "--compare")
        if other.get("images_sha256") != ldata.fingerprint(dataset):
            raise CLIError(
                f"--compare {args.compare} was evaluated on other images than these ({other['images']} images"
                + ("" if "images_sha256" in other else ", and it records no fingerprint of them")
                + "); compare evaluations of the same --data-dir, --val-split and --max-images"
            )
    for note in dataset.notes:
        print(f"ltmp: note: {note}", file=sys.stderr)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers, collate_fn=ldata.collate_skip)
    device = pick_device(args.device)
    if args.compile:
        model = compile_model(model, device)
    result = evaluate(model, loader, device, amp=args.amp, progress=not args.quiet, model_name=args.model)
    result["thresholds"] = args.thresholds
    print(format_eval(result))
    if getattr(model, "ltmp_config", None) is not None and model.ltmp_config.learned:
        from .analysis import allocation, format_allocation, image_batch

        result["allocation"] = allocation(model, image_batch(dataset), device, args.batch_size)
        print(format_allocation(result["allocation"]))
    if result["rate"] is not None:
        print(f"per-layer rate: {','.join(str(v) for v in result['rate'])}")
    if args.compare:
        from .significance import mcnemar

        test = mcnemar(result["correct"], other["correct"])
        result["paired_test"] = {"against": args.compare, **test}
        print(
            f"paired McNemar test against {args.compare} ({other['method']}, top-1 {other['top1']:.2f}%): "
            f"{test['only_a_correct']} images only this run got right, {test['only_b_correct']} only the other; "
            f"p = {test['p_value']:.4f}"
        )
    if args.json:
        from .thresholds import write_json

        write_json(args.json, result)
    return 0


def _check_reduction_args(args) -> None:
    """Refuse, before any work, what a thresholds file decides given beside it: the method, a fixed rate's --r or
    --k, a schedule to match."""
    if not args.thresholds:
        return
    from .thresholds import read_thresholds

    method = read_thresholds(args.thresholds)[1]["method"]
    if args.method not in (None, method):
        raise CLIError(
            f"--method {args.method} disagrees with --thresholds {args.thresholds}, which holds {method}; drop "
            f"--method (the thresholds file decides it), or drop --thresholds"
        )
    given = [f for f in ("r", "k", "match", "match_gmacs", "follow") if getattr(args, f, None) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise CLIError(f"{flag} sets a fixed rate, and --thresholds {args.thresholds} decides the reduction; pass one")


def _reduced_model(args, model, gmacs: float | None = None, dense_ok: bool = False, shape: list[float] | None = None):
    """``model`` with the reduction that --thresholds or --method/--r/--k name; with ``gmacs``, a fixed-rate
    method gets the per-layer schedule closest to those GMACs instead of --r/--k (spread like ``shape``, see
    ``rate_schedule``). ``dense_ok``: no reduction named (or ``--method dense``) returns ``model`` as it is."""
    from .flops import rate_schedule, vit_spec
    from .patching import patch
    from .thresholds import load_thresholds

    if args.thresholds:
        return load_thresholds(model, args.thresholds)
    if args.method in (None, "dense"):
        if dense_ok:
            return model
        raise CLIError(f"pass --thresholds FILE or a fixed-rate --method ({', '.join(FIXED_RATE)}) to compare")
    if args.method in LEARNED:
        raise CLIError(f"--method {args.method} needs learned thresholds: pass --thresholds FILE")
    flag = "--r" if args.method == "tome" else "--k"
    rate = _rates(args.r if args.method == "tome" else args.k)
    if gmacs is not None:
        rate = rate_schedule(vit_spec(model), gmacs, args.method, shape)
    return _check_rates(patch(model, args.method, **{flag[2:]: rate}), flag)


def cmd_bench(args) -> int:
    import copy

    import torch

    from . import data as ldata
    from .bench import GLIBC_DEFAULTS, GLIBC_KEEP_MEMORY, bench_models
    from .runtime import create_model, pick_device

    _check_reduction_args(args)
    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dense = create_model(args.model, args.pretrained, args.checkpoint).to(device).eval()
    reduced = _reduced_model(args, copy.deepcopy(dense)).to(device).eval()
    exported = None
    if args.exported:
        from .export import load_exported

        exported = load_exported(args.exported).to(device)
    n = args.images if args.deployed else args.batch_size
    if args.data_dir:
        ds = ldata.eval_set(dense, args.data_dir, args.val_split, n)
        batch = torch.stack([ds[i][0] for i in range(len(ds))])
    else:
        g = torch.Generator().manual_seed(0)
        batch = torch.randn(n, *dense.pretrained_cfg.get("input_size", (3, 224, 224)), generator=g)
        if reduced.ltmp_config.learned:
            print(
                "ltmp: note: timing on random inputs (no --data-dir); learned thresholds keep as many tokens as "
                "each image needs, so pass --data-dir DIR to time real images",
                file=sys.stderr,
            )
    if exported is not None:
        try:
            with torch.no_grad():
                exported(batch[:1].to(device))
        except Exception as e:  # torch raises several types on inputs the program was not made for
            raise CLIError(
                f"--exported {args.exported} does not run on this model's inputs {tuple(batch.shape[1:])} "
                f"({first_line(e)}); export this model again with ltmp export"
            ) from None
    if args.deployed:
        return _bench_deployed(args, dense.cpu(), reduced.cpu(), batch)
    result = {
        "model": args.model,
        "inputs": args.data_dir or "random",
        **bench_models(
            dense,
            reduced,
            batch,
            sorted({1, args.batch_size}),
            compile=args.compile,
            exported=exported,
            warmup=args.warmup,
            reps=args.reps,
            rounds=args.rounds,
        ),
    }
    if args.compile:
        print("ltmp: both models were compiled with torch.compile during the warm-up forwards", file=sys.stderr)
    if result["allocator"] == GLIBC_DEFAULTS:
        print(
            "ltmp: note: glibc malloc's defaults give large tensors fresh pages on every forward, which slows the "
            f"dense model most; for serving-like CPU timings set {GLIBC_KEEP_MEMORY} (docs/performance.md, "
            "Memory allocator)",
            file=sys.stderr,
        )
    for run in result["runs"]:
        if "exported_ms" in run:
            print(
                f"batch 1: exported {args.exported} {run['exported_ms']:.2f} ms, time ratio "
                f"{run['exported_time_ratio']:.3f}"
            )
        print(
            f"batch {run['batch_size']}: dense {run['dense_ms']:.2f} ms, {result['method']} "
            f"{run['reduced_ms']:.2f} ms (IQR {run['reduced_iqr_ms'][0]:.2f}-{run['reduced_iqr_ms'][1]:.2f}); "
            f"time ratio {run['time_ratio']:.3f} (IQR {run['time_ratio_iqr'][0]:.3f}-"
            f"{run['time_ratio_iqr'][1]:.3f}), GMACs ratio {run['gmacs_ratio']:.3f} (executed "
            f"{run['gmacs_executed_ratio']:.3f}); throughput dense {run['throughput_dense']:.1f}, "
            f"{result['method']} {run['throughput_reduced']:.1f} img/s"
        )
    print(
        f"{result['device']}, {result['threads']} threads, torch {result['torch']}"
        + (f", {result['allocator']}" if result["allocator"] else "")
        + (", both models under torch.compile" if args.compile else "")
    )
    if args.json:
        from .thresholds import write_json

        write_json(args.json, result)
    return 0


def _bench_deployed(args, dense, reduced, images) -> int:
    import torch

    from .bench import bench_deployed

    r = {
        "model": args.model,
        "inputs": args.data_dir or "random",
        **bench_deployed(
            dense,
            reduced,
            images,
            args.deployed,
            [args.threads or torch.get_num_threads()],
            warmup=args.warmup,
            reps=args.reps,
            rounds=args.rounds,
        ),
    }
    for run in r["runs"]:
        d, m, n = run["dense_ms"], run["reduced_ms"], run["threads"]
        print(
            f"deployed in {args.deployed} ({n} thread{'s' * (n > 1)}), batch 1 over {r['images']} images, "
            f"{r['rounds']} rounds: dense {d['median']:.2f} ms (IQR {d['p25']:.2f}-{d['p75']:.2f}), {r['method']} "
            f"{m['median']:.2f} ms (IQR {m['p25']:.2f}-{m['p75']:.2f}) per image; time ratio {run['time_ratio']:.3f} "
            f"(IQR {run['time_ratio_iqr'][0]:.3f}-{run['time_ratio_iqr'][1]:.3f}), GMACs ratio "
            f"{r['gmacs_ratio']:.3f}"
        )
    print(
        f"largest |logit difference| from eager: dense {r['max_abs_diff_vs_eager']['dense']:.1e}, "
        f"{r['method']} {r['max_abs_diff_vs_eager']['reduced']:.1e}; {r['machine']}, torch {r['torch']}"
    )
    if args.json:
        from .thresholds import write_json

        write_json(args.json, r)
    return 0


def _add_reduction_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--thresholds", help="thresholds.safetensors from ltmp train")
    p.add_argument("--method", choices=FIXED_RATE, help="a fixed-rate method instead")
    p.add_argument("--r", help="ToMe: tokens merged per layer (int or per-layer list)")
    p.add_argument("--k", help="top-k baselines: tokens per layer (int or per-layer list)")


def _load_model(args):
    """The model of --model/--pretrained/--checkpoint, or the bundled CIFAR-10 ViT when --model is not given."""
    from .demo import BUNDLED_MODEL
    from .runtime import create_model

    if args.model is None:
        return create_model(BUNDLED_MODEL, True, args.checkpoint), "bundled vit-cifar10"
    return create_model(args.model, args.pretrained, args.checkpoint), args.model


def cmd_viz(args) -> int:
    import timm.data

    from . import data as ldata
    from .viz import denormalize, layer_groups, plot_layers

    model, name = _load_model(args)
    _, tf, _ = ldata.transforms_for(model, "none")
    images = ldata.read_images(args.image, tf, args.max_images)
    model = _reduced_model(args, model)
    model.ltmp_config.trace_source = True
    cfg = timm.data.resolve_data_config(model=model)
    rows = [(label, denormalize(x, cfg["mean"], cfg["std"]), layer_groups(model, x)) for label, x in images]
    what = Path(args.thresholds).name if args.thresholds else f"{args.method} {args.r or args.k}"
    plot_layers(
        rows,
        args.output,
        title=f"{name}, {model.ltmp_config.method} ({what}): each merged group in its "
        f"mean colour, pruned patches dark grey",
    )
    print(f"wrote {args.output} ({len(rows)} images x {len(rows[0][2])} layers)")
    return 0


def cmd_analyze(args) -> int:
    import copy

    from torch.utils.data import DataLoader

    from . import data as ldata
    from .analysis import (
        allocation,
        format_allocation,
        image_batch,
        kendall_tau,
        layer_counts,
        plot_kendall,
        plot_layer_boxes,
        summarize,
    )
    from .demo import BUNDLED_DATA
    from .patching import patch
    from .runtime import pick_device
    from .thresholds import write_json

    dense, name = _load_model(args)
    device = pick_device(args.device)
    dataset = ldata.eval_set(dense, args.data_dir or BUNDLED_DATA, args.val_split, args.max_images)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers, collate_fn=ldata.collate_skip)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.thresholds or args.method:
        model = _reduced_model(args, copy.deepcopy(dense))
        counts = layer_counts(model, loader, device, args.max_images)
        method = model.ltmp_config.method
        summary = {
            "model": name,
            "method": method,
            "thresholds": args.thresholds,
            "images": len(counts["kept"]),
            **summarize(counts),
        }
        if model.ltmp_config.learned:
            summary["allocation"] = allocation(model, image_batch(dataset), device, args.batch_size)
            print(format_allocation(summary["allocation"]))
        plot_layer_boxes(
            counts,
            out / "layers.png",
            title=f"{name}, {method}: tokens removed per layer over {summary['images']} images",
        )
        write_json(out / "layers.json", summary)
        written += ["layers.png", "layers.json"]
    k = args.kendall_k
    model = _check_rates(patch(copy.deepcopy(dense), "topk-mp", k=k), "--kendall-k")
    tau = {"model": name, "method": f"topk-mp k={k}", **kendall_tau(model, loader, device, args.max_images)}
    plot_kendall(
        tau,
        out / "kendall.png",
        title=f"{name}: importance vs similarity of set-A tokens\n{k} merged + "
        f"{k} pruned per layer, mean +- std over {tau['images']} images",
    )
    write_json(out / "kendall.json", tau)
    written += ["kendall.png", "kendall.json"]
    print("Kendall tau per layer: " + " ".join("-" if t is None else f"{t:.2f}" for t in tau["mean"]))
    print(f"wrote {out}/: {', '.join(written)}")
    return 0


def cmd_calibrate(args) -> int:
    from . import data as ldata
    from .calibrate import calibrate, calibration_batch
    from .demo import BUNDLED_DATA
    from .patching import patch
    from .runtime import pick_device
    from .thresholds import save_thresholds

    if (args.r_target is None) == (args.match is None):
        raise CLIError("pass --r-target R, or --match EVAL_JSON to meet the r_FLOPs of another run")
    if args.match is not None:
        args.r_target = _eval_json(args.match, "--match")["r_flops"]
    if not 0 < args.r_target <= 1:
        raise CLIError(f"--r-target must lie in (0, 1], got {args.r_target}")
    model, name = _load_model(args)
    patch(model, args.method)
    root = ldata.resolve_root(args.data_dir or BUNDLED_DATA)
    images = calibration_batch(model, root / "train" if (root / "train").is_dir() else root, args.images, args.seed)
    device = pick_device(args.device)
    r = calibrate(model.to(device), images, args.r_target, device, mode=args.mode)
    save_thresholds(
        model,
        args.output,
        extra={"calibrated": f"{args.mode} on {len(images)} train images, r_target {args.r_target}, r_FLOPs {r:.4f}"},
    )
    print(
        f"{args.output}: {args.method} thresholds calibrated without training ({args.mode}) on {len(images)} "
        f"training images of {name}: r_FLOPs {r:.3f} for r_target {args.r_target}"
    )
    return 0


def cmd_export(args) -> int:
    import torch

    from . import data as ldata
    from .export import export_model

    model, name = _load_model(args)
    if args.thresholds or args.method:
        model = _reduced_model(args, model)
    if args.image:
        _, tf, _ = ldata.transforms_for(model, "none")
        example = ldata.read_images(args.image, tf, 1)[0][1][None]
    else:
        example = torch.randn(1, *model.pretrained_cfg.get("input_size", (3, 224, 224)))
    path = export_model(model, example, args.format, args.output)
    print(f"wrote {path} ({args.format}, {name}, {getattr(getattr(model, 'ltmp_config', None), 'method', 'dense')})")
    return 0


def cmd_pareto(args) -> int:
    from .thresholds import write_json
    from .viz import plot_pareto

    results = []
    for f in args.evals:
        try:
            r = json.loads(Path(f).read_text())
            results.append({"method": r["method"], "gmacs": float(r["gmacs"]), "top1": float(r["top1"])})
        except (OSError, ValueError, KeyError, TypeError):
            raise CLIError(f"{f} is not an eval JSON (write one with ltmp eval --json FILE)") from None
    plot_pareto(results, args.output, title=args.title)
    points = Path(args.output).with_suffix(".json")
    rows = sorted(({"file": f, **r} for f, r in zip(args.evals, results)), key=lambda r: (r["method"], r["gmacs"]))
    write_json(points, rows)
    print(f"wrote {args.output} and {points} ({len(results)} runs)")
    return 0


def cmd_demo(args) -> int:
    from .demo import DemoConfig, run_demo

    try:
        targets = tuple(float(t) for t in args.targets.split(","))
    except ValueError:
        raise CLIError(f"--targets takes comma-separated numbers such as 0.7,0.5, got '{args.targets}'") from None
    for t in targets:
        if not 0 < t <= 1:
            raise CLIError(f"--targets must lie in (0, 1], got {t}")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise CLIError(f"--output {args.output} is a file; ltmp demo writes a folder: pass another --output")
    run_demo(
        DemoConfig(
            output=args.output,
            model=args.model,
            pretrained=args.pretrained or args.model is None,
            checkpoint=args.checkpoint,
            data_dir=args.data_dir,
            val_split=args.val_split,
            targets=targets,
            epochs=args.epochs,
            batch_size=args.batch_size,
            max_val_images=args.max_images,
            workers=args.workers,
        ),
        progress=not args.quiet,
    )
    return 0


def cmd_pretrain(args) -> int:
    from .pretrain import PretrainConfig, pretrain

    res = pretrain(
        PretrainConfig(
            data_dir=args.data_dir,
            output=args.output,
            epochs=args.epochs,
            stop_after_epoch=args.stop_after_epoch,
            batch_size=args.batch_size,
            val_split=args.val_split,
            workers=args.workers,
            amp=args.amp,
            device=args.device,
            seed=args.seed,
        ),
        progress=not args.quiet,
    )
    print(json.dumps(res))
    return 0


OVERWRITE = "replace the output if it exists (it is never one of this command's inputs)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="ltmp", description="Learned Thresholds token Merging and Pruning for ViTs")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--version", action="version", version=f"ltmp {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("flops", help="dense GMACs of a ViT (fvcore convention)")
    f.add_argument("--model", required=True, help="timm name, local-dir:PATH, hf:DIR or open_clip:ARCH")
    f.set_defaults(func=cmd_flops)

    t = sub.add_parser("train", help="learn the thresholds (one epoch, frozen backbone, the paper's recipe)")
    _add_model_args(t)
    _add_data_args(t)
    t.add_argument("--output", required=True, help="run folder for thresholds, config, log and checkpoints")
    t.add_argument("--r-target", type=RATE, required=True, help="FLOPs reduction target in (0, 1] (eq. 14)")
    t.add_argument("--method", default="ltmp", choices=LEARNED)
    t.add_argument("--importance", default="mean", choices=["mean", "cls"])
    t.add_argument(
        "--recipe",
        default="default",
        choices=list(RECIPES),
        help="paper: every point of the reference code's training recipe (docs/training.md), for the options not given",
    )
    t.add_argument("--tau", type=POSITIVE, help="temperature of eq. 2's sigmoid (> 0; default 0.1)")
    t.add_argument("--lam", type=NONNEG, help="lambda of eq. 15 (default 10)")
    t.add_argument(
        "--budget",
        default="penalty",
        choices=["penalty", "constraint", "projected"],
        help="penalty: lambda (r - r_target)^2 (the paper); constraint: plus a multiplier raised by "
        "dual ascent until r_FLOPs meets the target; projected: steps along the budget's level "
        "set (the task loss decides where to reduce), then one shared shift meets the target on "
        "each batch",
    )
    t.add_argument(
        "--lr-prune",
        type=NONNEG,
        help="prune thresholds' learning rate (sgd: the merge rate times the squared ratio of the "
        "scores' spreads; adam: 2e-4)",
    )
    t.add_argument(
        "--lr-merge",
        type=NONNEG,
        help="merge thresholds' learning rate (sgd: the paper's 5e-3 times 9809 / steps; adam: 2e-3)",
    )
    t.add_argument(
        "--optimizer",
        choices=["sgd", "adam", "group"],
        help="sgd (the paper's, no momentum; its learning rates scaled to the run's length), adam "
        "(each threshold's step normalised by its gradient) or group (normalised per group: "
        "merge, prune); default: sgd",
    )
    t.add_argument(
        "--merge-init", type=FINITE, help="initial merge thresholds (default 1.0: no reduction; the paper's code: 0.9)"
    )
    t.add_argument("--prune-init", type=FINITE, help="initial prune thresholds (default 0)")
    t.add_argument(
        "--mask-grad",
        choices=MASK_GRADS,
        help="bounded form of eq. 6's gradient to removed tokens' masks (default secant; eps: the reference code's "
        "gradient; reference: its train-mode softmax, forward and gradient)",
    )
    t.add_argument(
        "--merge-grad",
        choices=MERGE_GRADS,
        help="merge thresholds learn through the masks and merged averages (default), or the masks only",
    )
    t.add_argument(
        "--calibrate",
        action="store_true",
        help="start from thresholds bisected to hit --r-target on 256 training images",
    )
    t.add_argument(
        "--settle",
        action=argparse.BooleanOptionalAction,
        help="when r_FLOPs on clean held-out (or training) images miss --r-target by more than 0.01, one "
        "shared shift settles the trained thresholds (default: on; --no-settle keeps them)",
    )
    t.add_argument(
        "--stop-collapsed",
        action=argparse.BooleanOptionalAction,
        help="stop when a block has removed every patch token of every image for 10 steps in a row (default: on; "
        "--no-stop-collapsed trains on, as the reference code does)",
    )
    t.add_argument(
        "--check-first-step",
        action=argparse.BooleanOptionalAction,
        help="SGD: refuse a learning rate whose first step would move a threshold by more than its scores' whole "
        "range (default: on; --no-check-first-step takes the step, as the reference code does)",
    )
    g = t.add_argument_group(
        "recipe points",
        "where the paper's recipe (--recipe paper) and the default differ; docs/training.md measures each",
    )
    g.add_argument(
        "--label-smoothing",
        type=number(float, 0, 1, high_open=True),
        help="of the cross-entropy (default 0; the reference code: 0.1)",
    )
    g.add_argument(
        "--combine",
        choices=CHOICES["combine"],
        help="a set-A token that merging and pruning both decide on: the product of their masks "
        "(default), or the prune mask overwrites the merge mask (the reference code)",
    )
    g.add_argument(
        "--importance-rows",
        choices=CHOICES["importance_rows"],
        help="eq. 17 in training over the surviving query rows (default, as eval) or all rows",
    )
    g.add_argument(
        "--train-order",
        choices=CHOICES["train_order"],
        help="in training, tokens keep their positions (default, as eval) or are reordered set A, set B "
        "after every block, with A/B over all positions (the reference code)",
    )
    g.add_argument(
        "--budget-tokens",
        choices=CHOICES["budget_tokens"],
        help="n of eq. 13: the patch tokens (default, the paper) or all tokens (the reference code)",
    )
    g.add_argument(
        "--budget-pool",
        choices=CHOICES["budget_pool"],
        help="the budget's r_FLOPs: the mean of each image's (default) or that of the batch's mean masks "
        "(the reference code)",
    )
    g.add_argument(
        "--clamp",
        choices=CHOICES["clamp"],
        help="thresholds within their scores' range (default; merge [-1, 1]) or [0, 1] (the reference)",
    )
    t.add_argument(
        "--distill",
        type=number(float, 0, 1),
        metavar="W",
        help="weight of distillation from the unreduced model's logits in the task loss (0: labels "
        "only, the paper; 1: teacher only)",
    )
    t.add_argument("--epochs", type=POSITIVE, help="passes over the training images (default 1)")
    t.add_argument("--steps", type=COUNT, help="optimizer steps (overrides --epochs)")
    t.add_argument(
        "--holdout",
        type=number(float, 0, 1, high_open=True),
        help="fraction of train held out for validation (default 0; the same images for every --seed)",
    )
    t.add_argument("--max-train-images", type=COUNT, help="train on a fixed random subset of this size")
    t.add_argument("--augment", choices=AUGMENTS, help="training augmentation (default timm)")
    t.add_argument("--seed", type=SEED, default=0)
    t.add_argument("--checkpoint-every", type=COUNT, default=50, help="steps between checkpoints")
    t.add_argument("--resume", action="store_true", help="continue an interrupted run in --output")
    t.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    t.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    t.add_argument("--compile", action="store_true", help="torch.compile the training forward (one graph)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="accuracy, GMACs and token counts of a dense, learned or fixed-rate model")
    _add_model_args(e)
    _add_data_args(e)
    e.add_argument("--thresholds", help="thresholds.safetensors from ltmp train")
    e.add_argument("--method", choices=["dense", *FIXED_RATE, *LEARNED])
    e.add_argument("--r", help="ToMe: tokens merged per layer, an int or a per-layer list 6,6,5,...")
    e.add_argument("--k", help="top-k baselines: tokens per layer, an int or a per-layer list")
    e.add_argument(
        "--match-gmacs",
        type=POSITIVE,
        help="fixed-rate methods: pick the per-layer r (or k) schedule closest to these GMACs",
    )
    e.add_argument("--match", help="fixed-rate methods: match the GMACs of this eval JSON")
    e.add_argument(
        "--follow",
        metavar="EVAL_JSON",
        help="fixed-rate methods: spread the rate over the layers like the tokens this run removed per "
        "layer, at its GMACs (or those of --match/--match-gmacs): its allocation, without "
        "per-image adaptivity",
    )
    e.add_argument("--compare", help="eval JSON of another run on the same images: paired McNemar test")
    e.add_argument("--max-images", type=COUNT, help="evaluate N images spread evenly over the split")
    e.add_argument("--json", help="write the full result here")
    e.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    e.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (dynamic shapes for reduced models); the first batches compile",
    )
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="latency at batch 1 and throughput at batch N against the dense model")
    _add_model_args(b)
    _add_reduction_args(b)
    b.add_argument("--batch-size", type=COUNT, default=32, help="throughput batch (batch 1 is always timed)")
    b.add_argument("--exported", help="also time this ltmp export file (.pt2 or TorchScript) at batch 1")
    b.add_argument(
        "--deployed",
        choices=["onnx", "openvino", "aoti"],
        help="time both models exported and run in a deployment runtime, one image at a time: ONNX "
        "Runtime (CPU), OpenVINO (CPU) or AOTInductor (needs a C++ compiler); docs/deploy.md",
    )
    b.add_argument("--images", type=COUNT, default=60, help="--deployed: images each repetition runs in turn")
    b.add_argument("--data-dir", help="time on the first images of this eval split (default: random input)")
    b.add_argument("--val-split", default="val")
    b.add_argument("--warmup", type=number(int, 0), default=3)
    b.add_argument("--reps", type=COUNT, default=10, help="timed forwards per model per round")
    b.add_argument(
        "--rounds",
        type=COUNT,
        default=3,
        help="interleaved rounds, each starting one model later (dense, reduced; reduced, dense; ...)",
    )
    b.add_argument("--threads", type=number(int, 1, 256), help="torch CPU threads")
    b.add_argument("--device", default="auto")
    b.add_argument("--json", help="write the result here")
    b.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    b.add_argument(
        "--compile", action="store_true", help="time both models under torch.compile (compiled in the warm-up forwards)"
    )
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("viz", help="per-layer picture of merged groups and pruned patches (Figures 1 and 7)")
    _add_model_args(v, required=False)
    _add_reduction_args(v)
    v.add_argument("--image", required=True, help="an image file, or a folder of images")
    v.add_argument("--max-images", type=COUNT, default=8, help="images from a folder (sorted by path)")
    v.add_argument("--output", default="ltmp-viz.png", help="PNG file to write")
    v.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    v.set_defaults(func=cmd_viz)

    a = sub.add_parser("analyze", help="tokens merged/pruned per layer (Figures 5-6) and Kendall tau (Table 1)")
    _add_model_args(a, required=False)
    _add_reduction_args(a)
    a.add_argument("--data-dir", help="ImageFolder root or .tar.gz (default: the bundled CIFAR-10 subset)")
    a.add_argument("--val-split", default="test")
    a.add_argument("--max-images", type=COUNT, default=1000, help="images spread evenly over the split")
    a.add_argument("--batch-size", type=COUNT, default=64)
    a.add_argument("--workers", type=WORKERS, default=2)
    a.add_argument("--kendall-k", type=COUNT, default=8, help="tokens merged and pruned per layer for Kendall tau")
    a.add_argument("--device", default="auto")
    a.add_argument("--output", default="ltmp-analysis", help="folder for the PNG and JSON files")
    a.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    a.set_defaults(func=cmd_analyze)

    c = sub.add_parser("calibrate", help="thresholds without training: bisected to hit r_target on a few images")
    _add_model_args(c, required=False)
    c.add_argument("--data-dir", help="ImageFolder root (train/ is used) or .tar.gz (default: the bundled subset)")
    c.add_argument("--r-target", type=RATE, help="FLOPs reduction target in (0, 1]")
    c.add_argument(
        "--match",
        metavar="EVAL_JSON",
        help="instead of --r-target: the r_FLOPs of this eval JSON (e.g. "
        "a trained run's, for one shared threshold at the same budget)",
    )
    c.add_argument("--method", default="ltmp", choices=LEARNED)
    c.add_argument(
        "--mode",
        default="shared",
        choices=["shared", "quantile"],
        help="shared: one merge threshold for every layer (matched trained thresholds on CIFAR-10); "
        "quantile: per-layer score quantiles, merging and pruning (1.2-2.4 points worse there)",
    )
    c.add_argument("--images", type=COUNT, default=256, help="training images to calibrate on")
    c.add_argument("--seed", type=SEED, default=0)
    c.add_argument("--device", default="auto")
    c.add_argument("--output", default="thresholds.safetensors")
    c.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    c.set_defaults(func=cmd_calibrate)

    x = sub.add_parser("export", help="export for deployment: torch.export (.pt2), ONNX or TorchScript")
    _add_model_args(x, required=False)
    _add_reduction_args(x)
    x.add_argument("--format", default="export", choices=["export", "onnx", "torchscript"])
    x.add_argument("--image", help="example image (default: random input of the model's size)")
    x.add_argument("--output", required=True, help="file to write (.pt2 for export, .onnx, .pt for torchscript)")
    x.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    x.set_defaults(func=cmd_export)

    pp = sub.add_parser("pareto", help="plot accuracy against GMACs from ltmp eval --json files (Figure 4)")
    pp.add_argument("evals", nargs="+", help="eval JSON files")
    pp.add_argument("--output", default="pareto.png")
    pp.add_argument("--overwrite", action="store_true", help=OVERWRITE)
    pp.add_argument("--title", default="")
    pp.set_defaults(func=cmd_pareto)

    d = sub.add_parser("demo", help="the whole method in minutes on the bundled CIFAR-10 ViT and images (default)")
    d.add_argument("--output", default="ltmp-demo", help="folder for the table, plots and trained thresholds")
    d.add_argument("--model", help="timm model (default: the bundled CIFAR-10 ViT)")
    d.add_argument("--pretrained", action="store_true")
    d.add_argument("--checkpoint")
    d.add_argument("--data-dir", help="ImageFolder root or .tar.gz (default: the bundled CIFAR-10 subset)")
    d.add_argument("--val-split", default="test")
    d.add_argument("--targets", default="0.7,0.5", help="comma-separated r_target values")
    d.add_argument("--epochs", type=POSITIVE, default=2.0)
    d.add_argument("--batch-size", type=COUNT, default=32)
    d.add_argument("--max-images", type=COUNT, help="evaluate N images spread evenly over the split")
    d.add_argument("--workers", type=WORKERS, default=2)
    d.set_defaults(func=cmd_demo)

    pt = sub.add_parser("pretrain", help="pretrain the small CIFAR-10 ViT from scratch (resumable)")
    pt.add_argument("--data-dir", required=True, help="CIFAR-10 ImageFolder root or the .tar.gz")
    pt.add_argument("--output", required=True, help="run folder (rerun the same command to resume)")
    pt.add_argument("--val-split", default="test", help="split evaluated after every epoch")
    pt.add_argument("--epochs", type=COUNT, default=9)
    pt.add_argument("--stop-after-epoch", type=COUNT, help="end early; the schedule still spans --epochs")
    pt.add_argument("--batch-size", type=COUNT, default=128)
    pt.add_argument("--workers", type=WORKERS, default=2)
    pt.add_argument("--seed", type=SEED, default=0)
    pt.add_argument("--amp", nargs="?", const="auto", default="", choices=["auto", "bf16", "fp16"])
    pt.add_argument("--device", default="auto")
    pt.set_defaults(func=cmd_pretrain)
    return p


#: each command's outputs: (argument, a folder?); pareto also writes the .json of its --output
OUTPUTS = {
    "train": [("output", True)],
    "eval": [("json", False)],
    "bench": [("json", False)],
    "viz": [("output", False)],
    "analyze": [("output", True)],
    "calibrate": [("output", False)],
    "export": [("output", False)],
    "pareto": [("output", False)],
}
#: arguments that name a command's input files or folders: no output may replace one, even with --overwrite
INPUTS = ("thresholds", "checkpoint", "match", "follow", "compare", "exported", "image", "evals", "data_dir")
#: what to do after Ctrl-C, per command (the others write nothing until they finish, atomically)
INTERRUPTED = {
    "train": "rerun with --resume to continue from the last checkpoint",
    "pretrain": "rerun the same command to continue from the last finished epoch",
    "demo": "rerun the same command to continue; finished trainings are kept",
}


def _same(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def _within(path: Path, folder: Path) -> bool:
    """``path`` lies inside ``folder`` (links followed)."""
    return folder.resolve() in path.resolve().parents


def check_outputs(args) -> None:
    """Before any work: no output replaces one of the command's inputs; none replaces an existing file or a folder
    with files in it without --overwrite (train: --resume or --overwrite, ``ltmp.train.check_run_folder``; demo
    and pretrain continue in their folder); each can be written (no file in the way, a writable folder)."""
    named = [getattr(args, k, None) for k in INPUTS]
    inputs = [Path(v) for x in named if x for v in (x if isinstance(x, list) else [x])]
    kind, _, folder = (getattr(args, "model", None) or "").partition(":")
    if kind in ("local-dir", "hf") and os.path.isdir(folder):  # a model folder: none of its files may be replaced
        inputs.append(Path(folder))
    outputs = [
        (Path(getattr(args, k)), f"--{k}", folder)
        for k, folder in OUTPUTS.get(args.command, ())
        if getattr(args, k, None)
    ]
    if args.command == "pareto":
        outputs.append(
            (outputs[0][0].with_suffix(".json"), f"--output's points file, {outputs[0][0].stem}.json,", False)
        )
    for path, flag, folder in outputs:
        inside = next((i for i in inputs if _same(path, i) or (i.is_dir() and _within(path, i))), None)
        if inside is not None:
            what = "is also an input" if _same(path, inside) else f"lies inside {inside}, an input"
            raise CLIError(f"{flag} {path} {what} of this command; write to another path")
        if path.is_symlink() and not path.exists():
            raise CLIError(f"{flag} {path} is a link to nothing ({os.readlink(path)}); pass another path")
        if folder and path.exists() and not path.is_dir():
            raise CLIError(f"{flag} {path} is a file; pass a folder")
        if not folder and path.is_dir():
            raise CLIError(f"{flag} {path} is a folder; pass a file name")
        if (
            args.command != "train"
            and not args.overwrite
            and path.exists()
            and not (path.is_dir() and not any(path.iterdir()))
        ):
            raise CLIError(f"{flag} {path} exists; pass --overwrite to replace it, or another {flag.split()[0]}")
        where = path if folder else path.parent
        while not where.exists():
            where = where.parent
        if not where.is_dir():
            raise CLIError(f"{flag} {path} cannot be created: {where} is a file, not a folder")
        try:
            tempfile.NamedTemporaryFile(dir=where).close()
        except OSError as e:
            raise CLIError(
                f"{flag} {path} cannot be written: no new file in {where} ({e.strerror}); pass a path "
                f"in a folder you can write"
            ) from None


#: the system's refusals of a file that a command reports in one line (errno -> the fix); any other OSError keeps
#: its traceback
SYSTEM_ERRORS = {
    errno.ENOSPC: "free disk space, or write to another disk",
    errno.EDQUOT: "free space within your disk quota, or write elsewhere",
    errno.EROFS: "write to a folder on a writable file system",
    errno.EACCES: "pass a path you can read or write",
    errno.EPERM: "pass a path you can read or write",
}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not [a for a in argv if a != "--quiet"]:  # bare `ltmp`: its usage (`ltmp demo` is the main job)
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad option (its one line is printed): the exit code
        return e.code
    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None  # a kill is a Ctrl-C
    try:
        check_outputs(args)
        return args.func(args)
    except LtmpError as e:  # a user mistake we name (CLIError, DataError, TrainError, ...): one line, no traceback
        print(f"ltmp: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the system refused a file (a full disk, permissions, a path that is not there)
        if e.errno not in SYSTEM_ERRORS:
            raise
        where = f" {e.filename}" if e.filename else ""
        print(f"ltmp: error: cannot use{where}: {e.strerror}; {SYSTEM_ERRORS[e.errno]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ltmp: interrupted; {INTERRUPTED.get(args.command, 'nothing was written')}", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)
