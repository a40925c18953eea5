"""The authors' LTMP pipeline (github Mxbonn/ltmp) on the bundled CIFAR-10 ViT: is the gap to top-k the model's or ours?

    python benchmarks/reference_pipeline.py --reference PATH --python REF_PYTHON [--runs runs/reference]
        [--json results/reference.json]

``PATH`` is a checkout of github.com/Mxbonn/ltmp (it has no licence: it is run, never copied into this project), and
``REF_PYTHON`` the Python of a throwaway environment outside the project with the versions it pins, e.g.::

    git clone https://github.com/Mxbonn/ltmp /tmp/ltmp-ref
    python3 -m venv /tmp/ltmp-ref-env
    /tmp/ltmp-ref-env/bin/pip install torch==2.14.1 torchvision==0.29.1 timm==0.9.5 fvcore wandb pyyaml

(it imports wandb unconditionally and needs timm 0.9.5: timm 1.x passes its blocks arguments they do not take).

For each of LTP and LTMP at r_target 0.5, and for its learning-rate settings (the paper's 5e-6 prune / 5e-3 merge
scaled to the run's length as ``ltmp train`` scales them, 10x those, and for LTP also 15x to 100x: at 10x it stops
short of the budget, at 30x and 100x it prunes every patch token in one block), this script:

1. trains with the authors' ``tools/train.py`` itself, on the CIFAR-10 train split, with its own recipe (label
   smoothing 0.1, plain SGD, its 2% hold-out, timm's augmentation, thresholds clamped to [0, 1], the prune mask
   overwriting the merge mask, ...) and the paper's tau of 0.1 (its command-line default is 0.5). Three shims let
   it run on a CPU, none of which changes what it computes: ``torch.cuda.synchronize`` does nothing, the default
   device of its train and validate loops is the CPU, and its closing fvcore FLOPs count (1,000 images under
   autocast, a report only) is skipped. Each optimizer step's thresholds go to the run's ``thresholds.jsonl`` (a
   step hook that reads them after the step, before the reference clamps them to [0, 1]);
2. evaluates the trained thresholds on the 10,000 test images with the authors' own inference model (tokens really
   removed; batch 1, the only batch it supports), recording each image's prediction and its per-block merged,
   pruned and kept tokens; and the accuracy its training script reports (the masked training model);
3. in this project's environment: GMACs from those counts (``ltmp.flops``), and on the same images the fixed-rate
   counterpart (``topk-prune`` for LTP, ToMe for LTMP) at matched GMACs with an even schedule and with the run's own
   mean per-block counts (``ltmp eval --match-gmacs`` / ``--follow``), paired image by image;
4. for the settings in ``OURS``, the same with this project's code (runs ``ours-<setting>``): ``ltmp train --recipe
   paper`` at the same learning rates, budget, seed and epoch, ``ltmp eval`` of its thresholds on the same test
   images, and the same two comparisons. With model, recipe and rates held equal, what differs from the authors'
   run is the code's.

Resumable: each run's training and evaluation is kept under ``--runs``; a run already in ``--json`` whose folder is
not there (measured on another machine) is kept as recorded, so delete its entry to measure it again.
``results/reference.json`` holds what docs/results.md shows (``benchmarks/reproduce.py --render`` renders the
section from it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
SHARED_MODEL = ROOT.parent / "shared" / "models" / "vit-cifar10"
DATA = ROOT.parent / "shared" / "data" / "cifar10" / "cifar10-jpeg.tar.gz"
R_TARGET = 0.5
PAPER_LR = {"prune": 5e-6, "merge": 5e-3}  # paper section 4, for one ImageNet epoch
PAPER_STEPS = 9809  # that epoch's steps of batch 128 (ltmp.train.PAPER_STEPS)
STEPS = 382  # the reference's epoch here: 98% of the 50,000 training images in batches of 128, last one dropped
#: learning-rate settings: the paper's rates times PAPER_STEPS / STEPS ("scaled"), and multiples of those
SCALES = {"scaled": 1.0, "10x": 10.0, "15x": 15.0, "20x": 20.0, "30x": 30.0, "100x": 100.0}
METHODS = {"ltp": "topk-prune", "ltmp": "tome"}  # learned method -> its fixed-rate counterpart
#: the settings each method runs at (LTMP's merge rate at 10x is 1.3 already)
METHOD_SCALES = {"ltp": ("scaled", "10x", "15x", "20x", "30x", "100x"), "ltmp": ("scaled", "10x")}
#: this project's ``ltmp train --recipe paper`` at the same settings ("ours-" runs): the same model, budget, recipe
#: and learning rates, trained and evaluated by this project's code, so that a difference from the authors' run is
#: the code's, not the recipe's
OURS = ("ltp-10x", "ltp-scaled")
#: the order of the runs, the likeliest to decide first
PRIORITY = ("ltp-100x", "ltmp-10x", "ltp-30x", "ltp-10x", "ltp-scaled", "ltp-20x", "ltp-15x", "ltmp-scaled")
SEED = 0


def runs_of() -> list[tuple[str, str, str]]:
    """(name, method, learning-rate setting) of every run, in the order they are run: the authors' code's, then
    this project's at the same settings (``OURS``)."""
    runs = [(f"{m}-{s}", m, s) for m in METHODS for s in METHOD_SCALES[m]]
    runs = sorted(runs, key=lambda r: PRIORITY.index(r[0]))
    return runs + [(f"ours-{name}", m, s) for name, m, s in runs if name in OURS]


