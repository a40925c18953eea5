"""Learned thresholds are the whole learned state of LTMP: save and load them alone, in safetensors.

A threshold file holds one (L,) tensor per kind (``merge_threshold``, ``prune_threshold``; entry i belongs to block i)
and metadata: method, tau, importance, depth, embed dim, prefix tokens, patch grid, image size and (for
information only) the model name. It is a few hundred bytes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from .adapters import adapter_for
from .config import LEARNED

try:
    import fcntl  # run folders are locked where the system has POSIX locks
except ImportError:  # pragma: no cover (Windows)
    fcntl = None
from .data import remove_stale
from .errors import LtmpError
from .patching import THRESHOLD_NAMES, blocks, patch

FORMAT = "ltmp-thresholds"
VERSION = "1"


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def model_name(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}  # timm
    name = cfg.get("architecture") or getattr(getattr(model, "config", None), "name_or_path", "")  # transformers
    return str(name or getattr(type(model), "_ltmp_base", type(model)).__name__)


def describe(model: nn.Module) -> dict[str, str]:
    """The metadata that says which models a threshold file fits."""
    model = _unwrap(model)
    adapter = adapter_for(model)
    grid, _, img = adapter.patch_grid(model)
    return {
        "family": adapter.family,
        "depth": str(len(adapter.blocks(model))),
        "embed_dim": str(adapter.embed_dim(model)),
        "num_prefix_tokens": str(adapter.num_prefix(model)),
        "patch_grid": "x".join(str(g) for g in grid),
        "img_size": "x".join(str(s) for s in img),
        "model": model_name(model),
    }


def _umask() -> int:
    """The process umask (only readable by setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write) -> None:
    """Write a file atomically: ``write(tmp_path)`` then rename over ``path``; a crash leaves no partial file.
    The file gets the mode a plain ``open()`` would give it (0o666 less the umask, typically 0o644), not
    ``mkstemp``'s private 0o600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent, f".{path.name}.*.tmp*")  # what a write of this file killed before it finished left
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{os.getpid()}.tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, Exception) and not isinstance(e, OSError) and shutil.disk_usage(path.parent).free < 1 << 20:
            # a writer that wraps the system's error (safetensors, torch.save): say what it was
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from None
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    """``obj`` as indented JSON in ``path``, written atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2)))


def threshold_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The learned thresholds of a patched model, one (L,) fp32 tensor per kind: ``merge_threshold`` and/or
    ``prune_threshold``, in block order."""
    model = _unwrap(model)
    out = {}
    for kind in THRESHOLD_NAMES:
        values = [getattr(b, kind) for b in blocks(model) if kind in b._parameters]
        if values:
            out[kind] = torch.stack([v.detach().float().cpu().reshape(()) for v in values])  # (L,)
    return out


def set_thresholds(model: nn.Module, tensors: dict[str, torch.Tensor], source: str = "") -> None:
    """Copy (L,) threshold tensors (as from :func:`threshold_tensors`) into a patched model's parameters."""
    model = _unwrap(model)
    expected = {k: v.shape for k, v in threshold_tensors(model).items()}
    got = {k: v.shape for k, v in tensors.items()}
    if got != expected:
        raise LtmpError(
            f"thresholds{' in ' + source if source else ''} do not fit this model's patch "
            f"(file holds {got}, the model needs {expected})"
        )
    dtype = getattr(blocks(model)[0], next(iter(tensors))).dtype  # the thresholds' own
    _require_finite(
        {k: v.to(dtype) for k, v in tensors.items()},
        f"the model's {str(dtype).replace('torch.', '')} thresholds cannot hold it"
        f"{' (in ' + source + ')' if source else ''}; train or calibrate the thresholds again",
    )
    with torch.no_grad():
        for kind, values in tensors.items():
            for blk, v in zip(blocks(model), values):
                getattr(blk, kind).copy_(v)


def save_thresholds(model: nn.Module, path: str | os.PathLike, extra: dict[str, str] | None = None) -> None:
    """Save a patched model's thresholds and their metadata to a safetensors file, atomically."""
    from safetensors.torch import save_file

    model = _unwrap(model)
    cfg = getattr(model, "ltmp_config", None)
    if cfg is None or not cfg.learned:
        raise LtmpError(f"save_thresholds needs a model patched with a learned-threshold method ({', '.join(LEARNED)})")
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "method": cfg.method,
        "tau": repr(cfg.tau),
        "importance": cfg.importance,
        **describe(model),
        **(extra or {}),
    }
    tensors = {k: v.contiguous() for k, v in threshold_tensors(model).items()}
    _require_finite(
        tensors,
        f"nothing was written to {path}; a diverged training run (lower --lr-merge or "
        f"--lr-prune) or a value set by hand",
    )
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def _require_finite(tensors: dict[str, torch.Tensor], why: str) -> None:
    """Refuse NaN or infinite thresholds: they reduce every token or none (0% top-1), silently."""
    for kind, values in tensors.items():
        bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
        if bad:
            raise LtmpError(f"{kind} of block {bad[0] + 1} is {values[bad[0]].item()} (not finite); {why}")


