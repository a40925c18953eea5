"""Export a patched model for deployment, with its data-dependent token counts intact where the format allows.

- ``export``: :func:`torch.export.export` of the batch-1 eval forward. Every merge/prune decision and the number
  of tokens after every block stay data-dependent (unbacked symbolic sizes), so one exported program serves every
  image. This is the path to ExecuTorch (phones) and AOTInductor. Saved with :func:`torch.export.save` (``.pt2``).
- ``onnx``: the dynamo-based ONNX exporter (``torch.onnx.export(..., dynamo=True)``), built on the same program;
  needs ``pip install onnx onnxscript``.
- ``torchscript``: :func:`torch.jit.trace` records the token counts of the example image as constants, so the
  traced model reduces every image exactly like the example. That is exact only for fixed-rate methods (ToMe,
  top-k), whose counts do not depend on the image; for learned thresholds use ``export``. Scripting is not
  supported (the reduction step is Python with dataclasses).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from .errors import LtmpError, first_line
from .thresholds import atomic_write

FORMATS = ("export", "onnx", "torchscript")


class _Batch1(nn.Module):
    """The batch-1 forward (logits only) of a patched model; the token record is not part of the graph."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@contextlib.contextmanager
def exporting(model: nn.Module):
    """Mark a torch.export trace of ``model`` (``ReduceConfig.exporting``): whatever ``torch.compiler.is_exporting``
    says, a patched model then runs its branch-free step, with symbolic counts."""
    cfg = getattr(model, "ltmp_config", None)
    before = cfg is not None and cfg.exporting
    if cfg is not None:
        cfg.exporting = True
    try:
        yield
    finally:
        if cfg is not None:
            cfg.exporting = before


class _Program(nn.Module):
    """An exported program as a module that tolerates ``eval()`` (exported programs are always in eval mode)."""

    def __init__(self, program: nn.Module):
        super().__init__()
        self.__dict__["program"] = program  # not a submodule: its train()/eval() raise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.program(x)

    def to(self, *args, **kwargs):
        self.__dict__["program"] = self.program.to(*args, **kwargs)
        return self


def _require_space(model: nn.Module, path: Path) -> None:
    """Refuse an export that the disk cannot hold (the exporters abort the process on a full disk): the weights
    and 64 MiB for the graph."""
    need = sum(p.numel() * p.element_size() for p in model.parameters()) + (64 << 20)
    where = path.parent if path.parent.exists() else Path(".")
    free = shutil.disk_usage(where).free
    if free < need:
        raise LtmpError(
            f"--output {path}: {where} has {free >> 20} MiB free and the export needs about {need >> 20} MiB; "
            f"free disk space or write to another disk"
        )


def export_model(model: nn.Module, example: torch.Tensor, fmt: str, path: str | os.PathLike) -> Path:
    """Export ``model`` (patched or dense) for inputs shaped like ``example`` (1, 3, H, W) to ``path``.

    Returns:
        The written path.
    """
    if fmt not in FORMATS:
        raise LtmpError(f"unknown export format '{fmt}'; choose one of: {', '.join(FORMATS)}")
    if example.shape[0] != 1:
        raise LtmpError("export takes one example image (batch 1): the exported model runs one image at a time")
    path = Path(path)
    _require_space(model, path)
    plain, model = model, _Batch1(model).eval()
    with torch.no_grad():
        if fmt == "export":
            with exporting(plain):
                program = torch.export.export(model, (example,))
            atomic_write(path, lambda tmp: torch.export.save(program, tmp))
        elif fmt == "onnx":
            try:
                import onnxscript  # noqa: F401
            except ImportError:
                raise LtmpError(
                    "ONNX export needs the onnx and onnxscript packages: pip install onnx onnxscript"
                ) from None
            with exporting(plain):
                atomic_write(
                    path,
                    lambda tmp: torch.onnx.export(
                        model, (example,), tmp, dynamo=True, external_data=False, verbose=False
                    ),
                )
        else:
            cfg = getattr(model.model, "ltmp_config", None)
            if cfg is not None and cfg.learned:
                warnings.warn(
                    "TorchScript tracing fixes the token counts of the example image; learned thresholds "
                    "need data-dependent counts: use --format export",
                    stacklevel=2,
                )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                traced = torch.jit.trace(model, (example,), check_trace=False)
            atomic_write(path, lambda tmp: traced.save(tmp))
    return path


