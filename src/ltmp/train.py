"""Threshold training (paper section 3.4 and 4: one epoch, eq. 15), as a library function.

No argparse and no globals: ``ltmp.cli`` builds a :class:`TrainConfig` and calls :func:`train`. Data-parallel
training runs under ``torchrun`` (torch.distributed: gloo on the CPU, nccl on GPUs). Models and devices come from
:mod:`ltmp.runtime`, evaluation from :mod:`ltmp.evaluate`, the calibrated start from :mod:`ltmp.calibrate`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, Subset

from . import data as ldata
from .analysis import ALLOCATION_IMAGES, allocation
from .calibrate import calibrate, calibration_batch, score_spreads, settle, shift_to_budget
from .config import LEARNED
from .errors import LtmpError
from .evaluate import evaluate
from .flops import budget_loss_value, vit_spec
from .options import CHOICES
from .patching import THRESHOLD_NAMES, blocks, keeps_one, patch, score_ranges
from .record import mean_r_flops, r_flops, stats
from .runtime import (
    amp_context,
    amp_dtype,
    compile_model,
    create_model,
    label_names,
    pick_device,
    require_classifier,
)
from .runtime import logits as logits_of
from .thresholds import (
    atomic_write,
    check_run_owner,
    run_folder,
    save_thresholds,
    set_thresholds,
    threshold_tensors,
    write_json,
)


class TrainError(LtmpError):
    """Bad training input; the message names the fix."""


@dataclasses.dataclass
class TrainConfig:
    """Everything a threshold-training run depends on; saved as config.json beside the thresholds."""

    model: str  # timm model name, local-dir:PATH, hf:DIR_OR_NAME or open_clip:ARCH
    data_dir: str  # ImageFolder root (train/ and val/ splits) or a .tar.gz of that layout
    output: str  # run folder: thresholds.safetensors, config.json, log.jsonl, checkpoint.safetensors
    r_target: float  # FLOPs reduction target of eq. 14, in (0, 1]
    pretrained: bool = False  # load timm's pretrained weights (local-dir: folders always load theirs)
    checkpoint: str | None = None  # weights file (timm, torch or safetensors state dict)
    method: str = "ltmp"  # ltmp | ltpm | ltm | ltp
    importance: str = "mean"  # mean (eq. 17) | cls (eq. 16)
    tau: float = 0.1  # sigmoid temperature of eq. 2
    lam: float = 10.0  # lambda of eq. 15
    budget: str = "penalty"  # "penalty": lambda (r - r_target)^2 (eq. 14-15); "constraint": plus mu (r - r_target),
    #                          mu raised by dual ascent (mu += 2 lambda (r - r_target) per step) until r meets it;
    #                          "projected": the task loss's gradient with its budget component removed, then one
    #                          shift shared by all blocks until the batch meets r_target (projected_gradients)
    optimizer: str | None = None  # "sgd" (the paper's; steps keep the gradients' relative sizes over blocks) |
    #                               "adam" (each threshold's step normalised by its gradient) | "group" (Adam
    #                               normalised per parameter group: merge, prune; GroupAdam); None: sgd
    lr_prune: float | None = None  # prune thresholds' learning rate; None: OPTIMIZER_DEFAULTS (sgd: per run length)
    lr_merge: float | None = None  # merge thresholds' learning rate; None: OPTIMIZER_DEFAULTS (sgd: per run length)
    merge_init: float | None = None  # initial merge thresholds; None: OPTIMIZER_DEFAULTS (1.0: no reduction)
    prune_init: float = 0.0  # initial prune thresholds (reference code)
    mask_grad: str = "secant"  # bounded form of eq. 6's gradient to removed tokens' masks (ltmp.config.MASK_GRADS)
    merge_grad: str = "average"  # merge thresholds learn through masks and merged averages, or masks only ("mask")
    label_smoothing: float = 0.0  # of the cross-entropy (the reference code: 0.1, timm's default)
    combine: str = "product"  # a token two modules decide on: the product of their masks, or "overwrite" (ReduceConfig)
    importance_rows: str = "survivors"  # eq. 17 over the surviving query rows in training, or "all" (ReduceConfig)
    train_order: str = "positions"  # tokens keep their positions in training, or the "reference" order (ReduceConfig)
    budget_tokens: str = "patches"  # n of eq. 13: the patch tokens, or "all" tokens (ltmp.record.r_flops)
    budget_pool: str = "image"  # the budget's r_FLOPs: the mean over images, or of the "batch"'s mean masks
    clamp: str = "scores"  # thresholds kept within their scores' range, or within [0, 1] ("unit", the reference)
    recipe: str = "default"  # the RECIPES entry the unset options came from (recorded in config.json)
    calibrate: bool = False  # start from thresholds bisected to hit r_target on a few images (no training)
    settle: bool = True  # after training, shift the thresholds until clean images meet r_target (within 0.01)
    stop_collapsed: bool = True  # stop when a block has removed every patch token for COLLAPSE_STEPS steps
    check_first_step: bool = True  # SGD: refuse a first step that would move a threshold past its scores' range
    settle_images: int = 1024  # images for that check: held-out ones with --holdout, else training images
    distill: float = 0.0  # weight w of distillation: task loss (1 - w) CE(labels) + w KL(unreduced model || reduced)
    calibrate_images: int = 256  # images used by the calibration
    batch_size: int = 128  # global batch, split over processes
    epochs: float = 1.0  # passes over the training images (ignored if steps is set)
    steps: int | None = None  # optimizer steps; overrides epochs
    train_split: str = "train"
    val_split: str = "val"
    holdout: float = 0.0  # fraction of train held out for validation (the paper used 0.02)
    max_train_images: int | None = None  # a fixed random subset of the training images
    augment: str = "timm"  # timm (paper) | light | none
    labels: str | None = None  # class folders against the model's class names (ltmp.data.label_map, --labels)
    amp: str = ""  # mixed precision: "" off, "auto" (bf16 where supported, else fp16), "bf16", "fp16" (GPU)
    seed: int = 0
    checkpoint_every: int = 50  # steps between atomic checkpoints
    log_every: int = 1  # steps between JSONL log lines
    workers: int = 2
    device: str = "auto"
    eval_after: bool = True  # evaluate the trained thresholds on the validation split
    compile: bool = False  # torch.compile the train step's forward (one graph: train mode keeps every token)


#: Learning rates and initial merge thresholds when not given, per optimizer, all from no reduction (merge 1.0,
#: prune 0); docs/training.md has the evidence:
#: - sgd (the default of every method): the paper's merge learning rate
#:   (5e-3), which it used for one ImageNet epoch of PAPER_STEPS steps, times PAPER_STEPS / steps, so that a run of
#:   any length moves the merge thresholds as far as the paper's did (0.14 for the 351 steps of one epoch of 45,000
#:   CIFAR-10 images). The prune learning rate steps in the same units of its scores' spread
#:   (:func:`ltmp.calibrate.score_spreads`): lr_prune = lr_merge * (spread_prune / spread_merge)^2, since SGD on a
#:   threshold measured in spreads, theta = spread * u, moves theta by lr * spread^2 * dL/dtheta. The paper's ratio
#:   (5e-3 / 5e-6 = 1,000) is 16x smaller than this model's (spreads 0.110 and 0.0143: 60), so at the paper's
#:   rates its prune thresholds hardly move;
#: - adam, group: steps of about lr per step in each threshold's own units, 10x smaller for importance scores
#:   (mean column attention, about 1/n) than for cosine similarities.
OPTIMIZER_DEFAULTS = {
    "sgd": {"lr_merge": 5e-3, "lr_prune": "spread", "merge_init": 1.0},
    "adam": {"lr_merge": 2e-3, "lr_prune": 2e-4, "merge_init": 1.0},
    "group": {"lr_merge": 2e-3, "lr_prune": 2e-4, "merge_init": 1.0},
}
#: SGD is every method's default: in the pre-registered comparison with Adam on the CIFAR-10 test set
#: (docs/results.md, claim 8, 3 seeds, the image as the unit, Holm over the page) SGD was not worse for LTMP
#: (gaps over ToMe +0.04 to +0.53 points at r_target 0.65 to 0.45, Holm p 1) nor for LTP (gap over top-k pruning
#: -0.70, 95% CI -1.17 to -0.22, Holm p 0.18, r_target 0.5), and the rule keeps the one not worse.
#: Steps of the paper's one epoch: 1,281,167 ImageNet images less its 2% hold-out, in batches of 128.
PAPER_STEPS = 9809

#: The shared shift of ``budget="projected"`` meets r_target on each training batch within this tolerance.
BUDGET_TOLERANCE = 0.005
#: ... with at most this many eval-mode forwards of the batch per step (three times as many in the first step,
#: whose search starts without the size of an earlier shift). On the CIFAR-10 ViT, one epoch at r_target 0.5 used
#: 1.5 per step on average (benchmarks/training_study.py allocation, log.jsonl "budget_evals").
BUDGET_EVALS = 8


#: How the budget of eq. 14 enters training (``TrainConfig.budget``).
BUDGETS = ("penalty", "constraint", "projected")


def resolve(cfg: TrainConfig, steps: int | None = None, spreads: dict[str, float] | None = None) -> TrainConfig:
    """The config with the optimizer (SGD if none is given) and the optimizer's defaults filled in where
    a value was not given. SGD's learning rates depend on the run's length and its prune rate on the scores'
    spreads (:func:`ltmp.calibrate.score_spreads`): they stay unset until ``steps`` and ``spreads`` are given."""
    optimizer = cfg.optimizer or "sgd"
    if optimizer not in OPTIMIZER_DEFAULTS:
        raise TrainError(f"unknown --optimizer '{optimizer}'; choose one of: {', '.join(OPTIMIZER_DEFAULTS)}")
    defaults = {"optimizer": optimizer, **OPTIMIZER_DEFAULTS[optimizer]}
    if optimizer == "sgd":
        lr_merge = defaults["lr_merge"] * PAPER_STEPS / steps if steps else None
        defaults["lr_merge"] = lr_merge
        defaults["lr_prune"] = (
            None
            if lr_merge is None or spreads is None
            else ((cfg.lr_merge or lr_merge) * (spreads["prune_threshold"] / spreads["merge_threshold"]) ** 2)
        )
    return dataclasses.replace(cfg, **{k: v for k, v in defaults.items() if getattr(cfg, k) is None})


def needs_spreads(cfg: TrainConfig) -> bool:
    """The prune learning rate comes from the scores' spreads (:func:`resolve`)."""
    return cfg.lr_prune is None and OPTIMIZER_DEFAULTS[resolve(cfg).optimizer]["lr_prune"] == "spread"


