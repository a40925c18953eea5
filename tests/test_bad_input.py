"""Bad input, table-driven: every user mistake gets one line that names the fix (exit 2, no traceback), and every
file that existed before is still there, byte for byte. Then a fuzz of every option of every command."""

from __future__ import annotations

import argparse
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
        )
    )  # as train() saves it: defaults filled in
    save_checkpoint(model, run / "checkpoint.safetensors", 2, cfg)
    (run / "log.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
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
TRAIN = "train --model {model} --data-dir {data} --r-target 0.6 --batch-size 8 --workers 0"
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

        for module in (ltmp.runtime, ltmp.train):
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
    assert capsys.readouterr().err.strip() == "ltmp: interrupted; nothing was written"
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
