"""Threshold gradients of ltmp beside the paper's reference implementation (issue #16).

``../shared/reference/official-gradients.json`` holds, for six threshold settings, the per-block threshold
gradients of the reference code (github Mxbonn/ltmp, timm 0.9.5) on one fixed batch of 128 CIFAR-10 training
images, split into the cross-entropy part and the budget part (lambda 10, r_target 0.5, tau 0.1). This script
rebuilds that batch, runs the same settings through ``ltmp.patch`` in train mode, and prints our gradients beside
the reference's, block by block, with the share of entries that agree (same sign, within a factor of 2, among
entries with |reference| > 1e-2).

    python benchmarks/gradient_parity.py                       # the defaults of ltmp.patch
    python benchmarks/gradient_parity.py --mask-grad exact     # eq. 6's mask gradient as the reference takes it
    python benchmarks/gradient_parity.py --rows                # where the mask gradient's magnitude comes from

Needs ``../shared`` (the model, the CIFAR-10 archive and the reference figures).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when tests load this file by path
from common import DATA, SHARED, SHARED_MODEL  # noqa: E402

REFERENCE = SHARED / "reference" / "official-gradients.json"
MODEL = SHARED_MODEL
ARCHIVE = Path(DATA)
LAMBDA = 10.0


def available() -> bool:
    return REFERENCE.is_file() and MODEL.is_dir() and ARCHIVE.is_file()


def load_reference() -> dict:
    return json.loads(REFERENCE.read_text())


def load_model(dtype: torch.dtype = torch.float32):
    import timm

    return timm.create_model(f"local-dir:{MODEL}", pretrained=True).to(dtype).eval()


def reference_batch(ref: dict, model) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's batch: the listed training images, RGB uint8 / 255, normalised with the model's mean/std,
    no resize and no augmentation (as the reference file says)."""
    import numpy as np
    from PIL import Image

    files = ref["batch"]["files"]
    want = set(files)
    found: dict[str, torch.Tensor] = {}
    with tarfile.open(ARCHIVE) as tar:
        for member in tar:
            name = member.name.lstrip("./")
            if name in want:
                img = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB")
                found[name] = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)  # (3, H, W) uint8
                if len(found) == len(want):
                    break
    missing = want - found.keys()
    if missing:
        raise SystemExit(f"{len(missing)} reference images are not in {ARCHIVE}, e.g. {sorted(missing)[0]}")
    cfg = model.pretrained_cfg
    mean = torch.tensor(cfg["mean"])[:, None, None]
    std = torch.tensor(cfg["std"])[:, None, None]
    x = torch.stack([found[f] for f in files]).float() / 255  # (128, 3, H, W)
    return (x - mean) / std, torch.tensor(ref["batch"]["labels"])


def case_gradients(model, images: torch.Tensor, labels: torch.Tensor, case: dict, **patch_options) -> dict:
    """Our per-block CE and budget gradients for one reference case (same method, thresholds, tau, target)."""
    import ltmp
    from ltmp.train import threshold_training_mode

    ltmp.patch(
        model,
        case["method"],
        tau=0.1,
        merge_threshold=case["merge_threshold"],
        prune_threshold=case["prune_threshold"],
        **patch_options,
    )
    threshold_training_mode(model)
    logits = model(images.to(next(model.parameters()).dtype))
    ce = F.cross_entropy(logits, labels)
    budget = LAMBDA * ltmp.budget_loss(model, case["r_target"])
    rec = ltmp.stats(model)
    out = {
        "r_flops": float(ltmp.r_flops(model).detach().mean()),
        "kept_per_layer": (rec.kept.double().mean(0) + rec.num_prefix).tolist(),
    }
    params = {
        kind: [p for n, p in model.named_parameters() if n.endswith(f"{kind}_threshold")] for kind in ("merge", "prune")
    }
    nm = len(params["merge"])
    for part, grads in threshold_grads({"ce": ce, "budget": budget}, params["merge"] + params["prune"]).items():
        out[part] = {"merge": grads[:nm], "prune": grads[nm:]}
    ltmp.unpatch(model)
    return out


