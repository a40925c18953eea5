"""The ltmp command line: train, resume, data-parallel training, eval, and one-line errors on bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import timm
import torch

import ltmp
from conftest import TINY_ARGS
from ltmp.bench import allocator
from ltmp.cli import build_parser, main, train_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train_args(model, data, out, *extra):
    return [
        "--quiet",
        "train",
        "--model",
        model,
        "--pretrained",
        "--data-dir",
        str(data),
        "--output",
        str(out),
        "--r-target",
        "0.6",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--lr-prune",
        "5e-3",
        "--lr-merge",  # (SGD's default, scaled to a few steps, is refused by its first step: test_bad_input.py)
        "0.05",
        *extra,
    ]


#: ``ltmp train --recipe paper`` with the required options (parsed, not run)
PAPER = ["train", "--model", "m", "--data-dir", "d", "--output", "o", "--r-target", "0.5", "--recipe", "paper"]


def collapsing_args(model, data, out, *extra):
    """:func:`train_args` with an Adam prune step so large that block 1 prunes every patch token from step 2 on."""
    args = train_args(model, data, out, "--steps", "20", "--optimizer", "adam", *extra)
    args[args.index("5e-3")], args[args.index("0.6")] = "1e4", "0.2"
    return args


def thresholds_of(path) -> dict[str, float]:
    tensors, _ = ltmp.read_thresholds(path)
    return {f"{k}.{i}": float(v) for k, t in tensors.items() for i, v in enumerate(t)}


def test_train_writes_thresholds_config_log_and_eval(tiny_model, tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(tiny_model, tiny_data, out, "--steps", "5")) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        ".ltmp-run",
        "config.json",
        "eval.json",
        "log.jsonl",
        "thresholds.safetensors",
    ]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4, 5]
    assert {"loss", "r_flops", "images_per_s"} <= set(log[0])
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["optimizer"], cfg["lr_merge"], cfg["merge_init"]) == ("sgd", 0.05, 1.0)  # as given, or the default
    assert cfg["lr_prune"] == 5e-3 and cfg["total_steps"] == 5 and cfg["data_config"]["input_size"] == [3, 32, 32]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["images"] == 18 and len(ev["per_layer"]) == 3
    first = log[0]["merge"]
    assert thresholds_of(out / "thresholds.safetensors")["merge_threshold.0"] != pytest.approx(1.0)
    assert first[0] != 1.0
    assert "thresholds:" in capsys.readouterr().out


def test_train_settles_the_budget_on_held_out_images(tiny_model, tiny_data, tmp_path, capsys):
    """3 steps miss r_target 0.6; by default one shared shift of the merge thresholds meets it (within 0.01) on the
    clean held-out images, which eval.json then reports; --no-settle keeps the trained thresholds."""
    settled, kept = tmp_path / "settled", tmp_path / "kept"
    assert main(train_args(tiny_model, tiny_data, settled, "--steps", "3", "--holdout", "0.25")) == 0
    assert "settle: r_FLOPs" in capsys.readouterr().out
    assert main(train_args(tiny_model, tiny_data, kept, "--steps", "3", "--holdout", "0.25", "--no-settle")) == 0
    ev_s, ev_k = (json.loads((d / "eval.json").read_text()) for d in (settled, kept))
    st = ev_s["settle"]
    assert st["on"] == "12 held-out training images" and "settle" not in ev_k
    assert abs(ev_k["r_flops"] - 0.6) > 0.01 and st["r_flops_trained"] == pytest.approx(ev_k["r_flops"], abs=1e-6)
    assert abs(ev_s["r_flops"] - 0.6) <= 0.01 and ev_s["r_flops"] == pytest.approx(st["r_flops"], abs=1e-6)
    meta = ltmp.read_thresholds(settled / "thresholds.safetensors")[1]
    assert float(meta["r_flops_trained"]) == st["r_flops_trained"] and float(meta["r_flops_settled"]) == st["r_flops"]
    th_s, th_k = thresholds_of(settled / "thresholds.safetensors"), thresholds_of(kept / "thresholds.safetensors")
    for name, value in th_k.items():  # merge thresholds move together (clamped to [-1, 1]), prune ones stay
        moved = max(-1.0, min(1.0, value + st["shift"])) if name.startswith("merge") else value
        assert th_s[name] == pytest.approx(moved, abs=1e-6), name


def test_optimizer_defaults_fill_only_what_is_not_given():
    """The default of every method, SGD, has the paper's merge learning rate on its one ImageNet epoch
    (9809 steps of 128) and moves the merge thresholds as far in a run of any other length; its prune learning rate
    steps in the same units of the scores' spread (lr_merge times the squared ratio of the spreads). Adam's are
    per step. A value given is kept."""
    from ltmp.train import TrainConfig, needs_spreads, resolve

    base = dict(model="m", data_dir="d", output="o", r_target=0.5)
    spreads = {"merge_threshold": 0.1, "prune_threshold": 0.02}  # prune steps (0.02 / 0.1)^2 = 1/25 of merge's
    paper = resolve(TrainConfig(**base), steps=9809, spreads=spreads)
    assert (paper.optimizer, paper.lr_merge, paper.merge_init) == ("sgd", 5e-3, 1.0)
    assert paper.lr_prune == pytest.approx(5e-3 / 25, rel=1e-12)
    cifar = resolve(TrainConfig(**base, merge_init=0.9), steps=351, spreads=spreads)  # 1/28 of the paper's steps
    assert (cifar.lr_merge, cifar.lr_prune) == pytest.approx((0.1397, 0.1397 / 25), rel=1e-3)
    assert cifar.merge_init == 0.9
    given = resolve(TrainConfig(**base, lr_merge=0.01), steps=351, spreads=spreads)  # the ratio keeps a given rate
    assert (given.lr_merge, given.lr_prune) == pytest.approx((0.01, 0.01 / 25), rel=1e-12)
    assert resolve(TrainConfig(**base), steps=351).lr_prune is None  # before the spreads are measured
    unknown = resolve(TrainConfig(**base))  # before the run's length is known
    assert (unknown.lr_merge, unknown.lr_prune, unknown.merge_init) == (None, None, 1.0)
    assert needs_spreads(TrainConfig(**base)) and not needs_spreads(TrainConfig(**base, lr_prune=1e-4))
    adam = resolve(TrainConfig(**base, optimizer="adam", lr_prune=1e-3), steps=351)
    assert (adam.lr_merge, adam.lr_prune, adam.merge_init) == (2e-3, 1e-3, 1.0)
    assert not needs_spreads(TrainConfig(**base, optimizer="adam"))
    ltp = resolve(TrainConfig(**base, method="ltp"), steps=351, spreads=spreads)  # learned pruning alone: SGD too
    assert (ltp.optimizer, ltp.lr_prune) == ("sgd", pytest.approx(0.1397 / 25, rel=1e-3))
    assert resolve(TrainConfig(**base, method="ltp", optimizer="sgd", lr_prune=5e-6), steps=9809).lr_prune == 5e-6
    assert [resolve(TrainConfig(**base, method=m)).optimizer for m in ("ltmp", "ltpm", "ltm", "ltp")] == ["sgd"] * 4


def test_paper_recipe_trains_and_records_every_point(tiny_model, tiny_data, tmp_path):
    """``--recipe paper`` trains with the reference code's recipe (docs/training.md) and says so in config.json;
    its thresholds stay in [0, 1] and it does not settle."""
    from ltmp.options import RECIPES

    out = tmp_path / "paper"
    args = [
        a
        for a in train_args(tiny_model, tiny_data, out, "--steps", "3", "--recipe", "paper", "--no-eval")
        if a not in ("--lr-prune", "5e-3", "--lr-merge", "0.05")
    ]  # the recipe's own learning rates
    assert main(args) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["recipe"] == "paper" and all(cfg[k] == v for k, v in RECIPES["paper"].items() if k != "batch_size")
    th = thresholds_of(out / "thresholds.safetensors")
    assert all(0.0 <= v <= 1.0 for v in th.values())
    meta = ltmp.read_thresholds(out / "thresholds.safetensors")[1]
    assert "r_flops_settled" not in meta


def test_distill_mixes_label_and_teacher_terms(tiny_model, tiny_data, tmp_path, capsys):
    """--distill W: task loss (1 - W) CE + W KL(unreduced || reduced); the teacher is the same weights unreduced,
    so the KL is 0 while nothing is removed (step 1, from merge 1.0 and prune 0) and positive once tokens go."""
    out = tmp_path / "run"
    assert main(train_args(tiny_model, tiny_data, out, "--steps", "6", "--no-eval", "--distill", "0.5")) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[0]["r_flops"] == pytest.approx(1.0) and log[0]["task"] == pytest.approx(0.5 * log[0]["ce"], rel=1e-5)
    assert json.loads((out / "config.json").read_text())["distill"] == 0.5
    merged = tmp_path / "merged"  # merge threshold 0.3: most tokens merge from step 1 on, and the outputs part
    assert (
        main(
            train_args(
                tiny_model, tiny_data, merged, "--steps", "1", "--no-eval", "--distill", "1", "--merge-init", "0.3"
            )
        )
        == 0
    )
    first = json.loads((merged / "log.jsonl").read_text().splitlines()[0])
    assert first["r_flops"] < 0.8 and first["task"] > 1e-7  # (a random tiny model: its outputs barely change)
    assert main(train_args(tiny_model, tiny_data, tmp_path / "bad", "--distill", "2")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "ltmp: error: argument --distill: must lie in [0, 1], got 2 (see: ltmp train --help)"
    )


def test_distill_loss_is_kl_from_the_teacher():
    from ltmp.train import distill_loss

    student = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    teacher = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    p, q = teacher.softmax(-1), student.softmax(-1)
    by_hand = (p * (p.log() - q.log())).sum(-1).mean()  # row 2 is identical: KL 0
    assert float(distill_loss(student, teacher)) == pytest.approx(float(by_hand), rel=1e-6)


def test_eval_json_has_stable_keys_and_fixed_rate_baselines(tiny_model, tiny_data, tmp_path):
    run = tmp_path / "run"
    assert main(train_args(tiny_model, tiny_data, run, "--steps", "3", "--no-eval", "--optimizer", "sgd")) == 0
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    common = [
        "--quiet",
        "eval",
        "--model",
        tiny_model,
        "--pretrained",
        "--data-dir",
        str(tiny_data),
        "--workers",
        "0",
        "--batch-size",
        "5",
    ]
    assert main(common + ["--thresholds", str(run / "thresholds.safetensors"), "--json", str(a)]) == 0
    res = json.loads(a.read_text())
    for key in (
        "schema_version",
        "top1",
        "top5",
        "images",
        "gmacs",
        "gmacs_dense",
        "gmacs_ratio",
        "gmacs_executed",
        "r_flops",
        "per_layer",
        "method",
        "model",
    ):
        assert key in res, key
    assert res["images"] == 18 and res["method"] == "ltmp"
    assert set(res["per_layer"][0]) == {"merged", "pruned", "kept"}
    assert res["gmacs_executed"] >= res["gmacs"] - 1e-12
    assert main(common + ["--method", "tome", "--r", "2,1,0", "--json", str(b), "--compare", str(a)]) == 0
    res_b = json.loads(b.read_text())
    assert res_b["rate"] == [2, 1, 0] and [round(x["merged"]) for x in res_b["per_layer"]] == [2, 1, 0]
    only_a = sum(x == "1" and y == "0" for x, y in zip(res_b["correct"], res["correct"]))  # tome right, ltmp wrong
    only_b = sum(x == "0" and y == "1" for x, y in zip(res_b["correct"], res["correct"]))
    from scipy.stats import binomtest

    p_by_hand = 1.0 if only_a + only_b == 0 else binomtest(only_a, only_a + only_b, 0.5).pvalue
    assert (res_b["paired_test"]["only_a_correct"], res_b["paired_test"]["only_b_correct"]) == (only_a, only_b)
    assert res_b["paired_test"]["p_value"] == pytest.approx(p_by_hand, rel=1e-9)
    assert main(common + ["--method", "tome", "--match", str(a), "--json", str(c)]) == 0
    res_c = json.loads(c.read_text())
    dense = main(common + ["--method", "dense"])
    assert dense == 0
    assert abs(res_c["gmacs"] - res["gmacs"]) <= abs(res_b["gmacs"] - res["gmacs"]) + 1e-12
    for method in ("topk-prune", "topk-mp"):  # --match picks the schedule of the named fixed-rate method
        d = tmp_path / f"{method}.json"
        assert main(common + ["--method", method, "--match", str(a), "--json", str(d)]) == 0
        res_d = json.loads(d.read_text())
        assert res_d["method"] == method and sum(x["pruned"] for x in res_d["per_layer"]) > 0
        spec = ltmp.vit_spec(timm.create_model(tiny_model))
        assert res_d["rate"] == ltmp.flops.rate_schedule(spec, res["gmacs"], method)


def test_constraint_budget_raises_its_multiplier_by_dual_ascent(tiny_model, tiny_data, tmp_path):
    """--budget constraint: after each step mu grows by 2 lambda (r - r_target) of that step's batch."""
    out = tmp_path / "run"
    assert main(train_args(tiny_model, tiny_data, out, "--steps", "5", "--no-eval", "--budget", "constraint")) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    mu = 0.0
    for entry in log:
        mu += 2 * 10.0 * (entry["r_flops"] - 0.6)
        assert entry["mu"] == pytest.approx(mu, rel=1e-9, abs=1e-12)
    assert abs(mu) > 0.1
    penalty = tmp_path / "penalty"
    assert main(train_args(tiny_model, tiny_data, penalty, "--steps", "5", "--no-eval")) == 0
    assert thresholds_of(penalty / "thresholds.safetensors") != thresholds_of(out / "thresholds.safetensors")