def read_thresholds(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a threshold file: its tensors and metadata. Raises ValueError with the fix on a bad file."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise LtmpError(
            f"thresholds file {path} is a folder; pass the thresholds.safetensors file in it, written by 'ltmp train'"
        )
    if not path.is_file():
        raise LtmpError(
            f"thresholds file {path} does not exist; pass the thresholds.safetensors written by 'ltmp train'"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for corrupt files
        raise LtmpError(
            f"cannot read thresholds file {path} ({type(e).__name__}: {e}); pass a "
            f"thresholds.safetensors written by 'ltmp train'"
        ) from None
    if meta.get("format") != FORMAT:
        raise LtmpError(
            f"{path} is not an ltmp thresholds file (no '{FORMAT}' metadata); pass a "
            f"thresholds.safetensors written by 'ltmp train'"
        )
    try:
        tau = float(meta.get("tau", ""))
    except ValueError:
        tau = math.nan
    fits = {
        "method": meta.get("method") in LEARNED,
        "tau": 0 < tau < math.inf,
        "importance": meta.get("importance") in ("mean", "cls"),
        "tensors": bool(tensors) and set(tensors) <= set(THRESHOLD_NAMES),
    }
    bad = next((key for key, ok in fits.items() if not ok), None)
    if bad:
        raise LtmpError(
            f"{path} is damaged: its {bad} ({meta.get(bad, sorted(tensors))!r}) is not what 'ltmp "
            f"train' writes; train or calibrate the thresholds again"
        )
    _require_finite(tensors, f"{path} is damaged; train or calibrate the thresholds again")
    return tensors, meta


def load_thresholds(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Patch ``model`` with the method recorded in a threshold file and set its thresholds.

    Raises:
        ValueError: the file is unreadable, or was made for a model of another depth, width or prefix count.

    Warns when the patch grid (image size) differs: importance scores scale with the token count.
    """
    tensors, meta = read_thresholds(path)
    target = _unwrap(model)
    have = describe(target)
    for key in ("depth", "embed_dim", "num_prefix_tokens"):
        if meta.get(key) != have[key]:
            raise LtmpError(
                f"thresholds in {path} were made for another model ({meta.get('model')}: depth {meta.get('depth')}, "
                f"embed dim {meta.get('embed_dim')}, {meta.get('num_prefix_tokens')} prefix tokens); this model "
                f"({have['model']}) has depth {have['depth']}, embed dim {have['embed_dim']}, "
                f"{have['num_prefix_tokens']} prefix tokens; use thresholds trained for this model"
            )
    if meta.get("patch_grid") != have["patch_grid"]:
        warnings.warn(
            f"thresholds in {path} were trained on a {meta.get('patch_grid')} patch grid "
            f"({meta.get('img_size')} px) and this model uses {have['patch_grid']} ({have['img_size']} px); "
            f"importance scores scale with the token count, so the reduction will differ",
            stacklevel=2,
        )
    trace = getattr(getattr(target, "ltmp_config", None), "trace_source", False)
    patch(target, meta["method"], tau=float(meta["tau"]), importance=meta["importance"], trace_source=trace)
    set_thresholds(target, tensors, str(path))
    return model


#: The file that marks a run folder as made by an ltmp command (``ltmp train``, ``ltmp pretrain``); it holds the
#: command's name and is locked while a run of it lives.
RUN_MARKER = ".ltmp-run"
#: The config.json keys by which a run folder of an ltmp that wrote no marker is recognised, per command.
LEGACY_RUN_KEYS = {
    "train": {"total_steps", "r_target", "train_images"},
    "pretrain": {"steps_per_epoch", "architecture"},
}


def check_run_owner(out: Path, command: str) -> None:
    """Refuse, before any work, a run folder ``out`` that the command did not make: it must be new, empty, or marked
    by ``command`` (:data:`RUN_MARKER`)."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    marker, config = out / RUN_MARKER, out / "config.json"
    made_by = marker.read_text().strip() if marker.is_file() else None
    if made_by is None and config.is_file():  # a run folder of an ltmp that wrote no marker yet
        try:
            keys = set(json.loads(config.read_text()))
        except (ValueError, OSError):
            keys = set()
        made_by = next((c for c, needed in LEGACY_RUN_KEYS.items() if needed <= keys), None)
    if made_by is None:
        names = sorted(p.name for p in out.iterdir())
        raise LtmpError(
            f"--output {out} holds files ltmp {command} did not make ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}); pass a new or empty folder"
        )
    if made_by != command:
        raise LtmpError(f"--output {out} is a run folder of ltmp {made_by}; pass another --output")


@contextlib.contextmanager
def run_folder(out: Path, command: str):
    """Hold the run folder ``out`` while a run of ``command`` lives in it: made if new, marked as the command's
    (:data:`RUN_MARKER`) and locked, so that a second run on it is refused in one line (the lock goes with this
    process, however it ends)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RUN_MARKER, "a+") as marker:
        try:
            if fcntl is not None:
                fcntl.flock(marker, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LtmpError(
                f"--output {out} is in use by another ltmp {command} run; wait for it to end, or pass another --output"
            ) from None
        marker.seek(0)
        marker.truncate()
        marker.write(command + "\n")
        marker.flush()
        yield
