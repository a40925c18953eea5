"""What the benchmark scripts share: where the shared model and data are, how a script runs ``ltmp``, the models and
images of the speed studies, and the one training-free calibration recipe they use.

- ``MODEL``, ``DATA``: the CIFAR-10 ViT and CIFAR-10 copy of ``../shared`` (beside the repository).
- :func:`run`: one ``ltmp`` command in this process, printed first; a failure exits with its code.
- :func:`train_run`: one ``ltmp train`` in a subprocess that resumes an interrupted run and keeps why a run stopped.
- :func:`load_model`, :func:`load_images`, :func:`mean_gmacs`, :func:`at_gmacs`: the speed studies' models
  (``cifar``, or ``deit-s`` / ``vit-b`` with random weights), bundled images, a patched model's mean GMACs, and
  fixed-rate baselines at a given GMACs; :func:`reference_tome`, the reference ToMe's own timm patch (a
  checkout of facebookresearch/ToMe, not part of ltmp).
- :func:`compact`, :func:`unpack`: what the documents use of an ``ltmp eval --json`` result, small enough to commit
  under results/ (the per-image correctness packed into hex), and back.
- :func:`calibrated`: LTMP thresholds without training, ``calibrate(mode="quantile")`` on 64 bundled training
  images (per-layer quantiles that merge a fraction f of set A and prune f/2 of the rest, f bisected to hit
  r_target).
"""

from __future__ import annotations

import copy
import platform
import subprocess
import sys
from pathlib import Path

import timm
import torch

import ltmp
from ltmp import data as ldata
from ltmp.bench import allocator
from ltmp.calibrate import calibrate
from ltmp.cli import main as ltmp_main
from ltmp.demo import BUNDLED_DATA, BUNDLED_MODEL
from ltmp.flops import rate_schedule

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SHARED_MODEL = SHARED / "models" / "vit-cifar10"
MODEL = f"local-dir:{SHARED_MODEL}"
DATA = str(SHARED / "data/cifar10/cifar10-jpeg.tar.gz")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture, threads and heap allocator (which change CPU timings)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU ({torch.get_num_threads()} threads, {allocator()})"


def run(args: list[str]) -> None:
    print("$ ltmp " + " ".join(args), flush=True)
    code = ltmp_main(["--quiet"] + args)
    if code:
        raise SystemExit(code)


def train_run(folder: Path, flags: list[str], done: str = "thresholds.safetensors") -> str | None:
    """``ltmp train FLAGS --output FOLDER`` in a subprocess, unless the folder holds ``done`` (a finished run) or
    ``stopped.txt``; with ``--resume`` where an interrupted run left its checkpoint. Returns why training stopped
    (its one-line error, kept in ``stopped.txt``: e.g. a refused start or a block that removed every patch token), or
    None. The folder is made for ``stopped.txt`` when the run refused to start. A folder another process is training
    stops the script (two scripts on the same runs)."""
    stopped = folder / "stopped.txt"
    if not (folder / done).exists() and not stopped.exists():
        cmd = ["train", *flags, "--output", str(folder)]
        if (folder / "checkpoint.safetensors").exists():
            cmd.append("--resume")
        print("$ ltmp " + " ".join(cmd), flush=True)
        res = subprocess.run([sys.executable, "-m", "ltmp", "--quiet", *cmd], capture_output=True, text=True)
        sys.stdout.write(res.stdout + res.stderr)
        if res.returncode and not (folder / done).exists():  # (finished meanwhile by another process: not stopped)
            why = (res.stderr.strip().splitlines() or [f"ltmp train exited with {res.returncode}"])[-1]
            why = why.removeprefix("ltmp: error: ")
            if "in use by another" in why:  # another process trains this run: not this run's outcome, keep nothing
                raise SystemExit(why)
            folder.mkdir(parents=True, exist_ok=True)
            stopped.write_text(why + "\n")
    return stopped.read_text().strip() if stopped.exists() else None


def load_model(name: str) -> torch.nn.Module:
    if name in ("deit-s", "vit-b"):
        torch.manual_seed(0)
        arch = {"deit-s": "deit_small_patch16_224", "vit-b": "vit_base_patch16_224"}[name]
        return timm.create_model(arch, pretrained=False).eval()
    return timm.create_model(cifar_model_name(), pretrained=True).eval()


def cifar_model_name() -> str:
    return MODEL if SHARED_MODEL.is_dir() else BUNDLED_MODEL