def test_thresholds_stay_within_the_range_of_their_scores(tiny_model, tiny_data, tmp_path):
    """Steps far too large for the scores still leave merge thresholds in [-1, 1] (cosine similarities) and prune
    thresholds in [0, 1] (mean column attention), where the surrogate gradient can bring them back."""
    out = tmp_path / "run"
    args = train_args(tiny_model, tiny_data, out, "--steps", "2", "--no-eval", "--lr-merge", "1e4", "--no-settle")
    args[args.index("5e-3")] = "1e4"
    args += ["--optimizer", "adam"]  # (SGD refuses a first step this large: test_bad_input.py)
    assert main(args) == 0
    th = thresholds_of(out / "thresholds.safetensors")
    merge = [v for k, v in th.items() if k.startswith("merge")]
    prune = [v for k, v in th.items() if k.startswith("prune")]
    assert all(-1 <= v <= 1 for v in merge) and all(0 <= v <= 1 for v in prune), th
    assert {-1.0, 1.0} & set(merge) and {0.0, 1.0} & set(prune), th  # the steps did reach a bound


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tiny_model, tiny_data, tmp_path):
    """Also the budget multiplier (--budget constraint) and Adam's moments resume: without them the thresholds
    would differ."""
    full, broken = tmp_path / "full", tmp_path / "broken"
    args = [
        "--steps",
        "12",
        "--checkpoint-every",
        "2",
        "--no-eval",
        "--augment",
        "timm",
        "--budget",
        "constraint",
        "--optimizer",
        "adam",
        "--lr-merge",
        "1e-2",
    ]
    assert main(train_args(tiny_model, tiny_data, full, *args)) == 0
    cmd = [sys.executable, "-m", "ltmp"] + train_args(tiny_model, tiny_data, broken, *args)
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = broken / "checkpoint.safetensors"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists():
            from safetensors import safe_open

            try:
                with safe_open(str(ckpt), "pt") as f:
                    if int(f.metadata()["step"]) >= 4:
                        break
            except Exception:
                pass
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (broken / "thresholds.safetensors").exists()
    assert main(train_args(tiny_model, tiny_data, broken, *args, "--resume")) == 0
    a, b = thresholds_of(full / "thresholds.safetensors"), thresholds_of(broken / "thresholds.safetensors")
    assert a == b
    steps = [json.loads(line)["step"] for line in (broken / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))