def threshold_grads(losses: dict[str, torch.Tensor], params: list[torch.Tensor]) -> dict[str, list[float]]:
    """Each loss's gradient to each threshold, 0 where it does not reach one (the last block's thresholds decide
    nothing the cross-entropy sees: zero, as in the reference file)."""
    out = {}
    for part, loss in losses.items():
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True, materialize_grads=True)
        out[part] = [float(g) for g in grads]
    return out


def agreement(ours: list[float], ref: list[float], floor: float = 1e-2, factor: float = 2.0) -> tuple[int, int]:
    """(entries that agree, entries compared): same sign and within ``factor`` of the reference, over the entries
    whose reference magnitude exceeds ``floor``."""
    n = ok = 0
    for o, r in zip(ours, ref):
        if abs(r) <= floor:
            continue
        n += 1
        ok += o * r > 0 and abs(r) / factor <= abs(o) <= abs(r) * factor
    return ok, n


def ce_over_budget(case: dict, kind: str) -> float:
    """Median over blocks 1-11 of |cross-entropy gradient| / |budget gradient| for one kind of threshold."""
    import statistics

    pairs = zip(case["ce"][kind][:-1], case["budget"][kind][:-1])
    return statistics.median(abs(c) / max(abs(b), 1e-12) for c, b in pairs)


def opposed(cases: list[dict]) -> tuple[int, int]:
    """(thresholds whose cross-entropy gradient has the opposite sign of the budget gradient and a larger
    magnitude, thresholds compared): there the cross-entropy moves the threshold against the budget. Blocks 1-11
    of the cases that reduce something (block 12's thresholds decide nothing the cross-entropy sees)."""
    against = n = 0
    for case in cases:
        for kind in ("merge", "prune"):
            if case["r_flops"] > 0.999 or not case["ce"][kind]:
                continue
            for c, b in zip(case["ce"][kind][:-1], case["budget"][kind][:-1]):
                n += 1
                against += c * b < 0 and abs(c) > abs(b)
    return against, n


def all_gradients(**patch_options) -> tuple[dict, list[dict]]:
    ref = load_reference()
    model = load_model()
    images, labels = reference_batch(ref, model)
    return ref, [case_gradients(model, images, labels, case, **patch_options) for case in ref["cases"]]


