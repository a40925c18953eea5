"""Models, devices and mixed precision: what every command sets up before it runs a model."""

from __future__ import annotations

import contextlib
import os
import pickle
import re

import torch
from torch import nn

from .errors import LtmpError, first_line


def create_model(
    name: str, pretrained: bool = False, checkpoint: str | None = None, classes_from: tuple[str, str] | None = None
) -> nn.Module:
    """A model by name, with pretrained weights or a checkpoint file.

    - a timm name or ``local-dir:PATH`` (timm);
    - ``hf:DIR_OR_NAME``: a transformers image classifier (``AutoModelForImageClassification``), always with its
      weights (or the checkpoint's); its preprocessing comes from the folder's image processor config;
    - ``open_clip:ARCH``: OpenCLIP's visual tower of ARCH, with ``--checkpoint FILE``; it returns image
      embeddings. With ``classes_from`` (a data dir and split), the tower as a zero-shot classifier of that split's
      class folders (:class:`ltmp.adapters.open_clip.ZeroShotClassifier`); other families ignore it.

    Models outside timm carry a timm-style ``pretrained_cfg`` (input size, mean, std), so that timm's data config
    and transforms serve every family.
    """
    kind, _, folder = name.partition(":")
    hub_name = re.fullmatch(r"\w[\w.-]*(/\w[\w.-]*)?", folder) and ".." not in folder  # google/vit-base-patch16-224
    if (kind == "local-dir" or kind == "hf" and not hub_name) and not os.path.isdir(folder):
        raise LtmpError(
            f"model folder {folder} does not exist; pass {kind}:DIR with a folder holding the model's "
            f"config.json and weights"
        )
    if name.startswith("hf:"):
        return _create_hf(name[3:], checkpoint)
    if name.startswith("open_clip:"):
        from .data import class_names

        classes = class_names(*classes_from) if classes_from else None
        return _create_open_clip(name[len("open_clip:") :], pretrained, checkpoint, classes)
    import timm

    if not name.startswith(("local-dir:", "hf-hub:")) and not timm.is_model(name):
        raise LtmpError(
            f"unknown model '{name}'; pick a timm ViT such as deit_small_patch16_224 "
            f"(list them with: python -c \"import timm; print(timm.list_models('*vit*'))\"), "
            f"local-dir:PATH, hf:DIR_OR_NAME or open_clip:ARCH"
        )
    # a local-dir folder's weights are what pointing at it means (as hf: folders); a checkpoint replaces them, and
    # the pretrained weights: don't fetch them first
    pretrained = pretrained or kind == "local-dir"
    try:
        model = timm.create_model(name, pretrained=pretrained and not checkpoint)
    except Exception as e:  # unreachable hub, missing local-dir files, bad config: one line with the fix
        raise LtmpError(
            f"cannot create model '{name}' with pretrained={pretrained} ({first_line(e)}); offline, pass "
            f"--checkpoint FILE or a local-dir:PATH model folder"
        ) from None
    if checkpoint:
        from timm.models import load_checkpoint

        if not os.path.isfile(checkpoint):
            raise LtmpError(f"checkpoint {checkpoint} does not exist; pass a weights file of {name}")
        try:
            load_checkpoint(model, checkpoint, strict=True)
        except Exception as e:  # torch, safetensors and pickle raise many types on a corrupt file
            raise LtmpError(
                f"cannot load checkpoint {checkpoint} ({_checkpoint_reason(e)}); pass a timm, torch or "
                f"safetensors state dict of {name}"
            ) from None
    return model