@pytest.mark.slow
def test_two_process_training_matches_one_process(tiny_model, tiny_data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["--steps", "4", "--no-eval"]
    assert main(train_args(tiny_model, tiny_data, one, *args)) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ltmp"]
    res = subprocess.run(
        cmd + train_args(tiny_model, tiny_data, two, *args), env=ENV, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = thresholds_of(one / "thresholds.safetensors"), thresholds_of(two / "thresholds.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-6, (k, a[k], b[k])
    assert a != {k: (0.9 if "merge" in k else 0.0) for k in a}, "thresholds must have moved"


def run_cli(args, capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err
    return code, err


def test_bad_eval_json_and_targets_get_one_line_errors(tiny_model, tiny_data, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    common = ["--quiet", "eval", "--model", tiny_model, "--pretrained", "--data-dir", str(tiny_data), "--workers", "0"]
    assert main(common + ["--method", "tome", "--match", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ltmp: error: --match {bad}: cannot read it as JSON (JSONDecodeError); "
        "pass an eval.json written by ltmp eval --json or ltmp train"
    )
    bad.write_text("{}")
    assert main(common + ["--method", "tome", "--r", "2", "--compare", str(bad)]) == 2
    assert "has no 'gmacs'; pass an eval.json" in capsys.readouterr().err
    assert main(["--quiet", "demo", "--targets", "0.7,x", "--output", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip() == (
        "ltmp: error: --targets takes comma-separated numbers such as 0.7,0.5, got '0.7,x'"
    )


def test_unexpected_errors_keep_their_traceback(tiny_model, monkeypatch):
    """Only the user mistakes ltmp names (LtmpError) become one-line errors; a bug anywhere else propagates."""
    import ltmp.runtime

    def bug(*args, **kwargs):
        raise ValueError("a library bug, not a user mistake")

    monkeypatch.setattr(ltmp.runtime, "create_model", bug)
    with pytest.raises(ValueError, match="a library bug"):
        main(["flops", "--model", tiny_model])


@pytest.mark.parametrize(
    "case",
    [
        "unknown-model",
        "missing-dir",
        "empty-dir",
        "r-target",
        "other-model",
        "corrupt-checkpoint",
        "corrupt-thresholds",
        "collapse",
    ],
)
def test_bad_input_gets_one_line_error(case, tiny_model, tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    if case == "unknown-model":
        args = train_args("vit_does_not_exist", tiny_data, out)
        expect = "unknown model 'vit_does_not_exist'"
    elif case == "missing-dir":
        args = train_args(tiny_model, tmp_path / "nope", out)
        expect = "does not exist; pass --data-dir DIR"
    elif case == "empty-dir":
        (tmp_path / "empty" / "train").mkdir(parents=True)
        args = train_args(tiny_model, tmp_path / "empty", out)
        expect = "no images found in"
    elif case == "r-target":
        args = train_args(tiny_model, tiny_data, out)
        args[args.index("0.6")] = "1.5"
        expect = r"argument --r-target: must lie in (0, 1], got 1.5"
    elif case == "other-model":
        other = ltmp.patch(timm.create_model("vit_tiny_patch16_224", **{**TINY_ARGS, "depth": 2}), "ltmp")
        ltmp.save_thresholds(other, tmp_path / "t.safetensors")
        args = [
            "eval",
            "--model",
            tiny_model,
            "--pretrained",
            "--data-dir",
            str(tiny_data),
            "--thresholds",
            str(tmp_path / "t.safetensors"),
            "--json",
            str(out / "eval.json"),
        ]
        expect = "were made for another model"
    elif case == "corrupt-checkpoint":
        (tmp_path / "w.pth").write_bytes(b"not a checkpoint")
        args = train_args(tiny_model, tiny_data, out, "--checkpoint", str(tmp_path / "w.pth"))
        expect = "cannot load checkpoint"
    elif case == "collapse":
        args = collapsing_args(tiny_model, tiny_data, out)
        expect = (
            "training stopped at step 11: block 1 removed every patch token of every image for 10 steps in a "
            "row (merge threshold "
        )
    else:
        (tmp_path / "t.safetensors").write_bytes(b"\x01\x02garbage")
        args = [
            "eval",
            "--model",
            tiny_model,
            "--pretrained",
            "--data-dir",
            str(tiny_data),
            "--thresholds",
            str(tmp_path / "t.safetensors"),
        ]
        expect = "cannot read thresholds file"
    code, err = run_cli(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ltmp: error: ") and expect in lines[0], err
    assert "Traceback" not in err
    assert not (out / "thresholds.safetensors").exists() and not (out / "eval.json").exists()


def test_no_stop_collapsed_trains_through_a_collapsed_block(tiny_model, tiny_data, tmp_path, capsys):
    """The run that test_bad_input_gets_one_line_error stops at step 11 (block 1 removes every patch token from
    step 2 on) trains all its steps with --no-stop-collapsed, as the reference code would, and writes its
    thresholds; --recipe paper turns the stop off the same way."""
    out = tmp_path / "run"
    args = collapsing_args(tiny_model, tiny_data, out, "--no-stop-collapsed", "--no-eval", "--no-settle")
    code, err = run_cli(args, capsys)
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps[-1] == 20 and (out / "thresholds.safetensors").exists()
    assert train_config(build_parser().parse_args(PAPER)).stop_collapsed is False


def test_no_check_first_step_takes_a_step_past_the_range(tiny_model, tiny_data, tmp_path, capsys):
    """An SGD merge rate whose first step would throw the thresholds past their scores' range is refused in one
    line; --no-check-first-step (and --recipe paper, as the reference code) takes the step, and the clamp keeps every
    threshold inside the range."""
    sgd = ("--optimizer", "sgd", "--steps", "2", "--no-eval", "--no-settle")
    args = train_args(tiny_model, tiny_data, tmp_path / "refused", *sgd)
    args[args.index("0.05")] = "1e4"
    code, err = run_cli(args, capsys)
    assert code == 2 and "more than its scores' whole range [-1, 1]" in err and "give a smaller --lr-merge" in err
    assert not (tmp_path / "refused" / "thresholds.safetensors").exists()
    out = tmp_path / "taken"
    args = train_args(tiny_model, tiny_data, out, *sgd, "--no-check-first-step")
    args[args.index("0.05")] = "1e4"
    code, err = run_cli(args, capsys)
    assert code == 0, err
    merge = [v for k, v in thresholds_of(out / "thresholds.safetensors").items() if k.startswith("merge")]
    assert merge and all(-1 <= v <= 1 for v in merge) and any(abs(v) == 1 for v in merge), merge
    assert train_config(build_parser().parse_args(PAPER)).check_first_step is False
    assert train_config(build_parser().parse_args(PAPER[:-2])).check_first_step is True


def test_unreadable_images_are_skipped_and_counted(tiny_model, tiny_data, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    (data / "val" / "class0" / "broken.png").write_bytes(b"this is not a png")
    out = tmp_path / "e.json"
    assert (
        main(
            [
                "--quiet",
                "eval",
                "--model",
                tiny_model,
                "--pretrained",
                "--data-dir",
                str(data),
                "--workers",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["images"] == 18 and res["skipped"] == 1
    assert "1 unreadable skipped" in capsys.readouterr().out


def test_cifar_layout_tarball_is_used_directly(tiny_model, tiny_data, tmp_path, monkeypatch):
    import tarfile

    monkeypatch.setenv("LTMP_CACHE", str(tmp_path / "cache"))
    archive = tmp_path / "tiny.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tiny_data / "train", arcname="train")
        tar.add(tiny_data / "val", arcname="test")
    out = tmp_path / "e.json"
    assert (
        main(
            [
                "--quiet",
                "eval",
                "--model",
                tiny_model,
                "--pretrained",
                "--data-dir",
                str(archive),
                "--val-split",
                "test",
                "--workers",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["images"] == 18


def test_amp_eval_matches_fp32(tiny_model, tiny_data, tmp_path):
    """bf16 autocast changes logits slightly: the same token counts (ToMe's are fixed), and top-1 within 2 of the
    18 images of fp32's."""
    runs = {}
    for name, extra in (("fp32", []), ("amp", ["--amp"])):
        out = tmp_path / f"{name}.json"
        assert (
            main(
                [
                    "--quiet",
                    "eval",
                    "--model",
                    tiny_model,
                    "--pretrained",
                    "--data-dir",
                    str(tiny_data),
                    "--workers",
                    "0",
                    "--method",
                    "tome",
                    "--r",
                    "3",
                    "--json",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        runs[name] = json.loads(out.read_text())
    assert runs["amp"]["images"] == 18 and runs["amp"]["per_layer"] == runs["fp32"]["per_layer"]
    differ = sum(a != b for a, b in zip(runs["amp"]["correct"], runs["fp32"]["correct"]))
    assert differ <= 2, (runs["amp"]["correct"], runs["fp32"]["correct"])


def test_amp_training_and_holdout(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "run"
    assert main(train_args(tiny_model, tiny_data, out, "--steps", "3", "--amp", "--holdout", "0.25")) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor([e["loss"], e["r_flops"]])).all() for e in log)
    assert all(abs(v) < 10 for e in log for v in e["merge"] + e["prune"])
    ev = json.loads((out / "eval.json").read_text())
    assert ev["images"] == 12  # 25% of the 48 training images, not the val split
    assert json.loads((out / "config.json").read_text())["train_images"] == 36


def test_bench_reports_time_and_gmacs_ratios(tiny_model, tiny_data, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--model",
                tiny_model,
                "--pretrained",
                "--method",
                "tome",
                "--r",
                "4",
                "--batch-size",
                "4",
                "--data-dir",
                str(tiny_data),
                "--reps",
                "2",
                "--rounds",
                "1",
                "--warmup",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert [r["batch_size"] for r in res["runs"]] == [1, 4]
    for r in res["runs"]:
        lo, hi = r["time_ratio_iqr"]  # the median of the repetitions' paired ratios lies between their quartiles
        assert r["time_ratio"] > 0 and lo <= r["time_ratio"] <= hi
        assert 0 < r["gmacs_ratio"] < 1 and r["gmacs_executed_ratio"] >= r["gmacs_ratio"] - 1e-12
    assert {"device", "threads", "gmacs_dense"} <= set(res) and res["inputs"] == str(tiny_data)
    printed = capsys.readouterr()
    assert "time ratio" in printed.out
    assert res["allocator"] == allocator() and f"torch {torch.__version__}, {allocator()}" in printed.out  # CPU
    assert ("MALLOC_MMAP_THRESHOLD_=4294967296" in printed.err) == (allocator() == "glibc malloc (defaults)")


def test_bench_on_random_inputs_says_so_for_learned_thresholds(tiny_model, tmp_path, capsys):
    thresholds = tmp_path / "t.safetensors"
    ltmp.save_thresholds(ltmp.patch(timm.create_model(tiny_model, pretrained=True), "ltmp"), thresholds)
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--model",
                tiny_model,
                "--pretrained",
                "--thresholds",
                str(thresholds),
                "--batch-size",
                "2",
                "--reps",
                "1",
                "--rounds",
                "1",
                "--warmup",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "ltmp: note: timing on random inputs (no --data-dir)" in capsys.readouterr().err
    assert json.loads(out.read_text())["inputs"] == "random"


def test_resume_refuses_changed_settings_and_overwrite_drops_the_checkpoint(tiny_model, tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--steps", "6", "--checkpoint-every", "2", "--no-eval"]
    assert main(train_args(tiny_model, tiny_data, out, *args)) == 0
    # fake an interrupted run: a checkpoint left behind, no final thresholds
    from ltmp.train import TrainConfig, save_checkpoint

    model = ltmp.load_thresholds(timm.create_model(tiny_model, pretrained=True), out / "thresholds.safetensors")
    cfg = TrainConfig(
        model=tiny_model,
        data_dir=str(tiny_data),
        output=str(out),
        r_target=0.6,
        pretrained=True,
        batch_size=8,
        steps=6,
        checkpoint_every=2,
        workers=0,
        lr_prune=5e-3,
        eval_after=False,
    )
    save_checkpoint(model, out / "checkpoint.safetensors", 2, cfg)
    (out / "thresholds.safetensors").unlink()
    bad = train_args(tiny_model, tiny_data, out, *args, "--resume")
    bad[bad.index("8")] = "4"  # another batch size
    code, err = run_cli(bad, capsys)
    assert code == 2 and "started with batch_size=8, not 4" in err
    code, err = run_cli(train_args(tiny_model, tiny_data, out, *args), capsys)  # a rerun keeps the checkpoint
    assert code == 2 and "holds an interrupted run; resume it with --resume, or pass --overwrite" in err
    assert (out / "checkpoint.safetensors").exists()
    assert main(train_args(tiny_model, tiny_data, out, *args, "--overwrite")) == 0  # asked: start over
    assert not (out / "checkpoint.safetensors").exists()
    assert [json.loads(ln)["step"] for ln in (out / "log.jsonl").read_text().splitlines()] == list(range(1, 7))


@pytest.mark.slow
def test_compile_flags_compile_both_models_and_train_learns_the_same_thresholds(
    tiny_model, tiny_data, tmp_path, monkeypatch
):
    """--compile goes through torch.compile (here with Dynamo's "eager" backend, for speed): bench compiles the dense
    model and ToMe (a fixed rate) as single graphs with static shapes; a compiled training run ends where the eager
    one does."""
    import torch._dynamo.config as dynamo_config

    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with dynamo_config.patch(**{limit: getattr(dynamo_config, limit)}):  # compile_model raises it: restore after
        _check_compile_flags(tiny_model, tiny_data, tmp_path, monkeypatch, dynamo_config, limit)


def _check_compile_flags(tiny_model, tiny_data, tmp_path, monkeypatch, dynamo_config, limit):
    calls = []
    real = torch.compile

    def spy(model, dynamic=None, fullgraph=False, mode=None, **kw):
        calls.append((type(getattr(model, "module", model)).__name__, dynamic, fullgraph, mode))
        return real(model, dynamic=dynamic, fullgraph=fullgraph, backend="eager")

    monkeypatch.setattr(torch, "compile", spy)
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "--quiet",
                "bench",
                "--model",
                tiny_model,
                "--pretrained",
                "--method",
                "tome",
                "--r",
                "4",
                "--batch-size",
                "4",
                "--data-dir",
                str(tiny_data),
                "--reps",
                "1",
                "--rounds",
                "1",
                "--warmup",
                "1",
                "--compile",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["compiled"] is True
    assert calls == [("VisionTransformer", False, True, None), ("LTMPVisionTransformer", False, True, None)]
    assert getattr(dynamo_config, limit) >= 64
    args = ["--steps", "3", "--no-eval", "--seed", "3"]
    assert main(train_args(tiny_model, tiny_data, tmp_path / "eager", *args)) == 0
    assert main(train_args(tiny_model, tiny_data, tmp_path / "compiled", *args, "--compile")) == 0
    assert calls[-1] == ("LTMPVisionTransformer", False, False, None)  # train mode: static shapes, may break
    eager = thresholds_of(tmp_path / "eager" / "thresholds.safetensors")
    compiled = thresholds_of(tmp_path / "compiled" / "thresholds.safetensors")
    assert any(v != 0.0 for k, v in eager.items() if k.startswith("prune"))  # the 3 steps moved the thresholds
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)


def test_bare_ltmp_prints_its_commands_and_exits_zero(capsys):
    """``ltmp`` with no command is a request for help, not a run: it lists the commands and exits 0."""
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ltmp")
    for command in ("train", "eval", "bench", "demo", "export"):
        assert command in out
