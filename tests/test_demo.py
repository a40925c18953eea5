"""Calibration, pretraining, visualization and the demo, on tiny models and data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ltmp
from conftest import THRESHOLDS, images, make_model
from ltmp.calibrate import calibrate
from ltmp.cli import main
from ltmp.viz import layer_groups, render_groups


@pytest.mark.parametrize("mode", ["shared", "quantile"])
@pytest.mark.parametrize("method,target", [("ltmp", 0.6), ("ltp", 0.8), ("ltpm", 0.6)])
def test_calibration_hits_the_target_without_training(method, target, mode):
    model = ltmp.patch(make_model("cls", torch.float32), method)
    x = images(16, torch.float32)
    r = calibrate(model, x, target, mode=mode)
    assert abs(r - target) < 0.03, r
    with torch.no_grad():
        model.eval()(x)
    assert abs(float(ltmp.r_flops(model).mean()) - r) < 1e-9
    rec = ltmp.stats(model)
    if mode == "quantile":  # per-layer thresholds; both operations take part
        assert model.ltmp_config.capture is None
        for name, values in ltmp.thresholds.threshold_tensors(model).items():
            assert values.unique().numel() > 1, (name, values)
        assert int(rec.pruned.sum()) > 0
        if method != "ltp":
            assert int(rec.merged.sum()) > 0


@pytest.mark.parametrize("method", ["ltmp", "ltp"])
def test_settle_shifts_trained_thresholds_together_and_says_when_it_cannot(method):
    """One shared shift of the merge thresholds (prune thresholds for ltp) keeps their differences; a target no shift
    can reach is reported as not met."""
    from ltmp.calibrate import mean_eval_r_flops, settle

    model = ltmp.patch(make_model("cls", torch.float32), method, merge_threshold=0.95, prune_threshold=0.0)
    kind = "merge_threshold" if method == "ltmp" else "prune_threshold"
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            getattr(blk, kind).add_(-0.001 * i if method == "ltmp" else 0.001 * i)  # a per-block allocation
    before = ltmp.thresholds.threshold_tensors(model)[kind].clone()
    x = images(16, torch.float32)
    out = settle(model, x, 0.6, tolerance=0.02)
    assert out["met"] and abs(out["r_flops"] - 0.6) <= 0.02 and out["shift"] != 0.0
    assert out["r_flops"] == pytest.approx(mean_eval_r_flops(model, x), abs=1e-9)
    after = ltmp.thresholds.threshold_tensors(model)[kind]
    assert torch.allclose(after - before, torch.full_like(before, out["shift"]), atol=1e-6)  # differences kept
    far = settle(model, x, 0.01)  # keeps one token per block at least: 0.01 is out of reach
    assert not far["met"] and far["r_flops"] > 0.05


def test_layer_groups_match_the_recorded_token_counts():
    model = ltmp.patch(make_model("cls"), "ltmp", trace_source=True, **THRESHOLDS)
    x = images(1)[0]
    groups = layer_groups(model, x)
    rec = ltmp.stats(model)
    assert len(groups) == 3
    for layer, g in enumerate(groups):
        assert g.shape == (8, 8)
        assert len(np.unique(g[g >= 0])) == int(rec.kept[0, layer])
        assert (g < 0).sum() > 0 or rec.pruned[0, : layer + 1].sum() == 0
    pic = render_groups(np.random.rand(32, 32, 3), groups[-1])
    assert pic.shape == (32, 32, 3) and 0 <= pic.min() and pic.max() <= 1


@pytest.mark.slow
def test_pretrain_resumes_to_the_same_weights(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    import ltmp.pretrain as pt

    small = dict(pt.MODEL_ARGS, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    monkeypatch.setattr(pt, "MODEL_ARGS", small)
    common = [
        "--quiet",
        "pretrain",
        "--data-dir",
        str(tiny_data),
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--workers",
        "0",
        "--val-split",
        "val",
    ]
    assert main(common + ["--output", str(tmp_path / "a")]) == 0
    assert main(common + ["--output", str(tmp_path / "b"), "--stop-after-epoch", "1"]) == 0
    assert not (tmp_path / "b" / "model").exists()
    assert main(common + ["--output", str(tmp_path / "b")]) == 0
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in log] == [1, 2]
    cfg = json.loads((tmp_path / "a" / "model" / "config.json").read_text())
    assert cfg["architecture"] == "vit_tiny_patch16_224" and cfg["pretrained_cfg"]["input_size"] == [3, 32, 32]


@pytest.mark.slow
def test_demo_writes_table_plot_and_token_picture(tiny_model, tiny_data, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "demo"
    assert (
        main(
            [
                "--quiet",
                "demo",
                "--model",
                tiny_model,
                "--pretrained",
                "--data-dir",
                str(tiny_data),
                "--val-split",
                "val",
                "--targets",
                "0.6",
                "--epochs",  # 54 steps: SGD's scaled rate at fewer steps would be refused by its first step
                "9",
                "--batch-size",
                "8",
                "--workers",
                "0",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| dense |" in printed and "| ltmp | 0.6 |" in printed and "| tome |" in printed
    for name in ("results.md", "results.json", "accuracy_vs_gmacs.png", "tokens.png"):
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "results.json").read_text())
    ltmp_row = res["rows"][1]
    assert abs(ltmp_row["r_flops"] - 0.6) < 0.1
    assert abs(res["rows"][2]["gmacs"] - ltmp_row["gmacs"]) / ltmp_row["gmacs"] < 0.1
    assert all(r["batch"] == 18 and r["throughput"] > 0 for r in res["rows"])  # all 18 eval images in one batch
    assert res["speed"] in (out / "results.md").read_text() and res["speed"] in printed
    assert res["accuracy"] in printed and res["accuracy"].startswith(
        "Accuracy: LTMP - ToMe at the same GMACs on these 18 images: "
    )


def test_accuracy_sentence_says_whether_the_paired_test_tells_the_difference_from_noise():
    from ltmp.demo import accuracy_sentence

    rows = [
        {"method": "dense", "top1": 70.0},
        {"method": "ltmp", "r_target": "0.7", "top1": 69.0},
        {"method": "tome", "r_target": "(match 0.7)", "top1": 68.5, "mcnemar_p": 0.41},
        {"method": "ltmp", "r_target": "0.5", "top1": 63.7},
        {"method": "tome", "r_target": "(match 0.5)", "top1": 65.4, "mcnemar_p": 0.012},
    ]
    assert accuracy_sentence(rows, 1000, bundled=True) == (
        "Accuracy: LTMP - ToMe at the same GMACs on these 1,000 images: +0.50 points at r_target 0.7 (paired "
        "p=0.41, within noise); -1.70 points at r_target 0.5 (paired p=0.012, a real difference). The same "
        "comparison on all 10,000 CIFAR-10 test images: docs/results.md."
    )
    assert accuracy_sentence(rows[:3], 18).endswith("(paired p=0.41, within noise).")


def test_speed_sentence_follows_the_numbers():
    from ltmp.demo import speed_sentence

    def row(ms, ips):
        return {"latency_ms": ms, "throughput": ips, "batch": 64}

    rows = [row(10.0, 100.0), row(12.5, 150.0), row(20.0, 120.0)]  # slower at batch 1, faster at batch 64
    assert speed_sentence(rows, "cpu, 2 threads") == (
        "Speed here (cpu, 2 threads): at batch 1 every reduced model is slower than dense (0.50-0.80x its speed); "
        "at batch 64 every reduced model is faster than dense (1.20-1.50x its throughput)."
    )
    mixed = speed_sentence([row(10.0, 100.0), row(5.0, 90.0), row(20.0, 80.0)], "cuda:0, 16 threads")
    assert "at batch 1 1 of 2 reduced models are faster than dense (0.50-2.00x" in mixed


def test_bundled_assets_load_and_fit_the_size_budget():
    from ltmp.demo import BUNDLED_DATA, BUNDLED_MODEL, assets

    total = sum(p.stat().st_size for p in assets().rglob("*") if p.is_file())
    assert total < 10e6
    model = ltmp.runtime.create_model(BUNDLED_MODEL, pretrained=True)
    shared = load_file(str(assets() / "vit-cifar10" / "model.safetensors"))
    assert all(v.dtype == torch.float16 for v in shared.values())
    assert model.patch_embed.num_patches == 64
    import tarfile

    with tarfile.open(BUNDLED_DATA) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    assert sum(n.startswith("train/") for n in names) == 4000 and sum(n.startswith("test/") for n in names) == 1000


@pytest.mark.parametrize("mode", ["shared", "quantile"])
def test_calibrate_cli_writes_thresholds_that_hit_the_target(
    tiny_model,
    tiny_data,
    tmp_path,
    mode,  # noqa: F811
    capsys,
):
    out = tmp_path / "t.safetensors"
    assert (
        main(
            [
                "calibrate",
                "--model",
                tiny_model,
                "--pretrained",
                "--data-dir",
                str(tiny_data),
                "--r-target",
                "0.6",
                "--mode",
                mode,
                "--images",
                "40",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "r_FLOPs" in capsys.readouterr().out
    model = ltmp.load_thresholds(ltmp.runtime.create_model(tiny_model, pretrained=True), out)
    from ltmp.calibrate import calibration_batch

    x = calibration_batch(model, tiny_data / "train", 40, 0)
    assert len(x) == 40
    with torch.no_grad():
        model.eval()(x)
    assert abs(float(ltmp.r_flops(model).mean()) - 0.6) < 0.05
    assert main(["calibrate", "--model", tiny_model, "--r-target", "1.5", "--output", str(out)]) == 2
