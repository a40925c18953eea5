"""Data: ImageFolder splits (or the CIFAR-10 tarball) with the model's own timm data config and transforms.

- Preprocessing comes from the model (timm ``resolve_data_config`` + ``create_transform``).
- A ``.tar.gz`` archive in ImageFolder layout (e.g. ``../shared/data/cifar10/cifar10-jpeg.tar.gz``) is unpacked
  once into a cache folder (``$LTMP_CACHE`` or ``~/.cache/ltmp``) and then read like a folder.
- Unreadable images are skipped and counted (:func:`collate_skip`), never silently replaced by another sample.
- Augmentation randomness is a pure function of (seed, epoch, index): runs resume and shard across processes
  with exactly the same transformed images.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from .errors import LtmpError, first_line
from .options import AUGMENTS

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class DataError(LtmpError):
    """Bad data input; the message names the fix."""


def cache_dir() -> Path:
    """Where archives are unpacked: ``$LTMP_CACHE``, else ``~/.cache/ltmp``."""
    return Path(os.environ.get("LTMP_CACHE", Path.home() / ".cache" / "ltmp"))


def alive(pid: int) -> bool:
    """A process with this id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def remove_stale(folder: Path, pattern: str) -> None:
    """Remove what an interrupted write or unpack left in ``folder``: the files and folders matching ``pattern``
    whose name carries the id of a process that no longer runs (``NAME.tmp<pid>``, ``.NAME.<pid>.tmp...``)."""
    for p in folder.glob(pattern):
        found = re.search(r"\.tmp(\d+)$|\.(\d+)\.tmp", p.name)
        if found and not alive(int(found.group(1) or found.group(2))):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def unpack_archive(archive: Path) -> Path:
    """Unpack an ImageFolder ``.tar.gz`` once into the cache; returns the folder holding its splits."""
    st = archive.stat()
    key = hashlib.sha1(f"{archive.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cache_dir() / f"{archive.name.split('.')[0]}-{key}"
    done = dest / ".unpacked"
    if not done.exists():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(tmp.parent, f"{dest.name}.tmp*")  # what an unpack killed before it finished left
            tmp.mkdir(exist_ok=True)
        except OSError as e:
            raise DataError(
                f"cannot unpack {archive} into the cache folder {tmp.parent} ({e.strerror}); set LTMP_CACHE to a "
                f"folder you can write, or pass an unpacked --data-dir"
            ) from None
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            shutil.rmtree(tmp, ignore_errors=True)  # no half-unpacked folder is left in the cache
            raise DataError(
                f"cannot unpack {archive} ({first_line(e)}); pass an ImageFolder directory or a valid .tar.gz"
            ) from None
        except BaseException:  # interrupted: clean up, then stop
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if dest.exists():  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, dest)
        done.touch()
    # the archive may hold the splits at its top level or inside one folder
    subdirs = [p for p in dest.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and not any((dest / s).is_dir() for s in ("train", "val", "test")):
        return subdirs[0]
    return dest


def resolve_root(data_dir: str | os.PathLike) -> Path:
    """The folder holding the splits, from a directory or an archive. Raises DataError if missing."""
    path = Path(data_dir)
    if not path.exists():
        raise DataError(
            f"data dir {path} does not exist; pass --data-dir DIR with DIR/train/<class>/*.jpg "
            f"and DIR/val/<class>/*.jpg (or a .tar.gz of that layout)"
        )
    if path.is_file():
        if path.name.endswith((".tar.gz", ".tgz", ".tar")):
            return unpack_archive(path)
        raise DataError(f"data dir {path} is a file; pass a folder or a .tar.gz archive in ImageFolder layout")
    return path


def to_rgb(im: Image.Image) -> Image.Image:
    """An 8-bit RGB copy of an opened image. 16-bit greyscale (PNG and TIFF modes ``I;16*`` and ``I``) is scaled by
    255/65535, where ``convert("RGB")`` would clip it to white; floating-point images (mode ``F``, no known range)
    are refused with ValueError, so that they are skipped and counted like unreadable ones."""
    if im.mode == "F":
        raise ValueError("a floating-point image (mode F) has no known range; save it with 8 or 16 bits")
    if im.mode.startswith("I"):
        levels = np.asarray(im).astype(np.float64).clip(0, 65535)  # (H, W) 16-bit levels
        im = Image.fromarray(np.rint(levels / 257).astype(np.uint8))
    return im.convert("RGB")


#: what PIL raises on a file it cannot read as an image
UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """The 8-bit RGB image of a file (:func:`to_rgb`); raises one of ``UNREADABLE`` if it cannot be read."""
    with Image.open(path) as im:
        return to_rgb(im)


def readable(path: str | os.PathLike) -> bool:
    """Whether :func:`load_rgb` reads the file."""
    try:
        load_rgb(path)
    except UNREADABLE:
        return False
    return True


class ImageFolder(Dataset):
    """``root/<class>/<image>``. Labels are the class folders' places in ``classes`` (default: the sorted names
    of the class folders); ``labels`` maps folder names to labels instead (``label_map``), and a folder it does
    not name is left out. Hidden and empty folders are left out and counted (``ignored``). Unreadable images yield
    None (skipped)."""

    def __init__(
        self,
        root: Path,
        transform: Callable | None = None,
        classes: list[str] | None = None,
        hint: str = "choose the split with --val-split",
        labels: dict[str, int] | None = None,
    ):
        if not root.is_dir():
            raise DataError(f"split folder {root} does not exist; expected {root}/<class>/<image files> ({hint})")
        found, self.ignored = class_folders(root)
        self.classes = classes or found
        index = labels if labels is not None else {c: i for i, c in enumerate(self.classes)}
        self.labels = index  # folder name -> label
        self.samples: list[tuple[str, int]] = []
        for c in self.classes:
            folder = root / c
            if not folder.is_dir() or c not in index:
                continue
            for f in sorted(folder.iterdir()):
                if f.suffix.lower() in IMG_EXTENSIONS:
                    self.samples.append((str(f), index[c]))
        if not self.samples:
            raise DataError(
                f"no images found in {root}; expected {root}/<class>/<image files> "
                f"({', '.join(IMG_EXTENSIONS[:3])}, ...)"
            )
        self.root = root
        self.transform = transform
        self.seed = 0
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        try:
            img = load_rgb(path)
        except UNREADABLE:
            return None  # counted by collate_skip
        if self.transform is not None:
            # augmentation randomness depends only on (seed, epoch, index): resumable and shardable
            s = ((self.seed * 1_000_003 + self.epoch) * 10_000_019 + i) % 2**63  # torch seeds are < 2**64
            random.seed(s)
            torch.manual_seed(s)
            img = self.transform(img)
        return img, label, i


def collate_skip(batch):
    """Collate, dropping unreadable images; returns (images, labels, indices, number skipped)."""
    good = [b for b in batch if b is not None]
    skipped = len(batch) - len(good)
    if not good:
        return None, None, None, skipped
    imgs = torch.stack([b[0] for b in good])
    labels = torch.tensor([b[1] for b in good])
    idx = torch.tensor([b[2] for b in good])
    return imgs, labels, idx, skipped


def transforms_for(model: torch.nn.Module, augment: str):
    """Eval and train transforms from the model's timm data config.

    Args:
        augment: ``"timm"``: timm's default training augmentation (RandomResizedCrop scale 0.08-1, flip,
            colour jitter), as in the paper; ``"timm-random"``: the same with a random interpolation per crop (the
            reference code's train script); ``"light"``: random crop with 1/8 reflect padding and flip (the
            CIFAR pretraining recipe); ``"none"``: the eval transform.
    """
    import timm.data
    from torchvision import transforms as T

    cfg = timm.data.resolve_data_config(model=model)
    eval_tf = timm.data.create_transform(**cfg, is_training=False)
    if augment in AUGMENTS[:2]:
        train_tf = timm.data.create_transform(
            **{**cfg, **({"interpolation": "random"} if augment == "timm-random" else {})}, is_training=True
        )
    elif augment == "light":
        size = cfg["input_size"][1:]
        train_tf = T.Compose(
            [
                T.Resize(size, interpolation=T.InterpolationMode.BILINEAR),
                T.RandomCrop(size, padding=max(1, size[0] // 8), padding_mode="reflect"),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize(cfg["mean"], cfg["std"]),
            ]
        )
    elif augment == "none":
        train_tf = eval_tf
    else:
        raise DataError(f"unknown augmentation '{augment}'; choose one of: {', '.join(AUGMENTS)}")
    return train_tf, eval_tf, cfg


def spread_subset(dataset: Dataset, n: int | None) -> Dataset:
    """``n`` images spread evenly over ``dataset`` (all of it if ``n`` is None or too large).

    ImageFolder sorts by class, so the first ``n`` images would be one or two classes; every
    ``len / n``-th image keeps the class balance and is the same on every run.
    """
    total = len(dataset)
    if not n or n >= total:
        return dataset
    return torch.utils.data.Subset(dataset, [i * total // n for i in range(n)])


def split_dir(root: Path, name: str) -> Path:
    """``root/name``; a missing ``val``/``test`` split falls back to the other (CIFAR-10 names its val split test)."""
    path = root / name
    other = {"val": "test", "test": "val"}.get(name)
    if not path.is_dir() and other and (root / other).is_dir():
        return root / other
    return path


#: The seed of every held-out split: runs with different ``--seed`` hold out the same images, so that their held-out
#: evaluations pair image by image (the reference code fixes its 2% split the same way).
HOLDOUT_SEED = 7919


def holdout_split(n: int, fraction: float) -> tuple[list[int], list[int]]:
    """A fixed random split of ``range(n)`` (``HOLDOUT_SEED``): (train indices, held-out indices)."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"--holdout must be in [0, 1), got {fraction}")
    g = torch.Generator().manual_seed(HOLDOUT_SEED)
    perm = torch.randperm(n, generator=g).tolist()
    k = int(round(n * fraction))
    return sorted(perm[k:]), sorted(perm[:k])


def read_images(path: str | os.PathLike, transform: Callable, limit: int) -> list[tuple[str, torch.Tensor]]:
    """Transformed images of a file or a folder (all subfolders, sorted by path, at most ``limit``), with their
    file names."""
    p = Path(path)
    if not p.exists():
        raise LtmpError(f"no such image or folder: {path}; pass an image file or a folder of images")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix.lower() in IMG_EXTENSIONS)[:limit]
    if not files:
        raise LtmpError(f"no images ({', '.join(IMG_EXTENSIONS[:3])}, ...) in {path}")
    out = []
    for f in files:
        name = f.name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")  # a name that is not UTF-8
        try:
            out.append((name, transform(load_rgb(f))))
        except UNREADABLE as e:
            raise LtmpError(f"cannot read image {f} ({first_line(e)}); pass a JPEG/PNG image") from None
    return out


def class_folders(root: Path) -> tuple[list[str], list[str]]:
    """The class folders of a split, sorted by name, and the folders left out: hidden ones (``.ipynb_checkpoints``)
    and those with no image file."""
    classes, ignored = [], []
    for p in sorted(root.iterdir()):
        if p.is_dir():
            has_images = any(f.suffix.lower() in IMG_EXTENSIONS for f in p.iterdir())
            (classes if has_images and not p.name.startswith(".") else ignored).append(p.name)
    return classes, ignored


def class_names(data_dir: str, split: str) -> list[str]:
    """The class folder names of a split, in label order (as ImageFolder numbers them)."""
    folder = split_dir(resolve_root(data_dir), split)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder; pass --data-dir with {split}/<class>/ image folders")
    return class_folders(folder)[0]


def label_map(folders: list[str], names: list[str] | None, how: str | None) -> tuple[dict[str, int], str | None]:
    """Which label each class folder stands for, and a line for the user where that needs saying.

    Args:
        folders: the split's class folders (sorted). names: the model's class names in its output order, or None
            where the model has none. how: ``--labels`` (``LABELS``), or None: by name where every folder is a name
            of the model and every name has a folder; refuse otherwise.
    """
    order = {c: i for i, c in enumerate(folders)}
    if names is None:
        return order, f"the model names no classes: its classes 0-{len(folders) - 1} are the sorted class folders"
    if how == "order":
        return order, None
    unknown = [c for c in folders if c not in names]
    missing = [c for c in names if c not in folders]
    by_name = {c: names.index(c) for c in folders if c in names}
    if how is None and (unknown or missing):
        parts = [
            f"{len(unknown)} class folders it does not know ({', '.join(unknown[:3])})" if unknown else "",
            f"{len(missing)} of its classes have no folder ({', '.join(missing[:3])})" if missing else "",
        ]
        raise DataError(
            f"the data's class folders do not match the model's {len(names)} class names: "
            f"{'; '.join(p for p in parts if p)}; pass --labels names (folders by name, unknown folders left out) or "
            f"--labels order (the sorted folders as its classes 0, 1, ...)"
        )
    if not by_name:
        raise DataError(
            f"none of the data's class folders is one of the model's class names ({names[:3]}, ...); "
            f"pass --labels order to take the sorted folders as its classes 0, 1, ..."
        )
    note = (
        f"left out {len(unknown)} class folders the model does not know: {', '.join(unknown[:3])}" if unknown else None
    )
    return by_name, note


def fingerprint(dataset: Dataset) -> str:
    """The images an eval set reads, in order, as one sha256: each file's path within its split and its size.
    Two evaluations with the same fingerprint ran on the same images (``ltmp eval --compare`` checks it)."""
    indices, base = list(range(len(dataset))), dataset
    while isinstance(base, Subset):
        indices, base = [base.indices[i] for i in indices], base.dataset
    h = hashlib.sha256()
    for i in indices:
        path = base.samples[i][0]
        h.update(f"{os.path.relpath(path, base.root)}\t{os.path.getsize(path)}\n".encode())
    return h.hexdigest()


def eval_set(
    model: torch.nn.Module,
    data_dir: str,
    val_split: str,
    max_images: int | None = None,
    names: list[str] | None = None,
    labels: str | None = None,
) -> Dataset:
    """The model's eval transform over the eval split of ``data_dir`` (val <-> test fallback), optionally
    ``max_images`` of it spread evenly over the classes. Its class folders are labelled by ``label_map`` (the
    model's class ``names``, ``--labels``); ``notes`` (on the returned dataset) says what needs saying."""
    root = resolve_root(data_dir)
    _, eval_tf, _ = transforms_for(model, "none")
    folder = split_dir(root, val_split)
    data = labelled(folder, eval_tf, names, labels)
    return annotate(spread_subset(data, max_images), data.notes)


def labelled(
    folder: Path,
    transform: Callable | None,
    names: list[str] | None,
    labels: str | None,
    hint: str = "choose the split with --val-split",
) -> ImageFolder:
    """An :class:`ImageFolder` whose class folders carry the model's labels (:func:`label_map`), with ``notes``:
    the lines a command prints about them (folders left out, a model without class names)."""
    if not folder.is_dir():
        raise DataError(f"split folder {folder} does not exist; expected {folder}/<class>/<image files> ({hint})")
    folders, ignored = class_folders(folder)
    mapping, note = label_map(folders, names, labels)
    data = ImageFolder(folder, transform, folders, hint, labels=mapping)
    data.notes = [n for n in (note,) if n]
    if ignored:
        data.notes.append(f"left out {len(ignored)} hidden or empty folders in {folder}: {', '.join(ignored[:3])}")
    return data


def annotate(dataset: Dataset, notes: list[str]) -> Dataset:
    """``dataset`` with ``notes`` (a Subset keeps its base's)."""
    dataset.notes = notes
    return dataset