def threshold_training_mode(model: nn.Module) -> nn.Module:
    """Train-mode representation (masks, differentiable) with dropout and drop-path off: every submodule in eval
    mode, only the top-level flag set. The backbone is frozen; only the thresholds require grad."""
    model.eval()
    model.training = True
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(THRESHOLD_NAMES))
    return model


@dataclasses.dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: join the group (nccl on CUDA, gloo on the CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(), pick_device(device_name)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local), device


# ------------------------------------------------------------------------------------------------------- sampling


class StepBatches(Sampler):
    """Yields, for each optimizer step from ``start``, this rank's share of the global batch.

    The global order is a seeded permutation per epoch, so any number of processes (and a resumed run) see the
    same images in the same steps as one uninterrupted process. Items are ``(index, epoch)`` pairs: the epoch
    seeds the augmentation.
    """

    def __init__(
        self, n: int, global_batch: int, total_steps: int, seed: int, rank: int = 0, world: int = 1, start: int = 0
    ):
        if global_batch % world:
            raise TrainError(f"--batch-size {global_batch} must be divisible by the {world} processes")
        self.n, self.batch, self.total, self.seed = n, global_batch, total_steps, seed
        self.rank, self.world, self.start = rank, world, start
        self.per_epoch = n // global_batch
        if self.per_epoch == 0:
            raise TrainError(f"only {n} training images for a batch of {global_batch}; lower --batch-size")

    def __len__(self) -> int:
        return self.total - self.start

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        per_rank = self.batch // self.world
        perm, perm_epoch = None, -1
        for step in range(self.start, self.total):
            epoch, k = divmod(step, self.per_epoch)
            if epoch != perm_epoch:
                perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
                perm_epoch = epoch
            glob = perm[k * self.batch : (k + 1) * self.batch]
            mine = glob[self.rank * per_rank : (self.rank + 1) * per_rank]
            yield [(int(i), epoch) for i in mine]


