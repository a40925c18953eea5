"""Pretrain a small timm ViT on CIFAR-10 from scratch: the recipe of ``../shared/models/vit-cifar10``.

Architecture: timm ``vit_tiny_patch16_224`` with img 32, patch 4 (64 patches + class token), embed 128, depth 12,
4 heads, MLP ratio 4 (2.40 M parameters). Recipe: 9 epochs, AdamW lr 1e-3 with a half-epoch linear warm-up and
cosine decay, weight decay 0.05, batch 128, random crop (4 px reflect padding) + horizontal flip, label smoothing
0.1, grad-norm clip 1.0, seed 0. Test accuracy is measured after every epoch.

Resumable: a checkpoint (model, optimizer, step) is written atomically every ``checkpoint_every`` steps and at
every epoch end; the data order and augmentation are functions of (seed, epoch, index), so a resumed run sees the
same batches as an uninterrupted one. The result is saved in timm's local-dir format (``config.json`` +
``model.safetensors``), loadable with ``timm.create_model("local-dir:FOLDER", pretrained=True)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from . import data as ldata
from .evaluate import evaluate
from .runtime import amp_context, pick_device
from .thresholds import atomic_write, check_run_owner, run_folder, write_json
from .train import EpochIndexed, StepBatches, TrainError

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
ARCH = "vit_tiny_patch16_224"
MODEL_ARGS = dict(
    img_size=[32, 32],
    patch_size=4,
    embed_dim=128,
    depth=12,
    num_heads=4,
    num_classes=10,
    in_chans=3,
    global_pool="token",
)


@dataclasses.dataclass
class PretrainConfig:
    """The pretraining recipe (defaults reproduce ../shared/models/vit-cifar10)."""

    data_dir: str  # CIFAR-10 ImageFolder root or the .tar.gz
    output: str  # run folder: checkpoint, log.jsonl, and the final model folder
    epochs: int = 9  # length of the cosine schedule
    stop_after_epoch: int | None = None  # end this invocation early (the schedule still spans `epochs`)
    lr: float = 1e-3  # AdamW peak learning rate
    warmup_epochs: float = 0.5  # linear warm-up
    weight_decay: float = 0.05
    batch_size: int = 128
    label_smoothing: float = 0.1
    clip_grad: float = 1.0
    seed: int = 0
    val_split: str = "test"
    checkpoint_every: int = 100
    workers: int = 2
    amp: str = ""  # mixed precision mode, as in ltmp train
    device: str = "auto"


def cifar_vit() -> torch.nn.Module:
    import timm

    return timm.create_model(ARCH, **MODEL_ARGS)


def model_config() -> dict:
    """timm local-dir ``config.json`` for the CIFAR-10 ViT (the format of ../shared/models/vit-cifar10)."""
    return {
        "architecture": ARCH,
        "num_classes": 10,
        "num_features": MODEL_ARGS["embed_dim"],
        "global_pool": "token",
        "model_args": MODEL_ARGS,
        "pretrained_cfg": {
            "tag": "cifar10",
            "custom_load": False,
            "input_size": [3, 32, 32],
            "fixed_input_size": True,
            "interpolation": "bilinear",
            "crop_pct": 1.0,
            "crop_mode": "center",
            "mean": list(CIFAR10_MEAN),
            "std": list(CIFAR10_STD),
            "num_classes": 10,
            "pool_size": None,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "label_names": list(CIFAR10_CLASSES),
        },
    }


def save_model_folder(model: torch.nn.Module, folder: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write ``config.json`` + ``model.safetensors`` (optionally fp16), each atomically."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(folder / "model.safetensors", lambda tmp: save_file(tensors, tmp))
    write_json(folder / "config.json", model_config())


def lr_at(step: int, steps_per_epoch: int, cfg: PretrainConfig) -> float:
    warm = max(1, int(cfg.warmup_epochs * steps_per_epoch))
    total = cfg.epochs * steps_per_epoch
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return 0.5 * cfg.lr * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def pretrain(cfg: PretrainConfig, progress: bool = True) -> dict:
    """Run (or resume) the pretraining; returns the last epoch's test accuracy and the model folder. ``cfg.output``
    must be new, empty, or this command's (``ltmp.thresholds.RUN_MARKER``); it is locked while the run lives."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--output {out} is a file; pass a run folder (new, or this command's to continue)")
    check_run_owner(out, "pretrain")
    with run_folder(out, "pretrain"):  # a second run on it is refused
        return _pretrain(cfg, out, progress)