def row_contributions(case_index: int, mask_grad: str = "eps") -> dict:
    """Where eq. 6's mask gradient comes from, for one case's cross-entropy: every (image, head, query row, removed
    key) entry contributes ``w_ij d_ij`` to the removed key's mask gradient (:class:`ltmp.ops.MaskedSoftmax`).
    Returns the share of the summed magnitude that the largest 0.1% / 1% of entries carry, and the share of
    entries where the removed key is a sink (``exp(A_ij) > Z_i``: restored, it would take over half the row)."""
    from ltmp import ops

    ref = load_reference()
    model = load_model()
    images, labels = reference_batch(ref, model)
    original = ops.MaskedSoftmax.backward
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def backward(ctx, g):
        probs, a = ctx.saved_tensors
        d = g - (g * probs).sum(dim=-1, keepdim=True)  # (B, H, N, N)
        removed = (probs == 0) & (a > 0)  # (B, H, N, N) entries of removed keys
        exact = a / (1 - a).clamp(min=1e-12) if mask_grad == "secant" else a  # secant: back to exp(A) / Z
        parts.append(((a * d).abs()[removed].flatten(), (exact > 1)[removed].flatten()))
        return original(ctx, g)

    ops.MaskedSoftmax.backward = staticmethod(backward)
    try:
        case = ref["cases"][case_index]
        import ltmp
        from ltmp.train import threshold_training_mode

        ltmp.patch(
            model,
            case["method"],
            tau=0.1,
            merge_threshold=case["merge_threshold"],
            prune_threshold=case["prune_threshold"],
            mask_grad=mask_grad,
        )
        threshold_training_mode(model)
        F.cross_entropy(model(images), labels).backward()
    finally:
        ops.MaskedSoftmax.backward = original
    mag = torch.cat([p[0] for p in parts]).double()
    sink = torch.cat([p[1] for p in parts])
    total = float(mag.sum())
    ranked = mag.sort(descending=True).values
    top = {f: float(ranked[: max(1, int(f * len(ranked)))].sum()) / total for f in (0.001, 0.01)}
    return {
        "entries": len(mag),
        "top_0.1%": top[0.001],
        "top_1%": top[0.01],
        "sink_entries": float(sink.double().mean()),
        "sink_share": float(mag[sink].sum()) / total,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write our gradients to this file")
    ap.add_argument("--mask-grad", default="clamp", help="form of eq. 6's gradient to removed keys' masks")
    ap.add_argument(
        "--merge-grad",
        default="average",
        help="merge thresholds learn through averages and masks (average) or masks only (mask)",
    )
    ap.add_argument("--rows", action="store_true", help="where eq. 6's mask gradient comes from (per entry)")
    args = ap.parse_args(argv)
    if not available():
        print(f"needs {REFERENCE}, {MODEL} and {ARCHIVE}", file=sys.stderr)
        return 2
    if args.rows:
        print("| case | entries (image, head, row, removed key) | top 0.1% | top 1% | sink entries | their share |")
        print("|---|---|---|---|---|---|")
        for i, case in enumerate(load_reference()["cases"]):
            if case["method"] == "ltp" and case["prune_threshold"] == 0:
                continue  # nothing removed
            c = row_contributions(i, args.mask_grad)
            print(
                f"| {case['method']} m{case['merge_threshold']} p{case['prune_threshold']} | {c['entries']:,} | "
                f"{c['top_0.1%']:.1%} | {c['top_1%']:.1%} | {c['sink_entries']:.2%} | {c['sink_share']:.1%} |"
            )
        return 0
    ref, ours = all_gradients(mask_grad=args.mask_grad, merge_grad=args.merge_grad)
    totals = {"ce": [0, 0], "budget": [0, 0], "budget without LTMP's merge thresholds": [0, 0]}
    for case, mine in zip(ref["cases"], ours):
        print(
            f"\n## {case['method']}, merge {case['merge_threshold']}, prune {case['prune_threshold']}: "
            f"r_FLOPs ours {mine['r_flops']:.3f} / reference {case['r_flops']:.3f}"
        )
        print("kept (incl. class token) ours: " + " ".join(f"{v:.1f}" for v in mine["kept_per_layer"]))
        print("kept (incl. class token) ref:  " + " ".join(f"{v:.1f}" for v in case["kept_per_layer"]))
        for part in ("ce", "budget"):
            for kind in ("merge", "prune"):
                r = case[part][kind]
                if not r:
                    continue
                o = mine[part][kind]
                ok, n = agreement(o, r)
                totals[part][0] += ok
                totals[part][1] += n
                if part == "budget" and not (case["method"] == "ltmp" and kind == "merge"):
                    totals["budget without LTMP's merge thresholds"][0] += ok
                    totals["budget without LTMP's merge thresholds"][1] += n
                print(f"{part:>6} {kind:<5} agree {ok:>2}/{n:<2} | block: ours / reference")
                print("    " + "  ".join(f"{i + 1}: {a:+.3g} / {b:+.3g}" for i, (a, b) in enumerate(zip(o, r))))
    for part, (ok, n) in totals.items():
        print(f"\n{part}: {ok} of {n} entries with |reference| > 1e-2 agree (same sign, within 2x)")
    print("\nmedian over blocks 1-11 of |cross-entropy part| / |budget part| (cases that reduce something):")
    for case, mine in zip(ref["cases"], ours):
        for kind in ("merge", "prune"):
            if case["r_flops"] > 0.999 or not case["ce"][kind]:
                continue
            print(
                f"  {case['method']} merge {case['merge_threshold']} prune {case['prune_threshold']}, {kind}: "
                f"ours {ce_over_budget(mine, kind):.3g}, reference {ce_over_budget(case, kind):.3g}"
            )
    for who, cases in (("ours", ours), ("reference", ref["cases"])):
        against, n = opposed(cases)
        print(
            f"{who}: in {against} of {n} (case, threshold) pairs with some reduction the cross-entropy part "
            f"opposes the budget part and outweighs it"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(ours, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