class EpochIndexed(torch.utils.data.Dataset):
    """Maps ``(index, epoch)`` items to the underlying dataset, seeding augmentation per (seed, epoch, index)."""

    def __init__(self, base: ldata.ImageFolder, indices: list[int], seed: int):
        self.base, self.indices, self.seed = base, indices, seed

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item):
        i, epoch = item
        self.base.seed, self.base.epoch = self.seed, epoch
        return self.base[self.indices[i]]


# ---------------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    model: nn.Module,
    path: Path,
    step: int,
    cfg: TrainConfig,
    carry: dict[str, float] | None = None,
    opt: torch.optim.Optimizer | None = None,
) -> None:
    """Thresholds, optimizer state and ``carry`` (the budget's own state: ``mu`` of ``budget="constraint"``, the
    last shift's size of ``budget="projected"``) at ``step``, written atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in threshold_tensors(model).items()}
    for i, state in opt.state_dict()["state"].items() if opt is not None else ():  # Adam's moments and step
        for key, value in state.items():
            tensors[f"opt.{i}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    meta = {
        "format": "ltmp-train-checkpoint",
        "step": str(step),
        "config": json.dumps(dataclasses.asdict(cfg)),
        **{k: repr(float(v)) for k, v in (carry or {}).items()},
    }
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


#: settings that must not change when a run resumes: everything that shapes its result (the first that differs is
#: named; learning rates are compared as resolved, so one given by hand must match what the run first used)
RESUME_KEYS = (
    "model",
    "pretrained",
    "checkpoint",
    "data_dir",
    "train_split",
    "holdout",
    "max_train_images",
    "labels",
    "method",
    "importance",
    "r_target",
    "recipe",
    "batch_size",
    "epochs",
    "steps",
    "seed",
    "augment",
    "tau",
    "lam",
    "budget",
    "optimizer",
    "lr_merge",
    "lr_prune",
    "merge_init",
    "prune_init",
    "calibrate",
    "mask_grad",
    "merge_grad",
    "distill",
    "label_smoothing",
    "combine",
    "importance_rows",
    "train_order",
    "budget_tokens",
    "budget_pool",
    "clamp",
)


#: values of settings added later, for checkpoints written before they existed
LEGACY = {
    "distill": 0.0,
    "label_smoothing": 0.0,
    "combine": "product",
    "importance_rows": "survivors",
    "train_order": "positions",
    "budget_tokens": "patches",
    "budget_pool": "image",
    "clamp": "scores",
    "labels": None,
    "recipe": "default",
}


def load_checkpoint_state(model: nn.Module, path: Path, cfg: TrainConfig) -> tuple[int, dict[str, float], dict]:
    """Restore thresholds from a training checkpoint made with the same settings; returns the step to continue
    from, the budget's state (``mu``, ``shift_step``; see :func:`save_checkpoint`) and the optimizer's
    per-parameter state."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise TrainError(f"cannot read checkpoint {path} ({type(e).__name__}); delete it to start over") from None
    if meta.get("format") != "ltmp-train-checkpoint":
        raise TrainError(f"{path} is not an ltmp training checkpoint; delete it to start over")
    saved = json.loads(meta.get("config", "{}"))
    now = dataclasses.asdict(cfg)
    changed = [k for k in RESUME_KEYS if saved.get(k, LEGACY.get(k)) != now[k]]
    if changed:
        k = changed[0]
        raise TrainError(
            f"cannot resume {path.parent}: it was started with {k}={saved.get(k)!r}, not "
            f"{now[k]!r}; resume with the same settings or use another --output"
        )
    opt_state: dict[int, dict] = {}
    for key in [k for k in tensors if k.startswith("opt.")]:
        _, i, name = key.split(".", 2)
        opt_state.setdefault(int(i), {})[name] = tensors.pop(key)
    set_thresholds(model, tensors, str(path))
    carry = {k: float(meta.get(k, "0.0")) for k in ("mu", "shift_step")}
    return int(meta["step"]), carry, opt_state


# ---------------------------------------------------------------------------------------------------------- train