def load_images(model: torch.nn.Module, split: str, n: int) -> torch.Tensor:
    root = ldata.resolve_root(BUNDLED_DATA)
    _, tf, _ = ldata.transforms_for(model, "none")
    ds = ldata.ImageFolder(ldata.split_dir(root, split), tf)
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(ds), generator=g)[:n].tolist()
    return torch.stack([ds[i][0] for i in idx])


@torch.no_grad()
def mean_gmacs(model: torch.nn.Module, x: torch.Tensor) -> float:
    """A patched model's GMACs per image on ``x``, averaged over the images (one forward)."""
    model(x)
    return float(ltmp.gmacs(ltmp.vit_spec(model), ltmp.stats(model).kept.cpu()).mean())


def at_gmacs(dense: torch.nn.Module, method: str, gmacs: float) -> torch.nn.Module:
    """A fixed-rate method (``tome``, ``topk-prune``, ...) patched onto a copy of ``dense`` with the per-layer
    schedule whose GMACs come closest to ``gmacs`` (``rate_schedule``), in eval mode."""
    sched = rate_schedule(ltmp.vit_spec(dense), gmacs, method)
    return ltmp.patch(copy.deepcopy(dense), method, **{"r" if method == "tome" else "k": sched}).eval()


def calibrated(
    dense: torch.nn.Module,
    target: float,
    device: torch.device | str = "cpu",
    method: str = "ltmp",
    images: torch.Tensor | None = None,
) -> tuple[torch.nn.Module, float]:
    """A copy of ``dense`` patched with ``method`` and thresholds calibrated to ``target`` (the recipe above), in
    eval mode on ``device``; and the r_FLOPs reached on the calibration images."""
    model = ltmp.patch(copy.deepcopy(dense), method).to(device)
    x = load_images(dense, "train", 64) if images is None else images
    r = calibrate(model, x, target, device, mode="quantile", iters=12)
    return model.eval(), r


def deployed_models(name: str, n: int) -> tuple[torch.nn.Module, torch.Tensor, torch.nn.Module, torch.nn.Module]:
    """The models of benchmarks/deployed.py: ``name``'s dense model, its first ``n`` test images, LTMP calibrated to
    r_FLOPs 0.5 and ToMe at LTMP's mean GMACs on those images."""
    dense = load_model(name)
    images = load_images(dense, "test", n)
    mine, _ = calibrated(dense, 0.5)
    return dense, images, mine, at_gmacs(dense, "tome", mean_gmacs(mine, images))


def compact(result: dict) -> dict:
    """What the document uses of one ``ltmp eval --json`` result, with the per-image correctness ('0'/'1' per
    test image) packed into hex."""
    keep = {k: result[k] for k in ("method", "top1", "r_flops", "gmacs", "gmacs_dense", "images")}
    keep["per_layer"] = [{k: round(x[k], 4) for k in ("merged", "pruned")} for x in result["per_layer"]]
    keep["correct"] = pack(result["correct"])
    if "allocation" in result:  # learned thresholds: where they reduce (ltmp.analysis.allocation)
        keep["allocation"] = result["allocation"]
    return keep


def pack(bits: str) -> str:
    """Per-image correctness ('0'/'1' per image) as its length and hex (a leading 1 keeps the leading zeros)."""
    return f"{len(bits)}:{int('1' + bits, 2):x}"


def p_text(p: float) -> str:
    """A p-value for a table: two significant digits, or "< 1e-16" where the normal tail underflows (a
    difference of dozens of standard errors gives exactly 0)."""
    return f"{p:.2g}" if p >= 1e-16 else "< 1e-16"


def unpack(packed: str) -> str:
    """The '0'/'1' string that :func:`compact` packed."""
    n, value = packed.split(":")
    bits = bin(int(value, 16))[3:]
    assert len(bits) == int(n), "corrupt correctness record"
    return bits


def reference_tome(dense: torch.nn.Module, path: str, rate: tuple[int, ...]) -> torch.nn.Module:
    """The reference ToMe (facebookresearch/ToMe, ``tome.patch.timm``) on a copy of ``dense`` with per-layer r."""
    sys.path.insert(0, path)
    import tome  # noqa: PLC0415 (optional, outside the project)

    model = copy.deepcopy(dense)
    tome.patch.timm(model)
    model.r = list(rate)
    return model.eval()