def load_exported(path: str | os.PathLike) -> nn.Module:
    """A callable module from an exported file: ``.pt2`` (torch.export) or TorchScript."""
    path = Path(path)
    if path.suffix == ".onnx":
        raise LtmpError("run .onnx files with onnxruntime; ltmp loads .pt2 (torch.export) and TorchScript files")
    if not path.is_file():
        raise LtmpError(
            f"exported model {path} is {'a folder' if path.is_dir() else 'missing'}; pass a file written "
            f"by 'ltmp export' (.pt2, or .pt for TorchScript)"
        )
    try:
        if path.suffix == ".pt2":
            return _Program(torch.export.load(str(path)).module())
        return torch.jit.load(str(path))
    except Exception as e:  # torch raises many types on a file it cannot read
        raise LtmpError(
            f"cannot load exported model {path} ({first_line(e)}); pass a file written by 'ltmp export' "
            f"(.pt2, or .pt for TorchScript)"
        ) from None


#: runtimes ``ltmp bench --deployed`` times exported models in, with the format each one runs
RUNTIMES = {"onnx": "onnx", "openvino": "onnx", "aoti": "export"}


class _OrtSession(nn.Module):
    """A graph loaded into ONNX Runtime (CPU provider) as a module: one call runs the whole graph, no Python."""

    def __init__(self, path: Path, threads: int):
        super().__init__()
        try:
            import onnxruntime as ort
        except ImportError:
            raise LtmpError("--deployed onnx needs ONNX Runtime: pip install 'ltmp[export]'") from None
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.__dict__["session"] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session.run(None, {self.input: x.numpy()})[0])


#: OpenVINO CPU settings of ``--deployed openvino`` (threads are added per load); why the snippets are off: _OpenVino.
#: float32 as exported: on a CPU with AVX512-BF16 (or AMX) OpenVINO otherwise runs in bfloat16 (logits 1e-3 off)
OPENVINO_CONFIG = {
    "PERFORMANCE_HINT": "LATENCY",
    "NUM_STREAMS": 1,
    "SNIPPETS_MODE": "DISABLE",
    "INFERENCE_PRECISION_HINT": "f32",
}


class _OpenVino(nn.Module):
    """An ONNX graph compiled by OpenVINO for the CPU, for one image at a time (latency hint, one stream).

    Its fused attention kernels ("snippets") are off: in OpenVINO 2026.4 they give wrong attention outputs where a
    block's fixed token count equals its head count (ToMe's last blocks can get there), and on some CPUs at some
    dynamic token counts (docs/deploy.md, benchmarks/openvino_check.py)."""

    def __init__(self, path: Path, threads: int):
        super().__init__()
        try:
            import openvino as ov
        except ImportError:
            raise LtmpError("--deployed openvino needs OpenVINO: pip install 'ltmp[openvino]'") from None
        self.__dict__["compiled"] = ov.Core().compile_model(
            str(path), "CPU", {**OPENVINO_CONFIG, "INFERENCE_NUM_THREADS": threads}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.compiled(x.numpy())[0])


def deploy(model: nn.Module, example: torch.Tensor, runtime: str, folder: str | os.PathLike, name: str) -> Path:
    """Export ``model`` at batch 1 for a deployment runtime into ``folder``; returns the file the runtime loads
    (:func:`load_deployed`).

    - ``onnx``, ``openvino``: the ONNX export, for ONNX Runtime's CPU provider or OpenVINO's CPU plugin;
    - ``aoti``: the ``.pt2`` program compiled ahead of time by AOTInductor (a C++ shared library in a package; needs
      a C++ compiler).
    """
    if runtime not in RUNTIMES:
        raise LtmpError(f"unknown runtime '{runtime}'; choose one of: {', '.join(RUNTIMES)}")
    suffix = ".onnx" if RUNTIMES[runtime] == "onnx" else ".pt2"
    path = export_model(model, example, RUNTIMES[runtime], Path(folder) / f"{name}{suffix}")
    if RUNTIMES[runtime] == "onnx":
        return path
    try:
        return Path(
            torch._inductor.aoti_compile_and_package(
                torch.export.load(str(path)), package_path=str(Path(folder) / f"{name}-aoti.pt2")
            )
        )
    except Exception as e:  # Inductor's lowering errors are long; the first line says what it could not do
        raise LtmpError(
            f"AOTInductor cannot compile the {name} model ({first_line(e, 300)}); learned thresholds' "
            f"data-dependent token counts do not compile there yet (docs/deploy.md): use --deployed onnx "
            f"or openvino"
        ) from None


def load_deployed(path: str | os.PathLike, runtime: str, threads: int) -> nn.Module:
    """A file from :func:`deploy` loaded into its runtime, as a callable module: ONNX Runtime or OpenVINO with
    ``threads`` threads, or the AOTInductor package (it runs on torch's threads: this sets them)."""
    if runtime in ("onnx", "openvino"):
        return (_OrtSession if runtime == "onnx" else _OpenVino)(Path(path), threads)
    torch.set_num_threads(threads)
    return _Program(torch._inductor.aoti_load_package(str(path)))