def _checkpoint_reason(e: Exception) -> str:
    """Why a weights file did not load, in a few words: the first missing or unexpected key or the first shape
    that differs (``load_state_dict`` lists them all on lines below its header), or that it is no file torch may
    read safely (without passing on torch's advice to turn ``weights_only`` off)."""
    text = str(e)
    if "weights_only" in text or isinstance(e, pickle.UnpicklingError):
        return "not a state dict torch.load(weights_only=True) can read: random bytes, or pickled Python objects"
    lines = [ln.strip() for ln in text.splitlines()]
    if lines and lines[0].startswith("Error(s) in loading state_dict") and len(lines) > 1:
        found = re.match(r"(Missing|Unexpected) key\(s\) in state_dict: (\"[^\"]+\")(.*)", lines[1])
        if found:
            more = found.group(3).count('"') // 2
            return f"{found.group(1).lower()} key {found.group(2)}" + (f" and {more} more" if more else "")
        return lines[1][:200]
    return f"{type(e).__name__}: {first_line(e)}"


def _load_state(model: nn.Module, checkpoint: str, name: str) -> None:
    """A safetensors or torch state dict into ``model``, strictly."""
    if not os.path.isfile(checkpoint):
        raise LtmpError(f"checkpoint {checkpoint} does not exist; pass a weights file of {name}")
    try:
        if checkpoint.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(checkpoint)
        else:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
            state = state.get("state_dict", state) if isinstance(state, dict) else state
        model.load_state_dict(state, strict=True)
    except Exception as e:  # torch, safetensors and pickle raise many types on a corrupt or foreign file
        raise LtmpError(
            f"cannot load checkpoint {checkpoint} ({_checkpoint_reason(e)}); pass a torch or "
            f"safetensors state dict of {name}"
        ) from None


def _create_hf(path: str, checkpoint: str | None) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise LtmpError("hf: models need transformers; install it with: pip install 'ltmp[hf]'") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        if checkpoint:
            model = transformers.AutoModelForImageClassification.from_config(config)
        else:
            model = transformers.AutoModelForImageClassification.from_pretrained(path)
    except Exception as e:  # unreachable hub, missing files, a model without a classification head
        where = "the folder" if os.path.isdir(path) else "no such folder here, nor on the hub (offline?):"
        raise LtmpError(
            f"cannot load hf:{path} as a transformers image classifier ({where} {first_line(e)}); pass "
            f"a folder written by save_pretrained (offline) or a hub name"
        ) from None
    if checkpoint:
        _load_state(model, checkpoint, f"hf:{path}")
    model.pretrained_cfg = {
        **_hf_data_config(transformers, path, config),
        "architecture": f"hf:{path}",
        "num_classes": config.num_labels,
    }
    return model.eval()


def _hf_data_config(transformers, path: str, config) -> dict:
    """timm's data config from the folder's image processor: resize (shortest edge or height), then the center
    crop if it has one; its resampling filter, mean and std. Without a processor config: the model's image size,
    ImageNet statistics."""
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(path)
    except Exception:  # no preprocessor_config.json
        from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

        size = int(getattr(config, "image_size", 224))
        return {
            "input_size": (3, size, size),
            "mean": IMAGENET_DEFAULT_MEAN,
            "std": IMAGENET_DEFAULT_STD,
            "interpolation": "bicubic",
            "crop_pct": 1.0,
        }
    size = dict(proc.size or {})
    resize = size.get("shortest_edge") or size.get("height") or int(getattr(config, "image_size", 224))
    crop = dict(getattr(proc, "crop_size", None) or {}) if getattr(proc, "do_center_crop", False) else {}
    side = int(crop.get("height") or resize)
    filters = {0: "nearest", 2: "bilinear", 3: "bicubic"}
    resample = getattr(proc, "resample", 2)
    return {
        "input_size": (3, side, side),
        "mean": tuple(proc.image_mean),
        "std": tuple(proc.image_std),
        "interpolation": filters.get(int(getattr(resample, "value", resample)), "bicubic"),
        "crop_pct": min(1.0, side / int(resize)),
    }