def build_train_data(cfg: TrainConfig, model: nn.Module):
    """The training images (with their indices after the hold-out and ``max_train_images``), the images evaluated
    after training (held out, or the validation split) and the data config. Class folders carry the model's labels
    (``ltmp.data.label_map``: by name where the model names its classes, ``cfg.labels``); ``train_set.notes`` says
    what needs saying about them."""
    root = ldata.resolve_root(cfg.data_dir)
    train_tf, eval_tf, data_cfg = ldata.transforms_for(model, cfg.augment)
    hint = f"training reads the {cfg.train_split}/ split of --data-dir"
    train_set = ldata.labelled(ldata.split_dir(root, cfg.train_split), train_tf, label_names(model), cfg.labels, hint)
    indices = list(range(len(train_set)))
    held: list[int] = []
    if cfg.holdout:
        indices, held = ldata.holdout_split(len(train_set), cfg.holdout)
    if cfg.max_train_images:
        g = torch.Generator().manual_seed(cfg.seed + 104729)
        pick = torch.randperm(len(indices), generator=g)[: cfg.max_train_images].tolist()
        indices = sorted(indices[i] for i in pick)
    if held:
        val_set = Subset(ldata.ImageFolder(train_set.root, eval_tf, train_set.classes, labels=train_set.labels), held)
    else:
        val_root = ldata.split_dir(root, cfg.val_split)
        val_set = ldata.labelled(val_root, eval_tf, label_names(model), cfg.labels) if val_root.is_dir() else None
    return train_set, indices, val_set, data_cfg