def _pretrain(cfg: PretrainConfig, out: Path, progress: bool) -> dict:
    from torchvision import transforms as T

    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = cifar_vit().to(device)
    root = ldata.resolve_root(cfg.data_dir)
    norm = T.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    train_tf = T.Compose(
        [T.RandomCrop(32, padding=4, padding_mode="reflect"), T.RandomHorizontalFlip(), T.ToTensor(), norm]
    )
    test_tf = T.Compose([T.Resize(32), T.ToTensor(), norm])
    train_set = ldata.ImageFolder(root / "train", train_tf)
    test_set = ldata.ImageFolder(ldata.split_dir(root, cfg.val_split), test_tf, train_set.classes)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n and "token" not in n]
    no_decay = [
        p for n, p in model.named_parameters() if not (p.ndim > 1 and "pos_embed" not in n and "token" not in n)
    ]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr
    )
    spe = len(train_set) // cfg.batch_size
    total = cfg.epochs * spe
    stop = total if cfg.stop_after_epoch is None else min(total, cfg.stop_after_epoch * spe)
    ckpt = out / "checkpoint.pt"
    start = 0
    if ckpt.exists():
        try:
            state = torch.load(ckpt, map_location=device, weights_only=True)
        except Exception as e:
            raise TrainError(f"cannot read {ckpt} ({type(e).__name__}); delete it to start over") from None
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    log_path = out / "log.jsonl"
    try:
        kept = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
    except FileNotFoundError:
        kept = []
    except (ValueError, KeyError, TypeError):
        raise TrainError(
            f"{log_path} is not the log ltmp pretrain writes (a line is not its JSON); move it away to continue"
        ) from None
    atomic_write(log_path, lambda tmp: Path(tmp).write_text("".join(ln + "\n" for ln in kept)))
    write_json(
        out / "config.json",
        {**dataclasses.asdict(cfg), "architecture": ARCH, "model_args": MODEL_ARGS, "steps_per_epoch": spe},
    )

    def save(step: int) -> None:
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
        atomic_write(ckpt, lambda tmp: torch.save(state, tmp))

    sampler = StepBatches(len(train_set), cfg.batch_size, stop, cfg.seed, start=start)
    loader = DataLoader(
        EpochIndexed(train_set, list(range(len(train_set))), cfg.seed),
        batch_sampler=sampler,
        num_workers=cfg.workers,
        collate_fn=ldata.collate_skip,
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=stop, initial=start, desc="pretrain", unit="step", dynamic_ncols=True)
    model.train()
    t0 = time.perf_counter()
    result: dict = {}
    with open(log_path, "a") as log:
        for step, (imgs, labels, _, _) in enumerate(loader, start=start):
            if imgs is None:
                continue
            for g in opt.param_groups:
                g["lr"] = lr_at(step, spe, cfg)
            imgs, labels = imgs.to(device), labels.to(device)
            with amp_context(cfg.amp, device):
                logits = model(imgs)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=cfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            opt.step()
            done = step + 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", epoch=f"{done / spe:.2f}")
            if done % spe == 0:
                test = DataLoader(test_set, batch_size=256, num_workers=cfg.workers, collate_fn=ldata.collate_skip)
                ev = evaluate(model, test, device, amp=cfg.amp, progress=False, model_name=ARCH)
                model.train()
                result = {
                    "step": done,
                    "epoch": done // spe,
                    "test_acc": ev["top1"] / 100,
                    "sec": round(time.perf_counter() - t0),
                }
                log.write(json.dumps(result) + "\n")
                log.flush()
                save(done)
            elif done % cfg.checkpoint_every == 0:
                save(done)
    if bar is not None:
        bar.close()
    if stop == total:
        save_model_folder(model, out / "model")
        result["model"] = str(out / "model")
    return result