def _create_open_clip(arch: str, pretrained: bool, checkpoint: str | None, classes: list[str] | None) -> nn.Module:
    try:
        import open_clip
    except ImportError:
        raise LtmpError(
            "open_clip: models need open_clip_torch; install it with: pip install 'ltmp[openclip]'"
        ) from None
    if arch not in open_clip.list_models():
        raise LtmpError(f"unknown OpenCLIP architecture '{arch}'; pick one of open_clip.list_models(), e.g. ViT-B-32")
    if pretrained and not checkpoint:
        raise LtmpError(f"open_clip:{arch} loads its weights from --checkpoint FILE (an OpenCLIP checkpoint)")
    model = open_clip.create_model(arch)
    if checkpoint:
        if not os.path.isfile(checkpoint):
            raise LtmpError(f"checkpoint {checkpoint} does not exist; pass an OpenCLIP checkpoint of {arch}")
        try:
            open_clip.load_checkpoint(model, checkpoint)
        except Exception as e:
            raise LtmpError(
                f"cannot load checkpoint {checkpoint} into open_clip:{arch} ({first_line(e)}); pass an "
                f"OpenCLIP checkpoint of {arch}"
            ) from None
    visual = model.visual
    pre = getattr(visual, "preprocess_cfg", {}) or {}
    size = pre.get("size", visual.image_size)
    size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
    visual.pretrained_cfg = {
        "input_size": (3, *size),
        "mean": tuple(pre.get("mean", open_clip.OPENAI_DATASET_MEAN)),
        "std": tuple(pre.get("std", open_clip.OPENAI_DATASET_STD)),
        "interpolation": pre.get("interpolation", "bicubic"),
        "crop_pct": 1.0,
        "architecture": f"open_clip:{arch}",
    }
    if classes:
        from .adapters.open_clip import ZeroShotClassifier

        try:
            tokenizer = open_clip.get_tokenizer(arch)
        except Exception as e:  # a tokenizer from the hub, offline
            raise LtmpError(
                f"cannot load the tokenizer of open_clip:{arch} ({first_line(e)}); zero-shot "
                f"classification needs it once (online, or in the Hugging Face cache)"
            ) from None
        return ZeroShotClassifier.from_clip(model, tokenizer, classes).eval()
    return visual.eval()


def logits(out) -> torch.Tensor:
    """A classifier's logits from what its forward returns: the tensor itself (timm) or ``.logits``
    (transformers)."""
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is None:
        raise LtmpError(
            f"this model returns {type(out).__name__}, not class logits; accuracy and training need an image classifier"
        )
    return out.logits


def label_names(model: nn.Module) -> list[str] | None:
    """The names of a classifier's classes, in the order of its outputs, where the model knows them: timm's
    ``pretrained_cfg["label_names"]``, transformers' ``config.id2label`` (not its placeholder ``LABEL_0``, ...), a
    zero-shot OpenCLIP classifier's classes. None otherwise."""
    names = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
    id2label = getattr(getattr(model, "config", None), "id2label", None)
    if not names and id2label:
        names = [id2label[i] for i in sorted(id2label)]
        names = None if all(n == f"LABEL_{i}" for i, n in enumerate(names)) else names
    return list(names) if names else None


def require_classifier(model: nn.Module) -> None:
    """Refuse models that return embeddings (OpenCLIP's visual tower) where class logits are needed."""
    from .adapters import adapter_for
    from .adapters.open_clip import ZeroShotClassifier

    model = getattr(model, "module", model)
    if adapter_for(model).family == "open_clip" and not isinstance(model, ZeroShotClassifier):
        raise LtmpError(
            "an OpenCLIP visual tower returns image embeddings, not class logits; accuracy and training "
            "need an image classifier: ltmp.adapters.open_clip.ZeroShotClassifier"
        )