def learning_rates(scale: str) -> tuple[float, float]:
    """(prune, merge) learning rates of a setting."""
    f = SCALES[scale] * PAPER_STEPS / STEPS
    return PAPER_LR["prune"] * f, PAPER_LR["merge"] * f


# ------------------------------------------------------------------------- inside the reference's environment


def _arch() -> dict:
    cfg = json.loads((SHARED_MODEL / "config.json").read_text())
    a = cfg["model_args"]
    keys = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "num_classes")
    return {k: tuple(a[k]) if isinstance(a[k], list) else a[k] for k in keys}, cfg["pretrained_cfg"]


def _register(reference: str) -> None:
    """Model names for the reference's train script: ``{ltp,ltmp}_vitcifar`` and their ``inference_`` models, the
    reference's classes with the bundled model's architecture, data config and (``pretrained``) weights."""
    sys.path.insert(0, reference)
    import torch
    from safetensors.torch import load_file
    from timm.models import register_model

    from ltmp.timm import lt_mergeprune, lt_mergeprune_inference, lt_pruning, lt_pruning_inference

    arch, data_cfg = _arch()
    classes = {
        "ltmp_vitcifar": (lt_mergeprune.LTMPVisionTransformer, lt_mergeprune.LTMPBlock),
        "ltp_vitcifar": (lt_pruning.LTPVisionTransformer, lt_pruning.LTPBlock),
        "inference_ltmp_vitcifar": (
            lt_mergeprune_inference.InferenceLTMPVisionTransformer,
            lt_mergeprune_inference.InferenceLTMPBlock,
        ),
        "inference_ltp_vitcifar": (
            lt_pruning_inference.InferenceLTPVisionTransformer,
            lt_pruning_inference.InferenceLTPBlock,
        ),
    }
    allowed = ("tau", "drop_rate", "drop_path_rate", "in_chans")

    def entry(name: str):
        cls, block = classes[name]

        def make(pretrained: bool = False, **kwargs):
            model = cls(block_fn=block, **arch, **{k: v for k, v in kwargs.items() if k in allowed})
            model.pretrained_cfg = model.default_cfg = dict(data_cfg)
            if pretrained:
                missing, unexpected = model.load_state_dict(load_file(SHARED_MODEL / "model.safetensors"), strict=False)
                assert not unexpected and all("masker" in k for k in missing), (missing, unexpected)
            return model

        make.__name__ = name
        return register_model(make)

    for name in classes:
        entry(name)
    torch.manual_seed(SEED)


