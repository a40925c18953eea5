"""Bad input, table-driven: every user mistake gets one line that names the fix (exit 2, no traceback), and every
file that existed before is still there, byte for byte. Then a fuzz of every option of every command."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

import ltmp
import ltmp.demo
import ltmp.runtime
import ltmp.train
from ltmp.cli import build_parser, main
from ltmp.data import load_rgb
from ltmp.thresholds import threshold_tensors


def _damaged(src: Path, dst: Path, tau: str = "0.1", nan_block: int | None = None) -> None:
    with safe_open(str(src), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    meta["tau"] = tau
    if nan_block is not None:
        tensors["merge_threshold"][nan_block] = math.nan
    save_file(tensors, str(dst), metadata=meta)


@pytest.fixture
def ws(tiny_model, tiny_data, tmp_path, tmp_path_factory, monkeypatch):  # noqa: F811
    """A workspace of things a user made: trained thresholds, an interrupted run, damaged files, odd folders."""
    from ltmp.train import TrainConfig, resolve, save_checkpoint

    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("LTMP_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    model = ltmp.patch(ltmp.runtime.create_model(tiny_model), "ltmp", merge_threshold=0.8, prune_threshold=0.01)
    ltmp.save_thresholds(model, tmp_path / "T.safetensors")
    run = tmp_path / "run"
    cfg = resolve(
        TrainConfig(
            model=tiny_model,
            data_dir=str(tiny_data),
            output=str(run),
            r_target=0.6,
            batch_size=8,
            steps=4,
            checkpoint_every=2,
            workers=0,
            optimizer="adam",  # learning rates that depend on nothing measured
        )
    )  # as train() saves it: defaults filled in
    save_checkpoint(model, run / "checkpoint.safetensors", 2, cfg)
    (run / "log.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / ltmp.thresholds.RUN_MARKER).write_text("train\n")
    torch.save(ltmp.runtime.create_model(tiny_model).state_dict(), tmp_path / "weights.pth")
    user = tmp_path / "userdir"  # a folder of the user's own files
    user.mkdir()
    (user / "config.json").write_text('{"mine": true}\n')
    (user / "log.jsonl").write_text("my notes\n")
    pt = tmp_path / "pt"  # a pretraining folder with a log that is not the log pretrain writes
    pt.mkdir()
    (pt / ltmp.thresholds.RUN_MARKER).write_text("pretrain\n")
    (pt / "log.jsonl").write_text("not json\n")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere" / "x.json")
    with safe_open(str(tmp_path / "T.safetensors"), framework="pt") as f:  # a value float32 cannot hold
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k).double() for k in f.keys()}
    tensors["merge_threshold"][0] = 1e300
    save_file(tensors, str(tmp_path / "huge.safetensors"), metadata=meta)
    (tmp_path / "other.json").write_text(
        json.dumps(
            {"method": "tome", "gmacs": 0.1, "top1": 50.0, "images": 18, "correct": "0" * 18, "images_sha256": "0" * 64}
        )
    )
    named = tmp_path / "named"  # the tiny model with class names, and data folders that do not match them
    named.mkdir()
    for f in Path(tiny_model.split(":", 1)[1]).iterdir():
        (named / f.name).write_bytes(f.read_bytes())
    config = json.loads((named / "config.json").read_text())
    config["pretrained_cfg"]["label_names"] = ["class0", "class1", "class2"]
    (named / "config.json").write_text(json.dumps(config))
    for name, folders in (("miss", ["class0", "class1"]), ("renamed", ["class0", "class1", "car"])):
        for i, folder in enumerate(folders):
            (tmp_path / name / "val").mkdir(parents=True, exist_ok=True)
            (tmp_path / name / "val" / folder).symlink_to(tiny_data / "val" / f"class{i}")
    _damaged(tmp_path / "T.safetensors", tmp_path / "tau.safetensors", tau="abc")
    _damaged(tmp_path / "T.safetensors", tmp_path / "nan.safetensors", nan_block=1)
    state = ltmp.runtime.create_model(tiny_model).state_dict()
    torch.save({k: v for k, v in state.items() if k != "head.weight"}, tmp_path / "missing.pth")
    (tmp_path / "random.pth").write_bytes(np.random.default_rng(0).bytes(300))
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "folder").mkdir()
    (tmp_path / "bad.tar.gz").write_bytes(
        (Path(ltmp.__file__).parent / "assets" / "cifar10-subset.tar.gz").read_bytes()[:3000]
    )
    unreadable = tmp_path / "unreadable"
    for split in ("train", "val"):
        (unreadable / split / "c0").mkdir(parents=True)
        for i in range(3):
            (unreadable / split / "c0" / f"{i}.jpg").write_text("not an image")
    (tmp_path / "no-train" / "val").mkdir(parents=True)
    (tmp_path / "no-train" / "val" / "c0").symlink_to(tiny_data / "val" / "class0")
    return {
        "model": tiny_model,
        "data": str(tiny_data),
        "tmp": str(tmp_path),
        "T": str(tmp_path / "T.safetensors"),
        "run": str(run),
        "cache": str(cache),
        "M": tiny_model.split(":", 1)[1],
        "named": f"local-dir:{named}",
    }


def unwritable(tmp: str) -> str:
    """A folder this process cannot write in: a read-only one, or /proc where permissions do not stop root."""
    if os.geteuid() == 0:
        return "/proc"
    ro = Path(tmp) / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    return str(ro)


EVAL = "eval --model {model} --data-dir {data} --workers 0"
TRAIN = "train --model {model} --data-dir {data} --r-target 0.6 --batch-size 8 --workers 0 --optimizer adam"
#: (the issue's row, arguments, words the one line holds, True: refused before any model is built)
ROWS = {
    "1 eval --json onto its own --thresholds": (
        f"{EVAL} --thresholds {{T}} --json {{T}}",
        "is also an input of this command",
        True,
    ),
    "2 calibrate onto trained thresholds": (
        "calibrate --model {model} --data-dir {data} --r-target 0.5 --output {T}",
        "exists; pass --overwrite to replace it",
        True,
    ),
    "3 train rerun on an interrupted run": (
        f"{TRAIN} --output {{run}}",
        "holds an interrupted run; resume it with --resume, or pass --overwrite",
        True,
    ),
    "3 train --resume and --overwrite": (f"{TRAIN} --output {{run}} --resume --overwrite", "not both", True),
    "5 train --tau 0": (f"{TRAIN} --output {{tmp}}/new --tau 0", "argument --tau: must be > 0, got 0", True),
    "5 train --lr-merge -1": (f"{TRAIN} --output {{tmp}}/new --lr-merge -1", "--lr-merge: must be >= 0", True),
    "5 eval NaN thresholds": (
        f"{EVAL} --thresholds {{tmp}}/nan.safetensors",
        "merge_threshold of block 2 is nan (not finite)",
        False,
    ),
    "8 train --no-settle on unreadable images": (
        "train --model {model} --data-dir {tmp}/unreadable --r-target 0.6 --batch-size 2 --workers 0 --output "
        "{tmp}/new --no-settle",
        "none of the 3 training images in",
        False,
    ),
    "8 train on unreadable images": (
        "train --model {model} --data-dir {tmp}/unreadable --r-target 0.6 --batch-size "
        "2 --workers 0 --output {tmp}/new",
        "none of the 3 training images in",
        False,
    ),
    "9 eval --batch-size 0": (f"{EVAL} --batch-size 0", "argument --batch-size: must be >= 1, got 0", True),
    "9 eval --batch-size -1": (f"{EVAL} --batch-size -1", "argument --batch-size: must be >= 1, got -1", True),
    "9 calibrate --images 0": (
        "calibrate --model {model} --data-dir {data} --r-target 0.5 --images 0 --output {tmp}/c.safetensors",
        "argument --images: must be >= 1, got 0",
        True,
    ),
    "9 train --checkpoint-every 0": (
        f"{TRAIN} --output {{tmp}}/new --checkpoint-every 0",
        "argument --checkpoint-every: must be >= 1",
        True,
    ),
    "9 thresholds with tau 'abc'": (
        f"{EVAL} --thresholds {{tmp}}/tau.safetensors",
        "is damaged: its tau ('abc') is not what 'ltmp train' writes",
        False,
    ),
    "9 --json in a folder it cannot write": (
        f"{EVAL} --method tome --r 2 --json {{unwritable}}/e.json",
        "cannot be written: no new file in",
        True,
    ),
    "9 --json under a file": (
        f"{EVAL} --method tome --r 2 --json {{tmp}}/a-file/e.json",
        "cannot be created: {tmp}/a-file is a file, not a folder",
        True,
    ),
    "9 --json onto a folder": (
        f"{EVAL} --method tome --r 2 --json {{tmp}}/folder",
        "--json {tmp}/folder is a folder; pass a file name",
        True,
    ),
    "9 train --output onto a file": (f"{TRAIN} --output {{tmp}}/a-file", "--output {tmp}/a-file is a file", True),
    "11 checkpoint missing a key": (f"{EVAL} --checkpoint {{tmp}}/missing.pth", 'missing key "head.weight"', False),
    "11 checkpoint of random bytes": (
        f"{EVAL} --checkpoint {{tmp}}/random.pth",
        "not a state dict torch.load(weights_only=True) can read",
        False,
    ),
    "11 hf: a missing folder": (
        "eval --model hf:{tmp}/no-model --data-dir {data}",
        "model folder {tmp}/no-model does not exist",
        False,
    ),
    "11 --thresholds a folder": (f"{EVAL} --thresholds {{tmp}}/folder", "is a folder; pass the thresholds", False),
    "11 a corrupt tar": (f"{EVAL} --method tome --r 2 --data-dir {{tmp}}/bad.tar.gz", "cannot unpack", False),
    "11 no train/": (
        "train --model {model} --data-dir {tmp}/no-train --r-target 0.6 --output {tmp}/new",
        "(training reads the train/ split of --data-dir)",
        False,
    ),
    "12 eval --r 99": (
        f"{EVAL} --method tome --r 99",
        "--r 99 (block 1) asks for more tokens than this model has: with its 16 patch tokens",
        False,
    ),
    "12 eval --max-images 0": (f"{EVAL} --max-images 0", "argument --max-images: must be >= 1, got 0", True),
    # an output is never an input, another run's, or a folder of the user's own files
    "train --output a folder of the user's files": (
        f"{TRAIN} --output {{tmp}}/userdir",
        "--output {tmp}/userdir holds files ltmp train did not make (config.json, log.jsonl); pass a new or empty",
        True,
    ),
    "train --output the model's folder": (f"{TRAIN} --output {{M}}", "is also an input of this command", True),
    "pretrain --output a folder of the user's files": (
        "pretrain --data-dir {data} --output {tmp}/userdir",
        "holds files ltmp pretrain did not make",
        True,
    ),
    "pretrain --output a run folder of train": (
        "pretrain --data-dir {data} --output {run}",
        "--output {run} is a run folder of ltmp train; pass another --output",
        True,
    ),
    "calibrate --output the model's weights": (
        "calibrate --model {model} --data-dir {data} --r-target 0.5 --output {M}/model.safetensors --overwrite",
        "lies inside {M}, an input of this command",
        True,
    ),
    "eval --json the model's config": (
        f"{EVAL} --method tome --r 2 --json {{M}}/config.json --overwrite",
        "lies inside {M}, an input of this command",
        True,
    ),
    "eval --json inside the data": (
        f"{EVAL} --method tome --r 2 --json {{data}}/val/e.json",
        "lies inside {data}, an input of this command",
        True,
    ),
    "eval --json a dangling link": (
        f"{EVAL} --method tome --r 2 --json {{tmp}}/dangling.json",
        "--json {tmp}/dangling.json is a link to nothing",
        True,
    ),
    # silently wrong before
    "eval labels: a class folder missing": (
        "eval --model {named} --data-dir {tmp}/miss --workers 0",
        "1 of its classes have no folder (class2); pass --labels names",
        False,
    ),
    "eval labels: a folder renamed": (
        "eval --model {named} --data-dir {tmp}/renamed --workers 0",
        "1 class folders it does not know (car)",
        False,
    ),
    "train --resume with another --checkpoint": (
        f"{TRAIN} --steps 4 --checkpoint-every 2 --output {{run}} --resume --checkpoint {{tmp}}/weights.pth",
        "cannot resume {run}: it was started with checkpoint=None, not",
        False,
    ),
    "train --resume with another learning rate": (
        f"{TRAIN} --steps 4 --checkpoint-every 2 --output {{run}} --resume --lr-merge 0.5",
        "cannot resume {run}: it was started with lr_merge=0.002, not 0.5",
        False,
    ),
    "eval --compare another image set of the same size": (
        f"{EVAL} --method tome --r 2 --compare {{tmp}}/other.json",
        "was evaluated on other images than these (18 images)",
        False,
    ),
    "eval --thresholds with --method and --r": (
        f"{EVAL} --thresholds {{T}} --method tome --r 4",
        "--method tome disagrees with --thresholds {T}, which holds ltmp",
        True,
    ),
    "eval --thresholds with --r": (f"{EVAL} --thresholds {{T}} --r 4", "--r sets a fixed rate", True),
    "eval thresholds float32 cannot hold": (
        f"{EVAL} --thresholds {{tmp}}/huge.safetensors",
        "merge_threshold of block 1 is inf (not finite); the model's float32 thresholds cannot hold it",
        False,
    ),
    "demo --output a file": ("demo --output {T}", "is a file; ltmp demo writes a folder: pass another --output", True),
    "train --steps 1 at the paper's learning rate scaled to it": (
        f"{TRAIN} --optimizer sgd --steps 1 --output {{tmp}}/fast",
        "and training would learn nothing: --steps 1 scales the paper's learning rate by",
        False,
    ),
    # tracebacks before
    "pretrain into a folder whose log is not its JSON": (
        "pretrain --data-dir {data} --val-split val --epochs 1 --batch-size 8 --workers 0 --output {tmp}/pt",
        "{tmp}/pt/log.jsonl is not the log ltmp pretrain writes",
        False,
    ),
}


def snapshot(*roots: str) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under ``roots``."""
    return {str(p): p.read_bytes() if p.is_file() else None for r in roots for p in sorted(Path(r).rglob("*"))}


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_row(row, ws, capsys, monkeypatch):
    template, words, early = ROWS[row]
    fill = {**ws, "unwritable": unwritable(ws["tmp"])}
    before = snapshot(ws["tmp"], ws["data"])
    if early:  # refused before any work: no model is even built

        def no_work(*args, **kwargs):
            raise AssertionError(f"{row}: a model was built before the refusal")

        for module in (ltmp.runtime, ltmp.train, ltmp.demo):  # (each binds create_model at its import)
            monkeypatch.setattr(module, "create_model", no_work)
    code = main(["--quiet", *template.format(**fill).split()])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("ltmp: error: ") and words.format(**fill) in lines[0], lines[0]
    assert snapshot(ws["tmp"], ws["data"]) == before  # nothing lost, nothing changed, no leftovers
    assert not list(Path(ws["cache"]).iterdir())  # a failed unpack leaves no half-unpacked folder