def compile_model(model: nn.Module, device: torch.device | str = "cpu", train: bool = False) -> nn.Module:
    """``torch.compile`` for ``--compile``, in the form the model's shapes allow.

    - Eval, dense or a fixed-rate method (ToMe, top-k): every block's token count follows from the input's shape,
      so the forward is one graph (``fullgraph=True``, static shapes) and, on CUDA, replays as a CUDA graph
      (``mode="reduce-overhead"``: one launch per forward instead of one per operator).
    - Eval with learned thresholds: ``dynamic=True``, since token counts change from image to image and block to
      block (graphs break once per block, where compaction reads the counts; no guard depends on them).
    - ``train=True``: static shapes (the masked train step keeps every token).

    The first batches compile (up to minutes); later ones reuse the graphs. Needs a C++ compiler on CPUs and Triton
    on GPUs, as torch.compile does. Raises Dynamo's per-function recompile limit to at least 64 (default 8): every
    block of every patched model in the process runs the same block function, and each reduction method, batch
    size of 1 or more, and the first block (no padding yet) compile their own variant of it; past the limit
    Dynamo would silently run it eagerly.
    """
    if not hasattr(torch, "compile"):
        raise LtmpError(f"--compile needs torch.compile (torch >= 2.0); this is torch {torch.__version__}")
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
    cfg = getattr(model, "ltmp_config", None)
    if train:
        return torch.compile(model, dynamic=False)
    if cfg is None or not cfg.learned:
        graphs = "reduce-overhead" if torch.device(device).type == "cuda" else None
        return torch.compile(model, dynamic=False, fullgraph=True, mode=graphs)
    return torch.compile(model, dynamic=True)


def pick_device(name: str) -> torch.device:
    """``auto`` (a CUDA GPU if there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``, ``mps``; refused here
    if this machine lacks it, not on the first tensor moved there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    have = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if (
        device is None
        or not have.get(device.type)
        or (device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count())
    ):
        here = ", ".join(["auto", *(k for k, ok in have.items() if ok)])
        raise LtmpError(f"--device {name} is not a device of this machine; pass one of: {here}")
    return device


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of an ``--amp`` mode: "auto" is bf16 where supported (every CPU, Ampere and newer
    GPUs), else fp16; "fp16" is for GPUs only. None when mixed precision is off."""
    if not mode:
        return None
    if mode == "fp16" and device.type != "cuda":
        raise LtmpError("--amp fp16 needs a CUDA device; use --amp bf16 on the CPU")
    if mode == "fp16" or (mode == "auto" and device.type == "cuda" and not torch.cuda.is_bf16_supported()):
        return torch.float16
    if mode not in ("auto", "bf16"):
        raise LtmpError(f"unknown --amp mode '{mode}'; choose auto, bf16 or fp16")
    return torch.bfloat16


def amp_context(mode: str, device: torch.device):
    dtype = amp_dtype(mode, device)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts, while active, the calls that read a tensor's values back to the host (a synchronisation on a GPU,
    where the host must wait for the device): ``item``/``tolist``/``bool``/``int``/``float``, outputs whose shape
    depends on the values (``nonzero``, ``masked_select``, ``unique``, indexing with a boolean mask) and copies from
    a device to the CPU. The counting is the same on a CPU, where nothing waits, so a test can hold a forward to
    a number of synchronisations without a GPU (``benchmarks/profile_step.py`` prints them).

    ``with HostSyncs() as syncs: model(x)``; then ``syncs.count`` and ``syncs.calls`` (name -> count).
    """

    READS = frozenset(
        {
            "item",
            "tolist",
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
            "nonzero",
            "argwhere",
            "masked_select",
            "unique",
            "unique_consecutive",
        }
    )

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    @property
    def count(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = name in self.READS
        if name == "__getitem__" and len(args) > 1:  # a boolean mask index has a value-dependent shape
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            read = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        elif name in ("cpu", "to") and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            out = func(*args, **kwargs)
            if out.device.type == "cpu":
                self.calls[name] = self.calls.get(name, 0) + 1
            return out
        if read:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **kwargs)
