"""ltmp viz / analyze / pareto: pictures and analysis files from the command line, checked against the records."""

from __future__ import annotations

import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from scipy.stats import kendalltau

import ltmp
from conftest import THRESHOLDS
from ltmp.cli import main


def _images(folder, sizes):
    folder.mkdir()
    g = np.random.default_rng(0)
    for i, (h, w) in enumerate(sizes):
        arr = (g.random((h // 8 + 1, w // 8 + 1, 3)) * 255).astype(np.uint8)
        Image.fromarray(arr).resize((w, h), Image.BILINEAR).save(folder / f"img{i}.{'png' if i % 2 else 'jpg'}")
    return folder


def test_viz_draws_a_grid_for_images_of_any_size(tiny_model, tmp_path, capsys):  # noqa: F811
    folder = _images(tmp_path / "imgs", [(32, 32), (50, 70), (200, 120)])
    model = ltmp.patch(timm.create_model(tiny_model, pretrained=True), "ltmp", **THRESHOLDS)
    ltmp.save_thresholds(model, tmp_path / "t.safetensors")
    for extra, name in (
        (["--thresholds", str(tmp_path / "t.safetensors")], "ltmp.png"),
        (["--method", "topk-mp", "--k", "4"], "topk.png"),
    ):
        out = tmp_path / name
        assert (
            main(
                [
                    "--quiet",
                    "viz",
                    "--model",
                    tiny_model,
                    "--pretrained",
                    "--image",
                    str(folder),
                    "--output",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        img = Image.open(out)
        assert img.size[0] > img.size[1] > 100  # a wide grid: input + 3 layers per row, 3 rows
        assert "3 images x 3 layers" in capsys.readouterr().out
    assert (
        main(
            [
                "--quiet",
                "viz",
                "--model",
                tiny_model,
                "--pretrained",
                "--image",
                str(folder / "img1.png"),
                "--method",
                "tome",
                "--r",
                "6",
                "--output",
                str(tmp_path / "one.png"),
            ]
        )
        == 0
    )


def test_viz_bad_input_is_one_line(tiny_model, tmp_path, capsys):  # noqa: F811
    assert (
        main(
            [
                "--quiet",
                "viz",
                "--model",
                tiny_model,
                "--image",
                str(tmp_path / "nope.jpg"),
                "--method",
                "tome",
                "--r",
                "2",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == (
        f"ltmp: error: no such image or folder: {tmp_path / 'nope.jpg'}; pass an image file or a folder of images"
    )
    (tmp_path / "bad.jpg").write_text("not an image")
    assert (
        main(
            [
                "--quiet",
                "viz",
                "--model",
                tiny_model,
                "--image",
                str(tmp_path / "bad.jpg"),
                "--method",
                "tome",
                "--r",
                "2",
            ]
        )
        == 2
    )
    assert "cannot read image" in capsys.readouterr().err
    folder = _images(tmp_path / "imgs", [(32, 32)])
    assert main(["--quiet", "viz", "--model", tiny_model, "--image", str(folder)]) == 2
    assert capsys.readouterr().err.strip() == (
        "ltmp: error: pass --thresholds FILE or a fixed-rate --method (tome, topk-prune, topk-mp) to compare"
    )


def test_analyze_counts_tokens_per_layer_and_kendall_tau_matches_a_direct_computation(tiny_model, tiny_data, tmp_path):  # noqa: F811
    out = tmp_path / "an"
    assert (
        main(
            [
                "--quiet",
                "analyze",
                "--model",
                tiny_model,
                "--pretrained",
                "--data-dir",
                str(tiny_data),
                "--val-split",
                "val",
                "--method",
                "topk-mp",
                "--k",
                "3",
                "--kendall-k",
                "4",
                "--workers",
                "0",
                "--batch-size",
                "5",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    for name in ("layers.png", "layers.json", "kendall.png", "kendall.json"):
        assert (out / name).stat().st_size > 0
    layers = json.loads((out / "layers.json").read_text())
    assert layers["images"] == 18
    # 16 patches: 16 -3 -3 = 10, 10 -3 -3 = 4, then ToMe merges at most half (2) and pruning takes the rest
    assert layers["merged"]["mean"] == [3.0, 3.0, 2.0] and layers["pruned"]["mean"] == [3.0, 3.0, 2.0]
    assert layers["kept"]["median"] == [10.0, 4.0, 0.0]

    # layer 1 by hand from the unpatched timm model: mean column attention vs best cosine similarity of set A
    tau = json.loads((out / "kendall.json").read_text())
    model = timm.create_model(tiny_model, pretrained=True).eval()
    from ltmp import data as ldata

    _, tf, _ = ldata.transforms_for(model, "none")
    ds = ldata.ImageFolder(tiny_data / "val", tf)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.no_grad():
        t = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        blk = model.blocks[0]
        B, N, C = t.shape
        H = blk.attn.num_heads
        q, k, _ = blk.attn.qkv(blk.norm1(t)).reshape(B, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
        probs = ((q * blk.attn.scale) @ k.transpose(-2, -1)).softmax(-1)
        importance = probs.mean(1).mean(1)  # (B, N), eq. 17
        m = torch.nn.functional.normalize(k.mean(1), dim=-1)
        score = (m[:, 2::2] @ m[:, 1::2].transpose(1, 2)).max(-1).values  # set A: even positions past the class token
    taus = [kendalltau(importance[b, 2::2].numpy(), score[b].numpy()).statistic for b in range(B)]
    assert tau["mean"][0] == pytest.approx(float(np.mean(taus)), abs=1e-6)
    assert tau["std"][0] == pytest.approx(float(np.std(taus)), abs=1e-6)  # the spread over images, as computed
    assert tau["images"] == 18 and tau["mean"][1] is not None  # layer 2 keeps 4 set-A candidates per image
    assert tau["mean"][2] is None  # 4 merged + 4 pruned per layer leave no tokens for layer 3


def test_pareto_plots_eval_files_and_rejects_others(tmp_path, capsys):
    files = []
    for i, (method, g, top1) in enumerate(
        [("dense", 1.0, 80.0), ("ltmp", 0.7, 79.5), ("ltmp", 0.5, 78.0), ("tome", 0.7, 79.0)]
    ):
        f = tmp_path / f"e{i}.json"
        f.write_text(json.dumps({"method": method, "gmacs": g, "top1": top1}))
        files.append(str(f))
    assert main(["pareto", *files, "--output", str(tmp_path / "p.png")]) == 0
    assert Image.open(tmp_path / "p.png").size[0] > 200
    points = json.loads((tmp_path / "p.json").read_text())
    assert [(p["method"], p["gmacs"]) for p in points] == [("dense", 1.0), ("ltmp", 0.5), ("ltmp", 0.7), ("tome", 0.7)]
    (tmp_path / "x.json").write_text("{}")
    assert main(["pareto", str(tmp_path / "x.json"), "--output", str(tmp_path / "q.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ltmp: error: {tmp_path / 'x.json'} is not an eval JSON (write one with ltmp eval --json FILE)"
    )