def test_overwrite_replaces_and_resume_continues(ws, capsys):
    """What the refusals name works: --overwrite replaces an output, --resume continues the interrupted run."""
    args = [
        "--quiet",
        "calibrate",
        "--model",
        ws["model"],
        "--data-dir",
        ws["data"],
        "--r-target",
        "0.5",
        "--images",
        "8",
        "--output",
        ws["T"],
    ]
    old = Path(ws["T"]).read_bytes()
    assert main([*args, "--overwrite"]) == 0 and Path(ws["T"]).read_bytes() != old
    train = [*TRAIN.format(**ws).split(), "--steps", "4"]
    assert main(["--quiet", *train, "--output", ws["run"], "--resume", "--no-eval"]) == 0
    log = [json.loads(line)["step"] for line in (Path(ws["run"]) / "log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4]  # resumed after step 2 of 4
    assert (Path(ws["run"]) / "thresholds.safetensors").exists()
    assert not (Path(ws["run"]) / "checkpoint.safetensors").exists()
    code = main(["--quiet", *train, "--output", ws["run"], "--no-eval"])
    assert code == 2 and "already holds a finished run; pass --overwrite" in capsys.readouterr().err
    assert main(["--quiet", *train, "--output", ws["run"], "--no-eval", "--overwrite"]) == 0


def test_a_failed_run_removes_only_the_folder_it_created(ws, capsys):
    new = Path(ws["tmp"]) / "new"
    mine = Path(ws["tmp"]) / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    for out in (new, mine):
        code = main(
            [
                "--quiet",
                "train",
                "--model",
                ws["model"],
                "--data-dir",
                f"{ws['tmp']}/unreadable",
                "--r-target",
                "0.6",
                "--output",
                str(out),
                "--workers",
                "0",
            ]
        )
        assert code == 2
    assert not new.exists() and (mine / "notes.txt").read_text() == "a user's file"


def test_interrupt_says_what_to_do_per_command(ws, capsys, monkeypatch):
    import ltmp.evaluate

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ltmp.evaluate, "evaluate", interrupt)
    assert main(["--quiet", *EVAL.format(**ws).split(), "--method", "tome", "--r", "2"]) == 130
    *notes, last = capsys.readouterr().err.strip().splitlines()  # (the model names no classes: a note says so)
    assert last == "ltmp: interrupted; nothing was written" and all(n.startswith("ltmp: note: ") for n in notes)
    monkeypatch.setattr(ltmp.train, "create_model", interrupt)
    assert main(["--quiet", *TRAIN.format(**ws).split(), "--output", f"{ws['tmp']}/new"]) == 130
    assert capsys.readouterr().err.strip() == (
        "ltmp: interrupted; rerun with --resume to continue from the last checkpoint"
    )


def test_repatching_validates_first_and_keeps_learned_thresholds(ws):
    model = ltmp.load_thresholds(ltmp.runtime.create_model(ws["model"]), ws["T"])
    learned = threshold_tensors(model)
    with pytest.raises(ltmp.LtmpError, match="unknown mask_grad 'bogus'"):
        ltmp.patch(model, "ltmp", mask_grad="bogus")
    assert model.ltmp_config.method == "ltmp"  # still patched, as before the call
    ltmp.patch(model, "ltmp", mask_grad="clamp")
    assert all(torch.equal(v, learned[k]) for k, v in threshold_tensors(model).items())
    ltmp.patch(model, "ltmp", merge_threshold=0.5)  # asked: new merge thresholds, prune thresholds kept
    now = threshold_tensors(model)
    assert now["merge_threshold"].eq(0.5).all() and torch.equal(now["prune_threshold"], learned["prune_threshold"])
    with pytest.raises(ltmp.LtmpError, match="tau is the temperature"):
        ltmp.patch(model, "ltmp", tau=0.0)


def test_non_finite_thresholds_are_never_saved(ws, tmp_path):
    model = ltmp.load_thresholds(ltmp.runtime.create_model(ws["model"]), ws["T"])
    with torch.no_grad():
        ltmp.patching.blocks(model)[2].prune_threshold.fill_(math.inf)
    with pytest.raises(
        ltmp.LtmpError,
        match=r"prune_threshold of block 3 is inf \(not finite\); nothing was "
        r"written to .*lower --lr-merge or --lr-prune",
    ):
        ltmp.save_thresholds(model, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_sixteen_bit_images_are_scaled_and_float_images_skipped(tiny_model, tmp_path, capsys):  # noqa: F811
    levels = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)  # (H, W) a 16-bit ramp
    for split in ("val",):
        (tmp_path / split / "c0").mkdir(parents=True)
        Image.fromarray(levels).save(tmp_path / split / "c0" / "ramp16.png")
        Image.fromarray((levels / 65535).astype(np.float32)).save(tmp_path / split / "c0" / "float.tif")
    rgb = np.asarray(load_rgb(tmp_path / "val" / "c0" / "ramp16.png"))  # (H, W, 3)
    assert rgb.shape == (32, 32, 3) and rgb.dtype == np.uint8
    assert np.abs(rgb[..., 0].astype(int) - np.rint(levels / 257)).max() == 0  # not clipped to white
    assert main(["--quiet", "eval", "--model", tiny_model, "--data-dir", str(tmp_path), "--workers", "0"]) == 0
    assert "1 images, 1 unreadable skipped" in capsys.readouterr().out


def test_local_dir_without_pretrained_loads_the_folder_weights(tiny_model):  # noqa: F811
    a = ltmp.runtime.create_model(tiny_model).state_dict()
    b = ltmp.runtime.create_model(tiny_model, pretrained=True).state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------------------- fuzz

#: each command with the fewest arguments that make it run on the tiny model and data, briefly
BASE = {
    "flops": "--model {model}",
    "train": "--model {model} --data-dir {data} --r-target 0.6 --output {tmp}/f-train --batch-size 8 --workers 0 "
    "--steps 1 --no-eval --no-settle",
    "eval": "--model {model} --data-dir {data} --workers 0 --max-images 3",
    "bench": "--model {model} --method tome --r 2 --batch-size 2 --warmup 0 --reps 1 --rounds 1",
    "viz": "--model {model} --method tome --r 2 --image {data}/val/class0/000.png --output {tmp}/f.png",
    "analyze": "--model {model} --data-dir {data} --val-split val --max-images 3 --workers 0 --kendall-k 2 "
    "--output {tmp}/f-analysis",
    "calibrate": "--model {model} --data-dir {data} --r-target 0.5 --images 4 --output {tmp}/f.safetensors",
    "export": "--model {model} --method tome --r 2 --format torchscript --output {tmp}/f.pt",
    "pareto": "{tmp}/e.json --output {tmp}/f-pareto.png",
    "demo": "--model {model} --data-dir {data} --val-split val --epochs 0.1 --batch-size 8 --max-images 3 --workers 0 "
    "--output {tmp}/f-demo --targets 0.7",
    "pretrain": "--data-dir {data} --val-split val --epochs 1 --batch-size 8 --workers 0 --output {tmp}/f-pretrain",
}
#: a huge value of these means a long run, as asked: the fuzz gives them a small one instead
LONG = {
    "--steps",
    "--epochs",
    "--reps",
    "--rounds",
    "--warmup",
    "--stop-after-epoch",
    "--max-train-images",
    "--images",
    "--max-images",
    "--batch-size",
    "--checkpoint-every",
    "--targets",
}
#: options that take numbers as text (the others that take text take names and paths: one wrong one each)
NUMERIC_TEXT = {"--r", "--k", "--targets"}


def fuzz_cases():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, parser in sub.choices.items():
        for action in parser._actions:
            flag = max(action.option_strings, key=len, default=None)
            if flag is None or action.nargs == 0 or flag == "--help":
                continue
            numeric = action.type is not None or flag in NUMERIC_TEXT
            for value in ("x", "0", "-1", "1000000000000") if numeric else ("0",):
                yield command, flag, "3" if flag in LONG and value == "1000000000000" else value


def test_every_option_of_every_command_fuzzed(tiny_model, tiny_data, tmp_path, capsys, monkeypatch):  # noqa: F811
    """Every option of every command gets a wrong type, a zero, a negative and a huge value: each run succeeds or
    ends with the one-line error (exit 2), never a traceback."""
    monkeypatch.setenv("LTMP_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # relative outputs the fuzz names ("x", "0") land here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny runs: no thread pool to wake
    try:
        (tmp_path / "e.json").write_text(json.dumps({"method": "tome", "gmacs": 0.1, "top1": 50.0}))
        fill = {"model": tiny_model, "data": str(tiny_data), "tmp": str(tmp_path)}
        outcomes = {}
        for command, flag, value in fuzz_cases():
            argv = ["--quiet", command, *BASE[command].format(**fill).split()]
            if flag in argv:  # replace the base value
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
            argv += ["--overwrite"] if command not in ("flops", "demo", "pretrain") and "--overwrite" != flag else []
            code = main(argv)
            err = capsys.readouterr().err
            errors = [line for line in err.splitlines() if line.startswith("ltmp: error: ")]
            assert code in (0, 2), (argv, code, err)
            assert code == 0 or (len(errors) == 1 and "Traceback" not in err), (argv, err)
            outcomes[code] = outcomes.get(code, 0) + 1
    finally:
        torch.set_num_threads(threads)
    assert outcomes[0] > 20 and outcomes[2] > 100, outcomes  # both outcomes are exercised


# ------------------------------------------------------------------------------------- nothing lost, round two


def _one_line(capsys, code: int, words: str) -> None:
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("ltmp: note: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("ltmp: error: ") and words in lines[0], lines[0]


def test_a_second_run_on_a_run_folder_in_use_is_refused(ws, capsys):
    """A run folder is locked while its run lives: a second ltmp train on it stops in one line and changes
    nothing."""
    out = Path(ws["tmp"]) / "busy"
    with ltmp.thresholds.run_folder(out, "train"):  # the first run, alive
        before = snapshot(ws["tmp"])
        code = main(["--quiet", *TRAIN.format(**ws).split(), "--steps", "2", "--output", str(out)])
        _one_line(capsys, code, f"--output {out} is in use by another ltmp train run")
        assert snapshot(ws["tmp"]) == before
    assert main(["--quiet", *TRAIN.format(**ws).split(), "--steps", "2", "--no-eval", "--output", str(out)]) == 0


@pytest.mark.parametrize("case", ["hidden", "missing"])
def test_labels_follow_the_model_class_names(ws, tiny_data, tmp_path, capsys, case):  # noqa: F811
    """A hidden empty folder is left out (and said); a missing class folder, with --labels names, leaves the other
    images labelled by name: each image is judged as on the full data."""
    full = tmp_path / "full.json"
    args = ["--quiet", "eval", "--model", ws["named"], "--workers", "0", "--method", "tome", "--r", "2"]
    assert main([*args, "--data-dir", str(tiny_data), "--json", str(full)]) == 0
    ref = json.loads(full.read_text())["correct"]  # class0, class1, class2: 6 images each
    data = tmp_path / case
    folders = ["class0", "class1", "class2"] if case == "hidden" else ["class0", "class2"]
    for folder in folders:
        (data / "val").mkdir(parents=True, exist_ok=True)
        (data / "val" / folder).symlink_to(tiny_data / "val" / folder)
    if case == "hidden":
        (data / "val" / ".ipynb_checkpoints").mkdir()
    out = tmp_path / f"{case}.json"
    extra = [] if case == "hidden" else ["--labels", "names"]
    capsys.readouterr()
    assert main([*args, "--data-dir", str(data), "--json", str(out), *extra]) == 0
    got = json.loads(out.read_text())["correct"]
    assert got == (ref if case == "hidden" else ref[:6] + ref[12:])
    note = "left out 1 hidden or empty folders" if case == "hidden" else None
    assert note is None or note in capsys.readouterr().err


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "somewhere")


@pytest.mark.parametrize("command", ["eval", "calibrate", "train"])
def test_a_full_disk_is_one_line_and_keeps_the_old_files(ws, capsys, monkeypatch, command):
    args = {
        "eval": f"{EVAL} --method tome --r 2 --json {{T}} --overwrite",
        "calibrate": "calibrate --model {model} --data-dir {data} --r-target 0.5 --images 4 --output {T} --overwrite",
        "train": f"{TRAIN} --steps 2 --no-eval --output {{tmp}}/full",
    }[command]
    before = snapshot(ws["tmp"])
    monkeypatch.setattr(os, "replace", _no_space)  # every atomic write's last step
    code = main(["--quiet", *args.format(**ws).split()])
    _one_line(capsys, code, "No space left on device; free disk space, or write to another disk")
    assert snapshot(ws["tmp"]) == before


def test_an_export_the_disk_cannot_hold_is_refused(ws, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1 << 20))
    before = snapshot(ws["tmp"])
    out = f"{ws['tmp']}/m.pt2"
    code = main(["--quiet", "export", "--model", ws["model"], "--method", "tome", "--r", "2", "--output", out])
    _one_line(capsys, code, "has 1 MiB free and the export needs about")
    assert snapshot(ws["tmp"]) == before


@pytest.mark.parametrize("where", ["file", "unwritable", "home"])
def test_a_cache_that_cannot_be_written_is_one_line(ws, tmp_path, capsys, monkeypatch, where):
    archive = Path(ltmp.__file__).parent / "assets" / "cifar10-subset.tar.gz"
    if where == "home":
        monkeypatch.delenv("LTMP_CACHE")
        monkeypatch.setenv("HOME", unwritable(str(tmp_path)))
    else:
        monkeypatch.setenv("LTMP_CACHE", f"{ws['tmp']}/a-file" if where == "file" else unwritable(str(tmp_path)))
    code = main(["--quiet", "eval", "--model", ws["model"], "--data-dir", str(archive), "--workers", "0"])
    _one_line(capsys, code, "set LTMP_CACHE to a folder you can write")


def test_bench_of_an_export_made_for_another_input_size_is_one_line(ws, tmp_path, capsys):
    import timm
    from timm.models._hub import save_for_hf

    other = tmp_path / "other16"  # the tiny model at 16 pixels
    args = dict(img_size=16, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=3)
    save_for_hf(
        timm.create_model("vit_tiny_patch16_224", **args),
        str(other),
        model_args=args,
        data_config=dict(input_size=(3, 16, 16), crop_pct=1.0, mean=(0.5,) * 3, std=(0.25,) * 3),
    )
    pt2 = tmp_path / "m.pt2"
    export = ["--quiet", "export", "--model", f"local-dir:{other}", "--method", "tome", "--r", "1", "--output"]
    assert main([*export, str(pt2)]) == 0
    capsys.readouterr()
    timing = "--method tome --r 2 --batch-size 2 --warmup 0 --reps 1 --rounds 1".split()
    code = main(["--quiet", "bench", "--model", ws["model"], "--exported", str(pt2), *timing])
    _one_line(capsys, code, f"--exported {pt2} does not run on this model's inputs (3, 32, 32)")


def test_viz_reads_an_image_whose_name_is_not_utf8(ws, tiny_data, tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    name = os.fsdecode(b"caf\xe9.png")  # Latin-1, not UTF-8
    (folder / name).write_bytes((tiny_data / "val" / "class0" / "000.png").read_bytes())
    out = tmp_path / "v.png"
    args = ["--quiet", "viz", "--model", ws["model"], "--method", "tome", "--r", "2", "--image", str(folder)]
    assert main([*args, "--output", str(out)]) == 0 and out.stat().st_size > 0


def test_stale_temporary_files_of_killed_writes_and_unpacks_are_removed(ws, tmp_path):
    """A write or an unpack killed before it finished leaves a temporary file or folder named with its process id;
    the next write of that file, or unpack of that archive, removes it."""
    from ltmp.data import unpack_archive
    from ltmp.thresholds import atomic_write

    dead = 2**22 + 12345  # above any pid this machine hands out
    folder = tmp_path / "writes"
    folder.mkdir()
    (folder / f".x.json.abcd.{dead}.tmp.json").write_text("")
    atomic_write(folder / "x.json", lambda t: Path(t).write_text("{}"))
    assert sorted(p.name for p in folder.iterdir()) == ["x.json"]
    archive = Path(ltmp.__file__).parent / "assets" / "cifar10-subset.tar.gz"
    cache = Path(ws["cache"])
    root = unpack_archive(archive)  # unpacked once
    dest = next(p for p in cache.iterdir() if p.is_dir() and not p.name.count(".tmp"))
    import shutil

    shutil.rmtree(dest)
    (cache / f"{dest.name}.tmp{dead}" / "half").mkdir(parents=True)  # a killed unpack's folder
    assert unpack_archive(archive) == root
    assert sorted(p.name for p in cache.iterdir()) == [dest.name]


@pytest.mark.slow
def test_sigterm_during_training_is_handled_like_ctrl_c(ws, tmp_path):
    """A kill (SIGTERM) before the first checkpoint removes the run folder it created and says what to do, as
    Ctrl-C does."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "killed"
    steps = ["--steps", "1000", "--checkpoint-every", "1000"]  # no checkpoint before the kill
    argv = [sys.executable, "-m", "ltmp", "--quiet", *TRAIN.format(**ws).split(), *steps, "--output", str(out)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (out / "log.jsonl").exists() and time.time() < deadline:  # training has begun
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "ltmp: interrupted; rerun with --resume to continue from the last checkpoint"
    assert not out.exists()