def total_steps(cfg: TrainConfig, n_train: int) -> int:
    if cfg.steps is not None:
        return int(cfg.steps)
    return max(1, math.ceil(cfg.epochs * (n_train // cfg.batch_size)))


def validate(cfg: TrainConfig) -> None:
    if not 0.0 < cfg.r_target <= 1.0:
        raise TrainError(f"--r-target must lie in (0, 1], got {cfg.r_target}")
    if cfg.method not in LEARNED:
        raise TrainError(f"--method {cfg.method} has no thresholds to train; choose one of: {', '.join(LEARNED)}")
    if cfg.budget not in BUDGETS:
        raise TrainError(f"unknown --budget '{cfg.budget}'; choose one of: {', '.join(BUDGETS)}")
    if not 0.0 <= cfg.distill <= 1.0:
        raise TrainError(f"--distill is a weight in [0, 1] (0: labels only, 1: teacher only), got {cfg.distill}")
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise TrainError(f"unknown {key} '{getattr(cfg, key)}'; choose one of: {', '.join(allowed)}")
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise TrainError(f"label smoothing must lie in [0, 1), got {cfg.label_smoothing}")
    if cfg.batch_size < 1 or (cfg.steps is not None and cfg.steps < 1) or cfg.epochs <= 0:
        raise TrainError("--batch-size, --steps and --epochs must be positive")


def check_run_folder(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, to replace a run without being asked: a finished run (its thresholds) or an
    interrupted one (its checkpoint) in ``out`` needs ``resume`` or ``overwrite``."""
    if resume and overwrite:
        raise TrainError("pass --resume to continue the run in --output, or --overwrite to replace it; not both")
    if out.exists() and not out.is_dir():
        raise TrainError(f"--output {out} is a file; pass a run folder (new, or one to --resume)")
    check_run_owner(out, "train")
    ckpt, done = out / "checkpoint.safetensors", out / "thresholds.safetensors"
    if resume and done.exists() and not ckpt.exists():
        raise TrainError(
            f"{out} holds a finished run and no checkpoint, so there is nothing to resume; pass "
            f"--overwrite to train it again, or another --output"
        )
    if not (resume or overwrite) and ckpt.exists():
        raise TrainError(f"{out} holds an interrupted run; resume it with --resume, or pass --overwrite to start over")
    if not (resume or overwrite) and done.exists():
        raise TrainError(f"{out} already holds a finished run; pass --overwrite to replace it, or another --output")


def train(cfg: TrainConfig, resume: bool = False, progress: bool = True, overwrite: bool = False) -> dict:
    """Train the thresholds of one model (paper section 4): frozen backbone, the loss of eq. 15 (its budget as a
    penalty, a dual-ascent constraint or a projection, ``cfg.budget``), SGD by default as in the paper
    (``OPTIMIZER_DEFAULTS``).

    Writes into ``cfg.output``: ``config.json``, ``log.jsonl``, ``checkpoint.safetensors`` (every
    ``checkpoint_every`` steps, atomically) and finally ``thresholds.safetensors``. Only rank 0 writes. A folder
    that holds a run is refused unless ``resume`` (continue its checkpoint) or ``overwrite`` (start over);
    a run that fails before its first checkpoint removes the folder it created.

    Returns:
        A summary (final thresholds file, steps, last r_FLOPs, and the validation result if ``eval_after``).
    """
    cfg = resolve(cfg)
    validate(cfg)
    out = Path(cfg.output)
    check_run_folder(out, resume, overwrite)  # on every rank: none may go on
    ddp, device = init_distributed(cfg.device)
    created = not out.exists()
    with run_folder(out, "train") if ddp.main else contextlib.nullcontext():  # a second run on it is refused
        try:
            return _train(cfg, ddp, device, out, resume, overwrite, progress)
        except BaseException:
            if ddp.main and created and not (out / "checkpoint.safetensors").exists():
                shutil.rmtree(out, ignore_errors=True)
            raise


def _train(
    cfg: TrainConfig, ddp: Dist, device: torch.device, out: Path, resume: bool, overwrite: bool, progress: bool
) -> dict:
    ckpt_path = out / "checkpoint.safetensors"
    torch.manual_seed(cfg.seed)
    model = create_model(
        cfg.model, cfg.pretrained, cfg.checkpoint, (cfg.data_dir, cfg.train_split)
    )  # open_clip: a zero-shot classifier of these classes
    require_classifier(model)
    teacher = None
    if cfg.distill > 0:  # the same weights without reduction: its logits are the target of the distillation term
        teacher = copy.deepcopy(model).eval().requires_grad_(False).to(device)
    patch(
        model,
        cfg.method,
        tau=cfg.tau,
        importance=cfg.importance,
        merge_threshold=cfg.merge_init,
        prune_threshold=cfg.prune_init,
        mask_grad=cfg.mask_grad,
        merge_grad=cfg.merge_grad,
    )
    for key in ("combine", "importance_rows", "train_order"):  # train mode only: eval is the same either way
        setattr(model.ltmp_config, key, getattr(cfg, key))
    model.to(device)
    threshold_training_mode(model)
    train_set, indices, val_set, data_cfg = build_train_data(cfg, model)
    if not any(ldata.readable(train_set.samples[i][0]) for i in indices):  # stops at the first readable image
        raise TrainError(
            f"none of the {len(indices)} training images in {train_set.root} can be read; pass a "
            f"--data-dir whose train/ holds JPEG or PNG images"
        )
    steps = total_steps(cfg, len(indices))
    spreads = None
    if needs_spreads(cfg):  # measured on clean training images, before any training step
        spreads = score_spreads(
            model,
            calibration_batch(model, train_set.root, cfg.calibrate_images, cfg.seed + 61, indices, train_set.classes),
            device,
            cfg.batch_size,
        )
        threshold_training_mode(model)
    given = {"lr_merge": cfg.lr_merge, "lr_prune": cfg.lr_prune}  # (the rest scale with --steps)
    cfg = resolve(cfg, steps, spreads)
    start, carry, opt_state = 0, {"mu": 0.0, "shift_step": 0.0}, {}
    if cfg.calibrate and not (resume and ckpt_path.exists()):
        calibrate(
            model,
            calibration_batch(model, train_set.root, cfg.calibrate_images, cfg.seed + 31, indices, train_set.classes),
            cfg.r_target,
            device,
        )
        threshold_training_mode(model)
    if resume and ckpt_path.exists():
        start, carry, opt_state = load_checkpoint_state(model, ckpt_path, cfg)

    net: nn.Module = model
    if ddp.world > 1 and cfg.budget != "projected":  # projected_gradients all-reduces its own gradients
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        net = compile_model(net, device, train=True)
    merge_p = [p for n, p in model.named_parameters() if n.endswith("merge_threshold")]
    prune_p = [p for n, p in model.named_parameters() if n.endswith("prune_threshold")]
    groups = [
        g for g in ({"params": merge_p, "lr": cfg.lr_merge}, {"params": prune_p, "lr": cfg.lr_prune}) if g["params"]
    ]
    opt = {"adam": torch.optim.Adam, "group": GroupAdam, "sgd": torch.optim.SGD}[cfg.optimizer](groups)
    if opt_state:
        saved = opt.state_dict()
        saved["state"] = opt_state
        opt.load_state_dict(saved)
    # fp16 gradients of the thresholds underflow without loss scaling
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype(cfg.amp, device) == torch.float16)

    sampler = StepBatches(len(indices), cfg.batch_size, steps, cfg.seed, ddp.rank, ddp.world, start)
    loader = DataLoader(
        EpochIndexed(train_set, indices, cfg.seed),
        batch_sampler=sampler,
        num_workers=cfg.workers,
        collate_fn=ldata.collate_skip,
        persistent_workers=False,
        pin_memory=device.type == "cuda",
    )
    log_path = out / "log.jsonl"
    if ddp.main:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("checkpoint.safetensors", "thresholds.safetensors", "eval.json") if overwrite else ():
            (out / name).unlink(missing_ok=True)  # the run being replaced, as asked
        resolved = {
            **dataclasses.asdict(cfg),
            "total_steps": steps,
            "train_images": len(indices),
            "world_size": ddp.world,
            "device": str(device),
            "data_config": data_cfg,
            "score_spreads": spreads,
            "torch": torch.__version__,
        }
        write_json(out / "config.json", resolved)
        kept_lines = []
        if start and log_path.exists():
            kept_lines = [ln for ln in log_path.read_text().splitlines() if _log_step(ln) <= start]
        atomic_write(log_path, lambda tmp: Path(tmp).write_text("".join(ln + "\n" for ln in kept_lines)))

    bar = None
    if progress and ddp.main:
        from tqdm import tqdm

        bar = tqdm(
            total=steps,
            initial=start,
            desc=f"train {cfg.method} r_target={cfg.r_target}",
            unit="step",
            dynamic_ncols=True,
        )
    skipped = 0
    empty_runs = None  # per block: steps in a row in which it removed every patch token (_collapse_check)
    last: dict = {}
    t0 = time.perf_counter()
    seen = 0
    log_f = open(log_path, "a") if ddp.main else None
    try:
        for step, (imgs, labels, _, nskip) in enumerate(loader, start=start):
            skipped += nskip
            empty = imgs is None
            if ddp.world > 1:  # every rank must skip together, or the collectives fall out of step
                flag = torch.tensor([float(empty)], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                empty = bool(flag.item())
            if empty:
                continue
            imgs, labels = imgs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with amp_context(cfg.amp, device):
                logits = logits_of(net(imgs))
            ce = F.cross_entropy(logits.float(), labels, label_smoothing=cfg.label_smoothing)
            task = ce
            if teacher is not None:
                with torch.no_grad(), amp_context(cfg.amp, device):
                    target_logits = logits_of(teacher(imgs))  # (B, classes)
                kd = distill_loss(logits.float(), target_logits.float())
                task = (1 - cfg.distill) * ce + cfg.distill * kd
            if cfg.stop_collapsed:  # (a read of the record and, distributed, an all-reduce per step)
                empty_runs = _collapse_check(model, ddp, empty_runs)
                if max(empty_runs) >= COLLAPSE_STEPS:
                    raise TrainError(_collapse_message(model, cfg, empty_runs.index(max(empty_runs)), step + 1))
            opt.zero_grad(set_to_none=True)
            if cfg.budget == "projected":
                r = projected_gradients(
                    model, task, merge_p, prune_p, ddp, scaler.get_scale() if scaler.is_enabled() else 1.0
                )
                if all(p.grad is None or torch.isfinite(p.grad).all() for p in merge_p + prune_p):
                    opt.step()
                project_thresholds(model, merge_p, prune_p, cfg.clamp)
                shift = meet_budget(model, imgs, cfg, device, ddp, carry["shift_step"])
                carry["shift_step"] = abs(shift["shift"]) or carry["shift_step"]
                reg = budget_loss_value(r, cfg.r_target)
                loss = task + cfg.lam * reg  # logged only: the step above follows the task loss alone
            else:
                r = mean_r_flops(model, cfg.budget_tokens, cfg.budget_pool)  # the global batch's under torchrun
                reg = budget_loss_value(r, cfg.r_target)  # eq. 14, as ltmp.budget_loss
                loss = task + cfg.lam * reg  # eq. 15, with the distillation term in the task loss if asked
                if cfg.budget == "constraint":
                    loss = loss + carry["mu"] * (r - cfg.r_target)
                scaler.scale(loss).backward()
                if step == 0 and cfg.optimizer == "sgd" and cfg.check_first_step:
                    check_first_step(model, cfg, steps, given, scaler.get_scale() if scaler.is_enabled() else 1.0)
                scaler.step(opt)
                scaler.update()
                project_thresholds(model, merge_p, prune_p, cfg.clamp)
                if cfg.budget == "constraint":  # dual ascent; r is the global batch's on every rank
                    carry["mu"] += 2 * cfg.lam * (float(r.detach()) - cfg.r_target)
            seen += imgs.shape[0] * ddp.world
            done = step + 1
            if ddp.main:
                ips = seen / max(time.perf_counter() - t0, 1e-9)
                values = torch.stack(
                    [v.detach().float().reshape(()) for v in (loss, ce, task, reg, r, *merge_p, *prune_p)]
                )
                loss_v, ce_v, task_v, reg_v, r_v, *th = values.tolist()  # one host synchronisation per step
                last = {
                    "step": done,
                    "loss": loss_v,
                    "ce": ce_v,
                    "budget": reg_v,
                    "r_flops": r_v,
                    "images_per_s": round(ips, 1),
                    "skipped": skipped,
                    "mu": carry["mu"],
                    "merge": th[: len(merge_p)],
                    "prune": th[len(merge_p) :],
                }
                if cfg.budget == "projected":  # the shared shift and the r_FLOPs it reached on this batch
                    last.update(shift=shift["shift"], r_flops_met=shift["r_flops"], budget_evals=shift["evals"])
                if teacher is not None:
                    last["task"] = task_v  # (1 - w) CE + w KL
                if done % cfg.log_every == 0 or done == steps:
                    log_f.write(json.dumps(last) + "\n")
                    log_f.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_v:.3f}", r_flops=f"{r_v:.3f}", img_s=f"{ips:.0f}")
                if done % cfg.checkpoint_every == 0 and done < steps:
                    save_checkpoint(model, ckpt_path, done, cfg, carry, opt)
    finally:
        if bar is not None:
            bar.close()
        if log_f is not None:
            log_f.close()
    result = {
        "steps": steps,
        "train_images": len(indices),
        "skipped": skipped,
        **{k: last.get(k) for k in ("r_flops", "loss")},
    }
    if ddp.world > 1:
        dist.barrier()  # training is done on every rank; rank 0 settles, saves and evaluates alone
        if not ddp.main:
            return result
    meta = {"r_target": repr(cfg.r_target), "steps": str(steps)}
    images, where = settle_images(cfg, model, train_set, indices, val_set)
    if cfg.settle:
        result["settle"] = {**settle(model, images, cfg.r_target, device, amp=cfg.amp), "on": where}
        threshold_training_mode(model)
        meta.update(
            {
                "r_flops_trained": repr(result["settle"]["r_flops_trained"]),
                "r_flops_settled": repr(result["settle"]["r_flops"]),
                "settle_shift": repr(result["settle"]["shift"]),
                "settled_on": where,
            }
        )
    save_thresholds(model, out / "thresholds.safetensors", extra=meta)
    # where the learned thresholds reduce, against one shared threshold at the same r_FLOPs (on the same images)
    result["allocation"] = {**allocation(model, images[:ALLOCATION_IMAGES], device, cfg.batch_size), "on": where}
    threshold_training_mode(model)
    if ckpt_path.exists():
        ckpt_path.unlink()
    result["thresholds"] = str(out / "thresholds.safetensors")
    if cfg.eval_after and val_set is not None:
        loader = DataLoader(val_set, batch_size=cfg.batch_size, num_workers=cfg.workers, collate_fn=ldata.collate_skip)
        result["eval"] = evaluate(model, loader, device, amp=cfg.amp, progress=progress, model_name=cfg.model)
        for key in ("settle", "allocation"):
            if key in result:
                result["eval"][key] = result[key]
        write_json(out / "eval.json", result["eval"])
    return result


def settle_images(cfg: TrainConfig, model: nn.Module, train_set, indices: list[int], val_set) -> tuple:
    """Clean images to settle the budget on (eval transform): the held-out images (``--holdout``), else training
    images; never the validation split, which evaluates. Returns the (N, 3, H, W) batch and where it came from."""
    n = cfg.settle_images
    if isinstance(val_set, Subset):  # held out of train (--holdout); spread over it, as it is sorted by class
        held = ldata.spread_subset(val_set, n)
        items = [it for it in (held[i] for i in range(len(held))) if it is not None]
        if items:
            return torch.stack([it[0] for it in items]), f"{len(items)} held-out training images"
    images = calibration_batch(model, train_set.root, n, cfg.seed + 47, indices, train_set.classes)
    return images, f"{len(images)} training images (eval transform; pass --holdout to settle on held-out ones)"


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), averaged over the batch: the unreduced model's class probabilities as soft labels.

    Args:
        logits: (B, classes) of the reduced model.
        target_logits: (B, classes) of the same weights without reduction (no gradient).
    """
    return F.kl_div(F.log_softmax(logits, -1), F.log_softmax(target_logits, -1), log_target=True, reduction="batchmean")


class GroupAdam(torch.optim.Optimizer):
    """Adam normalised per parameter group: every threshold keeps its own first moment (momentum), but the step is
    divided by the root of the group's mean second moment, not by each threshold's own. Within a group (the merge
    thresholds, the prune thresholds) the steps keep the relative sizes of their gradients, which Adam's
    per-parameter normalisation removes; ``lr`` is the root-mean-square step of the group."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-12):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            if not live:
                continue
            b1, b2 = group["betas"]
            for p in live:
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            t = float(self.state[live[0]]["step"])
            second = torch.stack([self.state[p]["exp_avg_sq"] for p in live]).mean() / (1 - b2**t)
            scale = group["lr"] / (1 - b1**t) / (second.sqrt() + group["eps"])
            for p in live:
                p.sub_(scale * self.state[p]["exp_avg"])


def threshold_units(model: nn.Module, merge: list[nn.Parameter], prune: list[nn.Parameter]) -> torch.Tensor:
    """The typical scale of each threshold's scores, in which the budget component of a gradient is removed
    (:func:`projected_gradients`): 1 for merge thresholds (cosine similarities); the mean importance of a token,
    ``1/n`` for mean column attention (eq. 17) and ``heads/n`` for class attention (eq. 16), for prune thresholds.
    """
    top = score_ranges(model)["prune_threshold"][1]
    n = vit_spec(model).num_patches
    return torch.tensor([1.0] * len(merge) + [top / n] * len(prune), dtype=torch.float64)


def projected_gradients(
    model: nn.Module,
    task: torch.Tensor,
    merge: list[nn.Parameter],
    prune: list[nn.Parameter],
    ddp: Dist,
    scale: float = 1.0,
) -> torch.Tensor:
    """Set each threshold's ``.grad`` to the task loss's gradient with its budget component removed, and return the
    global batch's mean r_FLOPs (eq. 13) of the last forward.

    The step then moves the thresholds along the budget's level set (r_FLOPs unchanged to first order), so the
    task loss alone decides where the reduction goes; :func:`meet_budget` restores the budget. At a fixed point the
    task loss's gradient is parallel to r_FLOPs' (the Lagrange condition of eq. 14 as a constraint): removing one
    more FLOP costs the same loss in every block. The projection is taken in :func:`threshold_units`. Under
    torchrun both gradients are averaged over the ranks here (``scale``: a loss scale for fp16 gradients).
    """
    params = merge + prune
    r = r_flops(model).mean()  # this rank's images
    g_task = torch.autograd.grad(task * scale, params, retain_graph=True, allow_unused=True)
    g_r = torch.autograd.grad(r, params, allow_unused=True)
    flat = torch.stack(
        [
            torch.zeros((), dtype=torch.float64) if g is None else g.detach().double().cpu() / s
            for g, s in zip(g_task + g_r, [scale] * len(params) + [1.0] * len(params))
        ]
    )  # (2P,)
    flat = torch.cat([flat, r.detach().double().cpu().reshape(1)])  # (2P + 1,)
    if ddp.world > 1:
        dist.all_reduce(flat)
        flat /= ddp.world
    units = threshold_units(model, merge, prune)  # (P,)
    g, n = flat[: len(params)] * units, flat[len(params) : -1] * units  # (P,) each, gradients in those units
    norm = float(n @ n)
    tangent = g - (float(g @ n) / norm) * n if norm > 0 else g  # (P,)
    for p, t in zip(params, (tangent / units).tolist()):  # back to each threshold's own units
        p.grad = torch.full_like(p, t)
    return flat[-1].to(device=task.device, dtype=torch.float32)


@torch.no_grad()
def meet_budget(
    model: nn.Module, imgs: torch.Tensor, cfg: TrainConfig, device: torch.device, ddp: Dist, step: float
) -> dict:
    """Shift the merge thresholds (the prune thresholds for ``ltp``) by one amount until eval-mode r_FLOPs of
    this batch (the global batch under torchrun) meet r_target within ``BUDGET_TOLERANCE``, as
    :func:`ltmp.calibrate.settle` does once after training (:func:`ltmp.calibrate.shift_to_budget`; ``step``:
    the size of the last shift, where the search starts). Returns the shift, the r_FLOPs reached and the number
    of eval forwards."""
    merge = [p for n, p in model.named_parameters() if n.endswith("merge_threshold")]
    params = merge or [p for n, p in model.named_parameters() if n.endswith("prune_threshold")]
    low, top = score_ranges(model)["merge_threshold" if merge else "prune_threshold"]
    base = [p.detach().clone() for p in params]

    def apply(shift: float) -> None:
        for p, b in zip(params, base):
            p.copy_((b + shift).clamp(low, top))

    def r_now() -> float:
        model.eval()
        with amp_context(cfg.amp, device):
            model(imgs)
        total = torch.stack([r_flops(model).sum().double().cpu(), torch.tensor(float(len(imgs)), dtype=torch.float64)])
        if ddp.world > 1:
            dist.all_reduce(total)
        threshold_training_mode(model)
        return float(total[0] / total[1])

    shift, r, evals = shift_to_budget(
        apply,
        r_now,
        bool(merge),
        cfg.r_target,
        BUDGET_TOLERANCE,
        step,
        top - low,
        BUDGET_EVALS if step else 3 * BUDGET_EVALS,
    )  # the first search starts blind
    return {"shift": shift, "r_flops": r, "evals": evals}


@torch.no_grad()
def check_first_step(model: nn.Module, cfg: TrainConfig, steps: int, given: dict, scale: float) -> None:
    """SGD: refuse a learning rate whose first step would move a threshold by more than the whole range of its
    scores (``score_ranges``): every score would then fall on one side, the surrogate gradient (eq. 2) vanish, and
    the run would train nothing. Its gradients are those of the first batch (``scale``: the AMP loss scale)."""
    names = [n for n, p in model.named_parameters() if n.endswith(THRESHOLD_NAMES) and p.grad is not None]
    if not names:
        return
    params = dict(model.named_parameters())
    grads = torch.stack([params[n].grad.detach().abs().float().reshape(()) for n in names]).tolist()
    ranges = score_ranges(model)
    for name, grad in zip(names, grads):
        kind = "merge_threshold" if name.endswith("merge_threshold") else "prune_threshold"
        lr, flag, (low, high) = getattr(cfg, "lr_" + kind[:5]), "--lr-" + kind[:5], ranges[kind]
        move = lr * grad / scale
        if move > high - low:
            if given["lr_" + kind[:5]] is not None:
                why = f"give a smaller {flag} than {lr:.3g}"
            else:
                need = math.ceil(steps * move / (high - low))  # the rate falls as 1 / steps
                why = (
                    f"--steps {steps} scales the paper's learning rate by {PAPER_STEPS}/{steps} to {lr:.3g}; give "
                    f"--steps {need} or more, or a smaller {flag}"
                )
            raise TrainError(
                f"the first step would move {name} by {move:.3g}, more than its scores' whole range "
                f"[{low:g}, {high:g}], and training would learn nothing: {why}"
            )


@torch.no_grad()
def project_thresholds(
    model: nn.Module, merge: list[nn.Parameter], prune: list[nn.Parameter], clamp: str = "scores"
) -> None:
    """Keep each threshold inside the range of the scores it compares (``clamp="scores"``): merge thresholds in
    [-1, 1] (cosine similarities), prune thresholds in [0, 1] (mean column attention, eq. 17) or [0, heads] (class
    attention summed over heads, eq. 16); or every threshold in [0, 1] (``"unit"``, as the reference code clamps).
    Outside, every score falls on one side and the sigmoid surrogate (eq. 2) passes almost no gradient, so one
    large step (an attention sink's gradient, eq. 6) would switch a block's merging or pruning off or on for
    good."""
    ranges = score_ranges(model) if clamp == "scores" else dict.fromkeys(THRESHOLD_NAMES, (0.0, 1.0))
    for kind, params in (("merge_threshold", merge), ("prune_threshold", prune)):
        for p in params:
            p.clamp_(*ranges[kind])


#: Training stops when a block has removed every patch token of every image for this many steps in a row (fewer
#: let a threshold that still gets a surrogate gradient walk back), unless ``stop_collapsed`` is off: the reference
#: code trains on, and at 10x its scaled learning rate its blocks come back after tens of steps
#: (``benchmarks/reference_seeds.py``).
COLLAPSE_STEPS = 10


def _collapse_check(model: nn.Module, ddp: Dist, runs: list[int] | None) -> list[int]:
    """For each block, for how many steps in a row it has left no patch token in any image of the global batch
    (a model that keeps one patch token by design, ``keep_one``, counts as empty with one). There the thresholds'
    surrogate gradients (eq. 2) all but vanish, so training may not bring the tokens back. The last block of a
    model whose head reads only its prefix tokens (``keep_one`` False) may remove every patch token: nothing
    after it reads them, so that costs no accuracy."""
    rec = stats(model)
    keep_one = keeps_one(model)
    alive = (rec.kept.amax(0) > int(keep_one)).to(torch.int32)  # (L,) on this rank
    if not keep_one:
        alive[-1] = 1
    if ddp.world > 1:
        dist.all_reduce(alive, op=dist.ReduceOp.MAX)
    runs = runs or [0] * len(alive)
    return [0 if a else n + 1 for a, n in zip(alive.tolist(), runs)]


def _collapse_message(model: nn.Module, cfg: TrainConfig, block: int, step: int) -> str:
    blk = blocks(model)[block]
    th = ", ".join(
        f"{name.split('_')[0]} threshold {float(getattr(blk, name)):.4g}"
        for name in THRESHOLD_NAMES
        if hasattr(blk, name)
    )
    return (
        f"training stopped at step {step}: block {block + 1} removed every patch token of every image for "
        f"{COLLAPSE_STEPS} steps in a row ({th}), where the thresholds' gradients all but vanish; lower --lr-prune "
        f"({cfg.lr_prune:g}) or --lr-merge ({cfg.lr_merge:g}) and start again, or pass --no-stop-collapsed to "
        f"train on"
    )


def _log_step(line: str) -> float:
    """The step of a log line; a line cut short by a crash counts as past any checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):
        return float("inf")