def ref_train(args) -> None:
    """The reference's tools/train.py on the bundled model (three CPU shims, see the module docstring)."""
    import importlib.util

    import torch

    _register(args.reference)
    import timm.utils

    import ltmp as ref_ltmp  # the reference's package (its checkout is first on sys.path)

    torch.cuda.synchronize = lambda *a, **k: None
    ref_ltmp.utils.benchmark_flops_with_real_data = lambda *a, **k: float("nan")
    init = timm.utils.init_distributed_device

    def on_cpu(a):
        a.device = "cpu"
        return init(a)

    timm.utils.init_distributed_device = on_cpu
    spec = importlib.util.spec_from_file_location("reference_train", Path(args.reference) / "tools" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cpu = torch.device("cpu")
    for fn in (train.train_one_epoch, train.validate):
        fn.__defaults__ = tuple(cpu if isinstance(d, torch.device) else d for d in fn.__defaults__)
    prune_lr, merge_lr = learning_rates(args.scale)
    out = Path(args.out)
    sys.argv = [
        "train.py",
        args.data,
        "--model",
        f"{args.method}_vitcifar",
        "--pretrained",
        "--val-split",
        "test",
        "-b",
        "128",
        "--lr",
        repr(prune_lr),
        *([repr(merge_lr)] if args.method == "ltmp" else []),
        "--reduction-target",
        str(R_TARGET),
        "--tau",
        "0.1",
        "--epochs",
        "1",
        "--seed",
        str(args.seed),
        "--no-prefetcher",
        "-j",
        "2",
        "--log-interval",
        "10",
        "--output",
        str(out.parent),
        "--experiment",
        out.name,
    ]
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out.mkdir(parents=True, exist_ok=True)
    trace = (out / "thresholds.jsonl").open("w")  # each optimizer step's thresholds: a record, it changes nothing

    def record(optimizer, *_):
        trace.write(json.dumps([[float(p) for p in g["params"]] for g in optimizer.param_groups[:2]]) + "\n")
        trace.flush()

    register_optimizer_step_post_hook(record)
    train.main()


def ref_grad(args) -> None:
    """The reference's prune-threshold gradients on one batch at given thresholds (``grad_in.pt`` in ``--out``:
    images, labels, per-block prune thresholds), as its train script forms the loss: label-smoothed cross-entropy
    (0.1) and ``10 * (r_FLOPs - 0.5)^2`` with its FLOPs formula (tools/train.py:1138-1150); ``grad_out.json``."""
    import torch
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.models import create_model

    _register(args.reference)
    torch.set_num_threads(2)
    out = Path(args.out)
    spec = torch.load(out / "grad_in.pt")
    model = create_model(f"{args.method}_vitcifar", pretrained=True, tau=0.1)
    model.train()
    named = dict(model.named_parameters())
    thresholds = [named[f"blocks.{i}.prune_masker.threshold"] for i in range(len(model.blocks))]
    with torch.no_grad():
        for p, t in zip(thresholds, spec["prune"]):
            p.fill_(t)
    ce = LabelSmoothingCrossEntropy(smoothing=0.1)(model(spec["images"]), spec["labels"])
    layers, d, n = len(model.blocks), model.embed_dim, model.masks[0].shape[-1]
    ms = [1] + [torch.mean(m) for m in model.masks]
    flops_r = sum(
        (1 / layers)
        * ((2 * (ms[i] * n) * d**2 + (ms[i] * n) ** 2 * d) + (4 * (ms[i + 1] * n) * d**2))
        / (6 * n * d**2 + n**2 * d)
        for i in range(layers)
    )
    result = {"r_flops": float(flops_r), "ce_loss": float(ce)}
    for part, loss in (("ce", ce), ("budget", 10.0 * (flops_r - R_TARGET) ** 2)):
        grads = torch.autograd.grad(loss, thresholds, retain_graph=True, allow_unused=True, materialize_grads=True)
        result[part] = [float(g) for g in grads]
    (out / "grad_out.json").write_text(json.dumps(result))


def ref_eval(args) -> None:
    """The trained thresholds on the test split: the reference's inference model at batch 1 (per image: correct,
    and per block merged, pruned and kept patch tokens), and its masked training model at batch 128 (the accuracy
    its train script reports)."""
    import torch
    from timm.data import create_dataset, create_transform, resolve_data_config
    from timm.models import create_model

    _register(args.reference)
    torch.set_num_threads(2)
    out = Path(args.out)
    state = torch.load(out / "last.pth.tar", map_location="cpu", weights_only=False)["state_dict"]
    thresholds = {k: float(v) for k, v in state.items() if "masker" in k}
    infer = create_model(f"inference_{args.method}_vitcifar")
    infer.load_state_dict(state)
    infer.eval()
    masked = create_model(f"{args.method}_vitcifar", tau=0.1)
    masked.load_state_dict(state)
    masked.eval()
    tf = create_transform(**resolve_data_config({}, model=infer))
    data = create_dataset("", root=args.data, split="test", is_training=False)
    data.transform = tf
    counts: dict = {}

    def hook(i: int, kind: str):
        def record(module, inputs, output):
            if kind == "merge":
                counts["merged"][i] = int(output.sum())
            elif kind == "prune":
                counts["pruned"][i] = int((~output).sum())
            else:
                x = output[0] if isinstance(output, tuple) else output
                counts["kept"][i] = x.shape[1] - 1  # patch tokens (the class token is never removed)

        return record

    for i, blk in enumerate(infer.blocks):
        blk.register_forward_hook(hook(i, "block"))
        blk.prune_masker.register_forward_hook(hook(i, "prune"))
        if hasattr(blk, "merge_masker"):
            blk.merge_masker.register_forward_hook(hook(i, "merge"))
    depth = len(infer.blocks)
    correct, kept, merged, pruned, masked_correct = [], [], [], [], []
    t0 = time.time()
    with torch.no_grad():
        for j in range(len(data)):
            img, label = data[j]
            counts.update(merged=[0] * depth, pruned=[0] * depth, kept=[0] * depth)
            pred = int(infer(img[None]).argmax(-1))
            correct.append("1" if pred == label else "0")
            kept.append(list(counts["kept"]))
            merged.append(list(counts["merged"]))
            pruned.append(list(counts["pruned"]))
        loader = torch.utils.data.DataLoader(data, batch_size=128, num_workers=2)
        for img, label in loader:
            masked_correct += ["1" if c else "0" for c in (masked(img).argmax(-1) == label).tolist()]
    result = {
        "method": args.method,
        "scale": args.scale,
        "thresholds": thresholds,
        "correct": "".join(correct),
        "kept": kept,
        "merged": merged,
        "pruned": pruned,
        "masked_correct": "".join(masked_correct),
        "seconds": time.time() - t0,
        "timm": __import__("timm").__version__,
        "torch": torch.__version__,
    }
    tmp = out / "test.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / "test.json")


# ------------------------------------------------------------------------------ in this project's environment


def _ref(args, stage: str, name: str, method: str, scale: str, data: str, seed: int = SEED) -> None:
    cmd = [
        args.python,
        str(HERE),
        "--stage",
        stage,
        "--reference",
        args.reference,
        "--method",
        method,
        "--scale",
        scale,
        "--data",
        data,
        "--out",
        str(Path(args.runs) / name),
        "--seed",
        str(seed),
    ]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def summarize(args) -> dict:
    """Train and evaluate what is missing, then the fixed-rate counterparts in this project; the results JSON, written
    again after each run so that a long queue shows what it has."""
    import numpy as np
    import timm
    import torch

    sys.path.insert(0, str(HERE.parent))
    import ltmp
    from common import compact, pack, run, unpack
    from ltmp import data as ldata
    from ltmp.flops import r_flops_from_fracs
    from ltmp.significance import image_test

    data = str(ldata.resolve_root(str(DATA)))
    model = timm.create_model(f"local-dir:{SHARED_MODEL}", pretrained=True)
    spec = ltmp.vit_spec(model)
    runs = Path(args.runs)
    out: dict = {
        "reference": _commit(args.reference),
        "r_target": R_TARGET,
        "steps": STEPS,
        "seed": SEED,
        "num_patches": spec.num_patches,
        "planned": [name for name, _, _ in runs_of()],
        "machine": f"x86_64 CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),  # of this run (runs measured before keep their entries)
    }
    recorded = json.loads(Path(args.json).read_text())["runs"] if Path(args.json).exists() else {}
    out["runs"] = dict(recorded)  # each write keeps what is not measured again (the file changes only when one is)
    for name, method, scale in runs_of():
        folder = runs / name
        if name in recorded and not (folder / "test.json").exists():  # measured before, elsewhere: kept as it is
            continue
        if args.only and name not in args.only and not (folder / "test.json").exists():
            continue  # not asked for this time, and not run before
        ours = name.startswith("ours-")  # this project's code at the same recipe and rates
        if ours:
            learned = train_ours(folder, method, scale)  # its eval JSON
            if "stopped" in learned:
                entry = {"method": method, "scale": scale, "lr": dict(zip(("prune", "merge"), learning_rates(scale)))}
                out["runs"][name] = {**entry, "code": "ltmp", "stopped": learned["stopped"]}
                save(args.json, out)
                continue
            t = {"thresholds": learned["thresholds"], "masked_correct": None}
            r_flops = learned["r_flops"]
        else:
            if not (folder / "last.pth.tar").exists():
                _ref(args, "train", name, method, scale, data)
            if not (folder / "test.json").exists():
                _ref(args, "eval", name, method, scale, data)
            t = json.loads((folder / "test.json").read_text())
            kept = torch.tensor(t["kept"], dtype=torch.float64)  # (images, blocks)
            g = ltmp.gmacs(spec, kept)  # (images,)
            frac = torch.cat([torch.ones(len(kept), 1, dtype=kept.dtype), kept / spec.num_patches], 1)  # (images, L+1)
            r = r_flops_from_fracs(frac, spec.num_patches, spec.embed_dim, spec.mlp_hidden)  # (images,) eq. 13
            r_flops = float(r.mean())
            merged, pruned = np.array(t["merged"], dtype=float), np.array(t["pruned"], dtype=float)
            learned = {  # what ltmp eval --follow reads of an eval JSON
                "method": method,
                "top1": 100 * t["correct"].count("1") / len(t["correct"]),
                "correct": t["correct"],
                "gmacs": float(g.mean()),
                "per_layer": [{"merged": float(m), "pruned": float(p)} for m, p in zip(merged.mean(0), pruned.mean(0))],
            }
            (folder / "schedule.json").write_text(json.dumps(learned))
        correct = learned["correct"]
        base = eval_args(METHODS[method])
        rows = {}
        for kind, flags in (
            ("even", ["--match-gmacs", str(learned["gmacs"])]),
            ("own", ["--follow", str(folder / ("test.json" if ours else "schedule.json"))]),
        ):
            path = folder / f"{METHODS[method]}-{kind}.json"
            if not path.exists():
                try:
                    run([*base, *flags, "--json", str(path)])
                except SystemExit:  # refused, e.g. a block removes more than ToMe can merge (half its tokens)
                    path.write_text(json.dumps({"error": f"{METHODS[method]} cannot follow this schedule"}))
            row = json.loads(path.read_text())
            rows[kind] = row if "error" in row else compact(row)
        masked = t["masked_correct"]
        entry = {
            "method": method,
            "scale": scale,
            "lr": dict(zip(("prune", "merge"), learning_rates(scale))),
            "code": "ltmp" if ours else "reference",
            "thresholds": t["thresholds"],
            "top1": 100 * correct.count("1") / len(correct),
            "masked_top1": None if masked is None else 100 * masked.count("1") / len(masked),
            "gmacs": learned["gmacs"],
            "gmacs_dense": ltmp.dense_gmacs(spec),
            "r_flops": r_flops,
            "per_layer": learned["per_layer"],
            "correct": pack(correct),
            "baselines": {},
        }
        for kind, row in rows.items():
            if "error" in row:
                entry["baselines"][kind] = row
                continue
            diff = image_test([(1.0, [correct]), (-1.0, [unpack(row["correct"])])])
            entry["baselines"][kind] = {"top1": row["top1"], "gmacs": row["gmacs"], "correct": row["correct"], **diff}
        out["runs"][name] = entry
        save(args.json, out)
    return out


def save(path: str, out: dict) -> None:
    """The results JSON, its runs in the order of method and learning rate."""
    order = [n for n, _, _ in sorted(runs_of(), key=lambda r: (r[1], SCALES[r[2]]))]
    write_json(path, dict(out, runs={n: out["runs"][n] for n in order if n in out["runs"]}))
    print(f"wrote {path}", flush=True)


def eval_args(method: str) -> list[str]:
    """``ltmp eval`` of the bundled model on the 10,000 test images with ``method`` (flags to add)."""
    model = f"local-dir:{SHARED_MODEL}"
    return [
        "eval",
        "--model",
        model,
        "--pretrained",
        "--data-dir",
        str(DATA),
        "--val-split",
        "test",
        "--method",
        method,
    ]


def ltmp_train(folder: Path, method: str, scale: str, seed: int = SEED) -> str | None:
    """This project's ``ltmp train --recipe paper`` at a setting's learning rates (the same model, budget and epoch
    as the authors' run), by :func:`common.train_run`: resumes an interrupted run, returns why training stopped or
    None. A checkpoint every 10 steps keeps the folder and its log when training stops early."""
    from common import MODEL, train_run

    prune_lr, merge_lr = learning_rates(scale)
    flags = ["--model", MODEL, "--pretrained", "--data-dir", str(DATA), "--recipe", "paper", "--method", method]
    flags += ["--lr-prune", repr(prune_lr), "--lr-merge", repr(merge_lr), "--r-target", str(R_TARGET)]
    return train_run(folder, [*flags, "--seed", str(seed), "--checkpoint-every", "10"])


def train_ours(folder: Path, method: str, scale: str) -> dict:
    """:func:`ltmp_train`, then ``ltmp eval`` of its thresholds on the test images: the eval JSON, or
    ``{"stopped": why}``."""
    from common import run

    why = ltmp_train(folder, method, scale)
    if why is not None:
        return {"stopped": why}
    if not (folder / "test.json").exists():
        run(
            [
                *eval_args(method),
                "--thresholds",
                str(folder / "thresholds.safetensors"),
                "--json",
                str(folder / "test.json"),
            ]
        )
    return json.loads((folder / "test.json").read_text())


def write_json(path: str, result: dict) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def _commit(path: str) -> str:
    return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", required=True, help="a checkout of github.com/Mxbonn/ltmp")
    p.add_argument("--python", help="the Python of an environment with timm 0.9.5 for it (see the docstring)")
    p.add_argument("--runs", default=str(ROOT / "runs" / "reference"))
    p.add_argument("--json", default=str(ROOT / "results" / "reference.json"))
    p.add_argument("--only", nargs="+", help="train and evaluate only these runs (e.g. ltp-30x); finished ones stay")
    p.add_argument("--stage", choices=["train", "eval", "grad"], help=argparse.SUPPRESS)  # inside the reference's env
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--scale", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=SEED, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage == "train":
        return ref_train(args)
    if args.stage == "eval":
        return ref_eval(args)
    if args.stage == "grad":
        return ref_grad(args)
    if not args.python:
        p.error("--python: the Python of the reference's environment (timm 0.9.5) is required")
    summarize(args)


if __name__ == "__main__":
    main()
