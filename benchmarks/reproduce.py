"""Reproduce the paper's claims at small scale (issue #7): every run, table and plot of docs/results.md.

    python benchmarks/reproduce.py [--runs runs/results] [--hours H] [--doc docs/results.md]
    python benchmarks/reproduce.py --render     # the document again from results/reproduce.json, running nothing

Model: the CIFAR-10 ViT of ../shared/models (stand-in for the paper's ImageNet ViTs); data: the shared CIFAR-10
copy; every accuracy is on its 10,000 test images, every paired test an exact McNemar test on the same images.

Resumable and spread over sessions: each training run and evaluation is kept under ``--runs`` as soon as it is
done (written atomically by ``ltmp``) and skipped next time; an interrupted training resumes from its checkpoint.
``--hours H`` starts no new job after H hours; the document is then written from what exists, with "pending" for
the rest (a failed command is reported and left pending too). Order: claims 1 and 7, 2, 3, 4, 6, then 5 (seeds
at the outer targets first).

Raw results: every number the document shows comes from ``RAW`` (``results/reproduce.json``, committed): each test
evaluation (top-1, r_FLOPs, GMACs, per-layer counts, per-image correctness packed as hex), the thresholds logged at
the first and last training step, the per-layer distributions and the convergence evaluations. A run rewrites it
from the runs folder and renders the document from it; ``--render`` renders from it alone.

The recipe: the paper's loss, batch 128, tau 0.1, lambda 10, frozen backbone, ``STEPS`` optimizer steps instead of
one epoch (claim 6) and ``ltmp train``'s defaults (``DEFAULT``: Adam, secant mask gradient, thresholds starting
from no reduction; docs/training.md has the evidence). ``BEFORE`` holds the tables of the recipe before issue #16.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from common import DATA, MODEL, ROOT, compact, run, unpack
from ltmp.significance import holm, mcnemar
from ltmp.thresholds import atomic_write

STEPS = 50  # optimizer steps of batch 128 per run (6,400 training images), as before issue #16
EPOCH_STEPS = 382  # one epoch of the 49,000 training images left after the 2% hold-out
COMMON = ["--augment", "light", "--holdout", "0.02", "--checkpoint-every", "10", "--no-settle"]  # training alone
DEFAULT = ["--optimizer", "adam", "--mask-grad", "secant", "--merge-grad", "average"]  # ltmp train's defaults
RECIPE = COMMON + DEFAULT  # spelled out, so that a later change of defaults starts a new runs folder
RECIPE_NAME = "adam-secant-average"  # runs folder of this recipe (before issue #16: lrp3e-4-mi1.0)
TARGETS = (0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45)  # claim 1 (Table 2, Figure 4)
ABLATION_TARGETS = (0.65, 0.5)  # claims 2-3 (Tables 4-5: DeiT-S at 3.0G and 2.3G of 4.6G)
SEED_TARGETS = (0.8, 0.6, 0.55, 0.45)  # claim 5 (Appendix B: 0.80, 0.62, 0.55, 0.45)
SEEDS = 3
BEFORE = ROOT / "results/reproduce-before-16.json"  # the same tables with the training signal before #16
RAW = ROOT / "results/reproduce.json"  # the raw results this document is rendered from
QUANTILE_TARGETS = (0.7, 0.5)  # claim 7: per-layer quantile calibration as well
TOPK = {"ltp": "topk-prune", "ltm": "tome", "ltmp": "topk-mp"}  # learned method -> top-k counterpart (Table 5)


class Jobs:
    """Training runs and evaluations, each done once and kept; a job past the deadline is left pending."""

    def __init__(self, root: Path, hours: float | None, saved: dict | None = None):
        self.root = root
        self.deadline = None if hours is None else time.time() + 3600 * hours
        self.saved = saved  # --render: the results of RAW; nothing runs
        self.pending: set[str] = set()  # jobs not started (deadline) or failed
        self.failed: list[str] = []
        self.raw: dict[str, object] = {}  # what the document uses, by key ("eval/NAME", "log/NAME", ...)
        self.machine = (saved or {}).get("machine") or (
            f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")

    def _late(self, name: str) -> bool:
        """Past the deadline, or rendering only: the job stays pending."""
        if self.saved is not None or (self.deadline is not None and time.time() > self.deadline):
            self.pending.add(name)
            return True
        return False

    def _keep(self, key: str, load) -> object:
        """The raw result ``key``: from RAW when rendering, else ``load()`` (from the runs folder); kept for RAW."""
        if self.saved is not None:
            if key not in self.saved["results"]:
                self.pending.add(key)
                return None
            value = self.saved["results"][key]
        else:
            value = load()
        self.raw[key] = value
        return value

    def _do(self, name: str, args: list[str]) -> bool:
        """Run one ``ltmp`` command unless past the deadline; False leaves the job pending."""
        if self._late(name):
            return False
        try:
            run(args)
        except SystemExit:
            self.pending.add(name)
            self.failed.append(name)
            print(f"FAILED: {name}; left pending", flush=True)
            return False
        return True

    def _train(self, name: str, folder: Path, target: float, *extra: str) -> bool:
        """``ltmp train`` into ``folder``, resuming what an earlier call left there."""
        return self._do(name, ["train", "--model", MODEL, "--pretrained", "--data-dir", DATA, "--val-split", "test",
                               "--r-target", str(target), "--output", str(folder), *extra]
                        + (["--resume"] if folder.exists() else []))

    def evaluate(self, name: str, *extra: str) -> dict | None:
        out = self.root / "test" / f"{name}.json"
        if self.saved is None and not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            if not self._do(f"eval {name}", ["eval", "--model", MODEL, "--pretrained", "--data-dir", DATA,
                                               "--val-split", "test", "--json", str(out), *extra]):
                return None
        r = self._keep(f"eval/{name}", lambda: compact(json.loads(out.read_text())))
        return None if r is None else dict(r, correct=unpack(r["correct"]), name=name)

    def trained(self, method: str, target: float, importance: str = "mean", seed: int = 0,
                steps: int = STEPS) -> dict | None:
        """Train thresholds (``ltmp train``) and evaluate them on the test set."""
        name = f"{method}-{importance}-r{target}-s{seed}-n{steps}"
        folder = self.root / "train" / name
        if self.saved is None and not (self.root / "test" / f"{name}.json").exists():
            if not (folder / "thresholds.safetensors").exists() and not self._train(
                    f"train {name}", folder, target, "--method", method, "--importance", importance, "--seed",
                    str(seed), "--steps", str(steps), "--no-eval", *RECIPE):
                self.pending.add(f"eval {name}")
                return None
        result = self.evaluate(name, "--thresholds", str(folder / "thresholds.safetensors"))
        if result is not None:
            result["folder"] = str(folder)
            result["log"] = self._keep(f"log/{name}", lambda: first_last(folder / "log.jsonl"))
        return result

    def matched(self, method: str, other: dict | None) -> dict | None:
        """A fixed-rate method with the per-layer schedule closest to ``other``'s GMACs."""
        if other is None:
            self.pending.add(f"{method} matched")
            return None
        return self.evaluate(f"{method}-match-{other['name']}", "--method", method, "--match",
                             str(self.root / "test" / f"{other['name']}.json"))

    def calibrated(self, target: float, mode: str = "shared") -> dict | None:
        """Training-free thresholds (``ltmp calibrate --mode MODE``), claim 7."""
        path = self.root / "calib" / f"{mode}-r{target}.safetensors"
        name = f"calibrated-r{target}" if mode == "shared" else f"calibrated-{mode}-r{target}"
        if self.saved is None and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not self._do(f"calibrate {mode} r{target}", [
                    "calibrate", "--model", MODEL, "--pretrained", "--data-dir", DATA, "--r-target", str(target),
                    "--mode", mode, "--output", str(path)]):
                return None
        return self.evaluate(name, "--thresholds", str(path))

    def analyze(self, result: dict | None) -> dict | None:
        """Per-image merged/pruned counts per layer (``ltmp analyze``, Figures 5-6) on all 10,000 test images."""
        if result is None:
            self.pending.add("analyze")
            return None
        out = self.root / "analyze" / result["name"]
        if self.saved is None and not (out / "layers.json").exists() and not self._do(f"analyze {result['name']}", [
                "analyze", "--model", MODEL, "--pretrained", "--data-dir", DATA, "--val-split", "test",
                "--thresholds", str(Path(result["folder"]) / "thresholds.safetensors"), "--max-images", "10000",
                "--kendall-k", "2", "--output", str(out)]):
            return None
        layers = self._keep(f"analyze/{result['name']}", lambda: json.loads((out / "layers.json").read_text()))
        return None if layers is None else {"layers": layers, "png": out / "layers.png"}

    def convergence(self, result: dict | None, steps: str = "0,10,25,50,100,200,last") -> list[dict] | None:
        """Test accuracy and r_FLOPs of the thresholds logged along one long run (claim 6)."""
        if result is None:
            self.pending.add("convergence")
            return None
        out = self.root / "convergence" / f"{result['name']}.json"
        if self.saved is None and not out.exists():
            if self._late("convergence"):
                return None
            import convergence

            convergence.main([result["folder"], "--steps", steps, "--out", str(out)])
        return self._keep(f"convergence/{result['name']}", lambda: json.loads(out.read_text()))


def first_last(log: Path) -> list[dict]:
    """The step number and thresholds of the first and last records of a training log."""
    recs = [json.loads(line) for line in log.read_text().splitlines() if line]
    return [{k: rec[k] for k in ("step", "merge", "prune")} for rec in (recs[0], recs[-1])]


# ------------------------------------------------------------------------------------------------------ formatting

def top1(r: dict | None) -> str:
    return "pending" if r is None else f"{r['top1']:.2f}"


def gm(r: dict | None) -> str:
    return "pending" if r is None else f"{r['gmacs']:.4f}"


def paired(a: dict | None, b: dict | None) -> str:
    """a - b in points, and the McNemar p on the same images."""
    if a is None or b is None:
        return "pending"
    t = mcnemar(a["correct"], b["correct"])
    return f"{a['top1'] - b['top1']:+.2f} (p={t['p_value']:.2g})"


def rf(r: dict | None) -> str:
    return "pending" if r is None else f"{r['r_flops']:.3f}"


class Before:
    """Cells of the tables written before issue #16 (old training signal), looked up by row key; BEFORE holds
    them as section -> rows (header -> cell), parsed from that document."""

    def __init__(self, path: Path):
        self.data = json.loads(path.read_text()) if path.exists() else {"tables": {}, "lines": {}}

    def cell(self, section: str, col: str, **key: object) -> str:
        for row in self.data["tables"].get(section, []):
            if all(row.get(k) == str(v) for k, v in key.items()):
                return row.get(col, "-")
        return "-"

    def summary(self, claim: str) -> tuple[str, str]:
        """(ours, verdict) before #16 for a summary line; seed counts may differ, so they are not compared."""
        strip = lambda c: re.sub(r", \d+ seeds\)", ")", re.sub(r"\(\d+ steps vs", "(steps vs", c))  # noqa: E731
        row = next((r for r in self.data["tables"].get("Summary", []) if strip(r["claim"]) == strip(claim)), None)
        return ("-", "-") if row is None else (row["ours"], row["verdict"])


def verdict(a: dict | None, b: dict | None, paper: float) -> str:
    """Does a - b agree with the paper's difference ``paper`` (in points)? Significance: McNemar p < 0.05."""
    if a is None or b is None:
        return "pending"
    d, p = a["top1"] - b["top1"], mcnemar(a["correct"], b["correct"])["p_value"]
    if p >= 0.05:
        return "not significant here" + (" (paper: no difference)" if paper == 0 else "")
    if paper == 0:
        return "differs (paper: no difference)"
    return "agrees" if (d > 0) == (paper > 0) else "disagrees: significantly the other way"


def early_late(r: dict) -> tuple[list[float], list[float]]:
    """Tokens (merged, pruned) per image in the first and in the second half of the blocks."""
    half = len(r["per_layer"]) // 2
    return ([sum(x[k] for x in r["per_layer"][:half]) for k in ("merged", "pruned")],
            [sum(x[k] for x in r["per_layer"][half:]) for k in ("merged", "pruned")])


def pruned_share(r: dict) -> float:
    """Share of the removed tokens that were pruned (not merged), over all layers."""
    merged = sum(x["merged"] for x in r["per_layer"])
    pruned = sum(x["pruned"] for x in r["per_layer"])
    return pruned / max(merged + pruned, 1e-9)


def plot_layer_split(rows: list[tuple[str, dict]], path: Path) -> None:
    """Mean tokens merged and pruned per layer, one panel per run (Figures 5-6, means only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ltmp.viz import save_figure

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 2.8), sharey=True, squeeze=False)
    for ax, (label, r) in zip(axes[0], rows):
        layers = np.arange(1, len(r["per_layer"]) + 1)
        ax.bar(layers - 0.2, [x["merged"] for x in r["per_layer"]], 0.4, label="merged")
        ax.bar(layers + 0.2, [x["pruned"] for x in r["per_layer"]], 0.4, label="pruned")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("layer")
        ax.set_xticks(layers)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("tokens per image (mean)")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default=str(ROOT / "runs/results"))
    ap.add_argument("--doc", default=str(ROOT / "docs/results.md"))
    ap.add_argument("--hours", type=float, help="start no new job after this many hours; the rest stays pending")
    ap.add_argument("--render", action="store_true", help=f"write the document from {RAW.relative_to(ROOT)} alone")
    args = ap.parse_args()
    saved = None
    if args.render:
        saved = json.loads(RAW.read_text())
        if saved.get("recipe") != RECIPE_NAME:
            raise SystemExit(f"{RAW} holds recipe {saved.get('recipe')!r}, not {RECIPE_NAME!r}: run without --render")
    jobs = Jobs(Path(args.runs) / RECIPE_NAME, args.hours, saved)  # a new recipe starts afresh
    img = Path(args.doc).parent / "img"
    img.mkdir(parents=True, exist_ok=True)

    dense = jobs.evaluate("dense", "--method", "dense")
    # claim 1, with claim 7 beside it: LTMP, ToMe at matching GMACs, calibrated thresholds
    c1 = {}
    for t in TARGETS:
        lt = jobs.trained("ltmp", t)
        c1[t] = (lt, jobs.matched("tome", lt), jobs.calibrated(t))
    c7 = {t: jobs.calibrated(t, "quantile") for t in QUANTILE_TARGETS}
    # claim 2: learned thresholds against top-k at matching GMACs, for pruning, merging and both
    c2 = {(m, t): (lt := jobs.trained(m, t), jobs.matched(TOPK[m], lt)) for t in ABLATION_TARGETS for m in TOPK}
    # claim 3: class attention against mean column attention (LTP, as in Table 4); LTPM against LTMP
    c3 = {t: {"ltp-cls": jobs.trained("ltp", t, "cls"), "ltp-mean": c2[("ltp", t)][0],
              "ltpm": jobs.trained("ltpm", t), "ltmp": c2[("ltmp", t)][0]} for t in ABLATION_TARGETS}
    # claim 4: per-layer distributions (Figures 5-6) at r 0.5
    c4 = {m: jobs.analyze(c2[(m, 0.5)][0]) for m in ("ltmp", "ltm", "ltp")}
    # claim 6: one epoch of the recipe, evaluated along the way
    long_run = jobs.trained("ltmp", 0.5, steps=EPOCH_STEPS)
    c6 = jobs.convergence(long_run)
    # claim 5: seeds (3 seeds at the outer targets first, then the rest)
    order = [(s, t) for s in (1, 2) for t in (SEED_TARGETS[0], SEED_TARGETS[-1])]
    order += [(s, t) for s in range(1, SEEDS) for t in SEED_TARGETS if (s, t) not in order]
    c5 = {(0, t): (c1[t][0], c1[t][1]) for t in SEED_TARGETS}
    for s, t in order:
        lt = jobs.trained("ltmp", t, seed=s)
        c5[(s, t)] = (lt, jobs.matched("tome", lt))

    write_doc(Path(args.doc), img, jobs, dense, c1, c2, c3, c4, c5, c6, c7, long_run)
    if saved is None:
        raw = {"source": "benchmarks/reproduce.py", "recipe": RECIPE_NAME, "machine": jobs.machine,
               "pending": sorted(jobs.pending), "failed": jobs.failed, "results": dict(sorted(jobs.raw.items()))}
        atomic_write(RAW, lambda tmp: Path(tmp).write_text(json.dumps(raw, indent=0) + "\n"))


def tally(S: list[tuple[str, str, str, str]], was: Before) -> str:
    """How many summary lines agree with the paper, now and before #16 (the lines with a verdict)."""
    def count(verdicts: list[str]) -> str:
        judged = [v for v in verdicts if v not in ("-", "pending")]
        agree = sum(v.startswith("agrees") for v in judged)
        against = sum(v.startswith("disagrees") for v in judged)
        return (f"{agree} of {len(judged)} agree, {against} disagree, {len(judged) - agree - against} are neither "
                "(not significant here, partly, or larger here)")

    return (f"Summary lines with a verdict: now {count([v for *_, v in S])}; before #16 "
            f"{count([was.summary(c)[1] for c, *_ in S])}.")


def write_doc(doc, img, jobs, dense, c1, c2, c3, c4, c5, c6, c7, long_run) -> None:
    from ltmp.viz import plot_pareto

    points = [dict(r, method=label) for t in TARGETS for label, r in zip(("ltmp", "tome", "ltmp calibrated"), c1[t])
              if r is not None] + ([dict(dense, method="dense")] if dense else [])
    if points:
        plot_pareto(points, img / "results-pareto.png", title="CIFAR-10 ViT: top-1 against GMACs (10,000 images)")
    split = [(f"{m.upper()} r_target 0.5", c2[(m, 0.5)][0]) for m in ("ltmp", "ltm", "ltp")]
    split = [(label, r) for label, r in split if r is not None]
    if split:
        plot_layer_split(split, img / "results-layers.png")
    for m, a in c4.items():
        if a is not None and a["png"].exists():  # not when rendering from RAW: the committed picture stays
            shutil.copyfile(a["png"], img / f"results-layers-{m}.png")

    was = Before(BEFORE)
    pending, failed = (jobs.pending, jobs.failed) if jobs.saved is None else (jobs.saved["pending"],
                                                                               jobs.saved["failed"])
    status = "All jobs done." if not pending else (
        f"{len(pending)} jobs (and what depends on them) are still pending"
        + (f", {len(failed)} of them failed ({', '.join(failed)})" if failed else "")
        + ": run the script again to fill them in.")
    L = [
        "# Reproducing the paper at small scale",
        "",
        "Produced by `python benchmarks/reproduce.py` (resumable; `--hours H` to spread it over sessions). "
        f"Machine: {jobs.machine}. Raw results: `results/reproduce.json`. "
        "Model: the CIFAR-10 ViT of `../shared/models` (12 blocks, 65 tokens"
        + (f", {dense['gmacs_dense']:.4f} GMACs" if dense else "") + ") in place of the paper's ImageNet DeiTs; "
        "accuracy on the 10,000 CIFAR-10 test images; paired tests are exact McNemar tests on those images, so "
        "they measure test-set noise only: the spread between training seeds (claim 5) comes on top for any "
        "comparison of two trained runs. " + status,
        "",
        "## Recipe",
        "",
        "The paper's loss (eq. 15), batch 128, tau 0.1, lambda 10, frozen backbone, light augmentation "
        "([training.md](training.md#augmentation-use---augment-light-on-small-images)), 2% of train held out "
        f"as in the paper, **{STEPS} steps** ({STEPS * 128:,} images) instead of "
        "one epoch (claim 6), and `ltmp train`'s defaults since issue #16: eq. 3 as the paper's case rule, Adam "
        "(lr 2e-3 merge, 2e-4 prune), merge thresholds starting at 1.0 (no reduction at step 0), the secant form "
        f"of eq. 6's mask gradient (`{' '.join(DEFAULT)}`). Before #16: SGD, prune lr 3e-4, merge init 1.0, eq. 3 "
        "as a product and a clamped mask gradient. The evidence for the defaults, with the paper's own recipe (SGD, "
        "merge init 0.9, prune lr 5e-6) beside them at seven budgets on held-out images, is in "
        "[training.md](training.md).",
        "",
        f"Dense model: top-1 {top1(dense)} at {gm(dense)} GMACs.",
    ]
    S: list[tuple[str, str, str, str]] = []  # the summary: claim, paper, ours, verdict
    # claim 1
    L += ["", "## 1. Accuracy against GMACs (Table 2, Figure 4)", "",
          "ToMe uses the per-layer r schedule whose GMACs are closest to LTMP's on the same images. Holm: the "
          "McNemar p adjusted for testing all targets.", "",
          "| r_target | LTMP r_FLOPs | LTMP GMACs | LTMP top-1 | ToMe GMACs | ToMe top-1 | LTMP - ToMe (McNemar p) | "
          "Holm p | tokens pruned / removed | before #16: LTMP top-1 | before #16: LTMP - ToMe |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    done = [t for t in TARGETS if c1[t][0] is not None and c1[t][1] is not None]
    raw = {t: mcnemar(c1[t][0]["correct"], c1[t][1]["correct"])["p_value"] for t in done}
    adj = dict(zip(done, holm([raw[t] for t in done])))
    for t in TARGETS:
        lt, tm, _ = c1[t]
        share = "pending" if lt is None else f"{100 * pruned_share(lt):.0f}%"
        hp = f"{adj[t]:.2g}" if t in adj else "pending"
        L.append(f"| {t} | {rf(lt)} | {gm(lt)} | {top1(lt)} | {gm(tm)} | {top1(tm)} | {paired(lt, tm)} | {hp} | "
                 f"{share} | {was.cell('1', 'LTMP top-1', r_target=t)} | "
                 f"{was.cell('1', 'LTMP - ToMe (McNemar p)', r_target=t)} |")
    L += ["", "![accuracy against GMACs](img/results-pareto.png)", ""]
    if done:
        diff = {t: c1[t][0]["top1"] - c1[t][1]["top1"] for t in done}
        better = sum(diff[t] > 0 and adj[t] < 0.05 for t in done)
        worse = sum(diff[t] < 0 and adj[t] < 0.05 for t in done)
        L.append(f"Of {len(done)} targets, LTMP is above ToMe at {sum(d > 0 for d in diff.values())} and below at "
                 f"{sum(d < 0 for d in diff.values())}; significantly (Holm p < 0.05) better at {better}, worse "
                 f"at {worse}, not significantly different at {len(done) - better - worse}. Paper: \"LTMP "
                 "consistently outperforms ToMe across model sizes\" (Figure 4, DeiT-T/S/B, no numbers given); on "
                 "DeiT-S +0.3 points at 3.0G and +0.5 at 2.3G (Tables 3 and 5); no significance test.")
        S.append(("1. LTMP beats ToMe at matching GMACs, at every size", "+0.3 / +0.5 (DeiT-S 3.0G / 2.3G)",
                  ", ".join(f"{diff[t]:+.2f}" for t in done) + f" (r_target {TARGETS[0]} to {done[-1]})",
                  "agrees" if better == len(done) else
                  f"{'disagrees' if worse else 'not significant here'}: better at {better}, worse at {worse} of "
                  f"{len(done)} (Holm p < 0.05)"))
    # claim 2
    L += ["", "## 2. Learned thresholds against top-k (Table 5)", "",
          "Top-k: a fixed number of tokens per layer (top-k pruning; ToMe for merging; k merged + k pruned for "
          "both), the per-layer schedule closest in GMACs to the learned run.", "",
          "| part | r_target | learned GMACs | learned top-1 | top-k GMACs | top-k top-1 | learned - top-k (p) | "
          "paper | verdict | before #16: learned top-1 | before #16: learned - top-k |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    paper2 = {("ltp", 0.65): 1.3, ("ltp", 0.5): 1.7, ("ltm", 0.65): 0.2, ("ltm", 0.5): 0.1, ("ltmp", 0.65): 0.6,
              ("ltmp", 0.5): 1.0}
    for m, label in (("ltp", "pruning: LTP vs top-k"), ("ltm", "merging: LTM vs ToMe"),
                     ("ltmp", "both: LTMP vs top-k")):
        for t in ABLATION_TARGETS:
            lt, tk = c2[(m, t)]
            v = verdict(lt, tk, paper2[(m, t)])
            key = {"part": label, "r_target": t}
            L.append(f"| {label} | {t} | {gm(lt)} | {top1(lt)} | {gm(tk)} | {top1(tk)} | {paired(lt, tk)} | "
                     f"{paper2[(m, t)]:+.1f} | {v} | {was.cell('2', 'learned top-1', **key)} | "
                     f"{was.cell('2', 'learned - top-k (p)', **key)} |")
            S.append((f"2. {label} (r {t})", f"{paper2[(m, t)]:+.1f}", paired(lt, tk), v))
    best = [(m, c2[(m, 0.5)][0]) for m in TOPK if c2[(m, 0.5)][0] is not None]
    if len(best) == len(TOPK):
        top = max(best, key=lambda mr: mr[1]["top1"])[0]
        L.append(f"\nBest learned variant at r_target 0.5: {top.upper()} "
                 "(" + ", ".join(f"{m.upper()} {r['top1']:.2f}" for m, r in best) + "). Paper: LTMP.")
        S.append(("2. LTMP is the best learned variant (r 0.5)", "LTMP", top.upper(),
                  "agrees" if top == "ltmp" else "disagrees"))
    L += ["", "Tokens pruned per image in blocks 1-12 (learned pruning against top-k at the same GMACs):", ""]
    for t in ABLATION_TARGETS:
        lt, tk = c2[("ltp", t)]
        if lt is not None and tk is not None:
            for label, r in ((f"LTP r_target {t} (reached r_FLOPs {lt['r_flops']:.3f})", lt), ("top-k", tk)):
                L.append(f"- {label}: " + ", ".join(f"{x['pruned']:.1f}" for x in r["per_layer"]))
    L += ["", "Paper (DeiT-S at 3.0G / 2.3G, i.e. r_FLOPs 0.65 / 0.5): LTP +1.3 / +1.7 over top-k pruning; LTM "
          "+0.2 / +0.1 over ToMe; LTMP +0.6 / +1.0 over top-k merging + pruning; LTMP best of all, and top-k "
          "merging + pruning below ToMe."]
    # claim 3
    L += ["", "## 3. Design choices (Table 4)", "",
          "| r_target | LTP class attention (GMACs) | LTP mean column attention (GMACs) | mean - class (p) | LTPM "
          "(GMACs) | LTMP (GMACs) | LTMP - LTPM (p) | before #16: mean - class | before #16: LTMP - LTPM |",
          "|---|---|---|---|---|---|---|---|---|"]
    for t in ABLATION_TARGETS:
        r = c3[t]
        cell = {k: f"{top1(v)} ({gm(v)})" for k, v in r.items()}
        L.append(f"| {t} | {cell['ltp-cls']} | {cell['ltp-mean']} | {paired(r['ltp-mean'], r['ltp-cls'])} | "
                 f"{cell['ltpm']} | {cell['ltmp']} | {paired(r['ltmp'], r['ltpm'])} | "
                 f"{was.cell('3', 'mean - class (p)', r_target=t)} | {was.cell('3', 'LTMP - LTPM (p)', r_target=t)} |")
        paper_imp, paper_order = {0.65: 0.0, 0.5: 0.2}[t], 0.2
        S.append((f"3. mean column vs class attention, LTP (r {t})", f"{paper_imp:+.1f}",
                  paired(r["ltp-mean"], r["ltp-cls"]), verdict(r["ltp-mean"], r["ltp-cls"], paper_imp)))
        S.append((f"3. LTMP vs LTPM (r {t})", f"{paper_order:+.1f}", paired(r["ltmp"], r["ltpm"]),
                  verdict(r["ltmp"], r["ltpm"], paper_order)))
    L += ["", "Paper (DeiT-S at 3.1G / 2.3G): mean column attention 0.0 / +0.2 over class attention; LTMP +0.2 / "
          "+0.2 over LTPM. Both importance scores use the same prune lr here, as in the paper; the class "
          "attention score sums over heads (eq. 16), so its thresholds live on a scale num_heads times larger."]
    # claim 4
    L += ["", "## 4. Merging and pruning across layers (Figures 5-6)", "",
          "Mean tokens merged / pruned per layer at r_target 0.5 (10,000 test images):", ""]
    for label, r in split:
        L.append(f"- {label}: " + ", ".join(f"{x['merged']:.1f}/{x['pruned']:.1f}" for x in r["per_layer"]))
        L.append(f"- {label}, before #16: {was.data['lines'].get('4', {}).get(label, '-')}")
    L += ["", "![merged and pruned per layer](img/results-layers.png)", "",
          "Per-image distributions (box plots over the 10,000 test images, `ltmp analyze`): "
          + ", ".join(f"[{m.upper()}](img/results-layers-{m}.png)" for m, a in c4.items() if a is not None), ""]
    lt = c2[("ltmp", 0.5)][0]
    if lt is not None:
        half = len(lt["per_layer"]) // 2
        early, late = early_late(lt)
        S.append(("4. merging dominates early layers, pruning late ones (LTMP r 0.5)", "yes",
                  f"early {early[0]:.1f} merged / {early[1]:.1f} pruned, late {late[0]:.1f} / {late[1]:.1f}",
                  "agrees" if early[0] > early[1] and late[1] > late[0] else
                  ("partly: merging dominates early" if early[0] > early[1] else "disagrees")))
        log = lt["log"]
        L.append("Thresholds of LTMP r_target 0.5 (blocks 1 / 6 / 12, from its log.jsonl): " + "; ".join(
            f"after step {rec['step']}: merge " + " / ".join(f"{rec['merge'][b]:.3f}" for b in (0, half - 1, -1))
            + ", prune " + " / ".join(f"{rec['prune'][b]:.4f}" for b in (0, half - 1, -1))
            for rec in log) + ".\n")
        L.append(f"LTMP r_target 0.5: layers 1-{half} merge {early[0]:.1f} and prune {early[1]:.1f} tokens per "
                 f"image; layers {half + 1}-{2 * half} merge {late[0]:.1f} and prune {late[1]:.1f}. Paper (DeiT-S, "
                 "r_FLOPs 0.5): merging dominates the early layers, pruning the late ones.")
    # claim 5
    L += ["", "## 5. Spread over seeds (Appendix B)", "",
          "The seed sets the 2% hold-out split (so which 49,000 images train), the images drawn and their "
          "augmentation; the test set is fixed.", "",
          "| r_target | seeds done | LTMP top-1 per seed | range | LTMP - ToMe, mean +- std | r_FLOPs range | "
          "before #16: seeds, range | before #16: LTMP - ToMe |", "|---|---|---|---|---|---|---|---|"]
    for t in SEED_TARGETS:
        runs = [(lt, tm) for (s, tt), (lt, tm) in sorted(c5.items()) if tt == t and lt is not None]
        if not runs:
            L.append(f"| {t} | 0 | pending | | | | | |")
            continue
        accs = [lt["top1"] for lt, _ in runs]
        diffs = [lt["top1"] - tm["top1"] for lt, tm in runs if tm is not None]
        rfs = [lt["r_flops"] for lt, _ in runs]
        d = f"{np.mean(diffs):+.2f} +- {np.std(diffs, ddof=1) if len(diffs) > 1 else 0:.2f}" if diffs else "pending"
        L.append(f"| {t} | {len(runs)} | {', '.join(f'{a:.2f}' for a in accs)} | {max(accs) - min(accs):.2f} | "
                 f"{d} | {min(rfs):.3f}-{max(rfs):.3f} | {was.cell('5', 'seeds done', r_target=t)}, "
                 f"{was.cell('5', 'range', r_target=t)} | {was.cell('5', 'LTMP - ToMe, mean +- std', r_target=t)} |")
        if len(runs) > 1:
            S.append((f"5. seed spread (r {t}, {len(runs)} seeds)", "range 0.03-0.05",
                      f"range {max(accs) - min(accs):.2f}",
                      "agrees" if max(accs) - min(accs) <= 0.1 else "larger here"))
    L += ["", "Paper (DeiT-S, 5 seeds at r_target 0.80 / 0.62 / 0.55 / 0.45): accuracy ranges 0.030 / 0.034 / "
          "0.032 / 0.050 points (Appendix B)."]
    # claim 6
    L += ["", "## 6. Convergence: how many training images?", ""]
    if c6 is None:
        L.append(f"pending (one run of {EPOCH_STEPS} steps = one epoch at r_target 0.5, evaluated along the way)")
    else:
        L += [f"One epoch ({EPOCH_STEPS} steps of 128) of the recipe at r_target 0.5; the thresholds logged after "
              "those steps, evaluated on the test set (`benchmarks/convergence.py`):", "",
              "| step | training images | top-1 | r_FLOPs | pruned per image | before #16: top-1 | before #16: "
              "r_FLOPs |", "|---|---|---|---|---|---|---|"]
        for row in c6:
            L.append(f"| {row['step']} | {row['images']} | {row['top1']:.2f} | {row['r_flops']:.3f} | "
                     f"{row['pruned_per_image']:.2f} | {was.cell('6', 'top-1', step=row['step'])} | "
                     f"{was.cell('6', 'r_FLOPs', step=row['step'])} |")
        short = c2[("ltmp", 0.5)][0]
        if short is not None and long_run is not None:
            S.append((f"6. one epoch needed? ({STEPS} steps vs {EPOCH_STEPS})", "one epoch used (not studied)",
                      paired(short, long_run), "fewer suffice" if mcnemar(short["correct"], long_run["correct"])[
                          "p_value"] >= 0.05 or short["top1"] >= long_run["top1"] else "the epoch is better"))
            (e0, l0), (e1, l1) = early_late(short), early_late(long_run)
            L.append(f"\nTokens merged / pruned per image in blocks 1-6 and 7-12: after {STEPS} steps "
                     f"{e0[0]:.1f}/{e0[1]:.1f} and {l0[0]:.1f}/{l0[1]:.1f}; after the epoch {e1[0]:.1f}/{e1[1]:.1f} "
                     f"and {l1[0]:.1f}/{l1[1]:.1f}.")
            L.append(f"\nThe {STEPS}-step run of claim 1 (same seed, so the same first {STEPS} steps) against the "
                     f"epoch: top-1 {short['top1']:.2f} vs {long_run['top1']:.2f}, r_FLOPs {short['r_flops']:.3f} "
                     f"vs {long_run['r_flops']:.3f}; {STEPS} steps - epoch {paired(short, long_run)}.")
            L += [f"\nBefore #16: {line}" for line in was.data["lines"].get("6", [])]
        L.append("\nThe paper's own recipe before #16 (1 epoch, merge init 0.9, prune lr 5e-6), evaluated the "
                 "same way: [training.md](training.md#how-many-training-images-are-needed-issue-7-claim-6). Paper: "
                 "one epoch of ImageNet (about 10,000 steps); no study of fewer.")
    # claim 7
    L += ["", "## 7. Beyond the paper: training-free calibration", "",
          "`ltmp calibrate --mode shared`: one merge threshold for all blocks, bisected on 256 training images to "
          "hit r_target, no training; `--mode quantile` (at r_target " + " and ".join(map(str, QUANTILE_TARGETS))
          + "): per-layer thresholds that merge a fraction f of each layer's set-A tokens and prune f/2 of the "
          "rest, f bisected. Both against the trained LTMP run of claim 1.", "",
          "| r_target | calibrated r_FLOPs | calibrated top-1 | trained r_FLOPs | trained top-1 | "
          "calibrated - trained (p) | quantile: r_FLOPs, top-1 | quantile - trained (p) | before #16: trained "
          "top-1 | before #16: calibrated - trained |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for t in TARGETS:
        lt, _, cal = c1[t]
        q = f"{rf(c7[t])}, {top1(c7[t])} | {paired(c7[t], lt)}" if t in c7 else "- | -"
        L.append(f"| {t} | {rf(cal)} | {top1(cal)} | {rf(lt)} | {top1(lt)} | {paired(cal, lt)} | {q} | "
                 f"{was.cell('7', 'trained top-1', r_target=t)} | "
                 f"{was.cell('7', 'calibrated - trained (p)', r_target=t)} |")
    cal = [(c1[t][2], c1[t][0]) for t in TARGETS if c1[t][2] is not None and c1[t][0] is not None]
    if cal:
        ps = [mcnemar(a["correct"], b["correct"])["p_value"] for a, b in cal]
        S.append(("7. training-free calibration vs trained (not in the paper)", "-",
                  f"{sum(a['top1'] > b['top1'] for a, b in cal)} of {len(cal)} above, "
                  f"{sum(p < 0.05 and a['top1'] > b['top1'] for (a, b), p in zip(cal, ps))} significantly; "
                  f"{sum(p < 0.05 and a['top1'] < b['top1'] for (a, b), p in zip(cal, ps))} significantly below",
                  "-"))
    L += ["", "How the modes work and when to use them: [calibration.md](calibration.md)."]
    head = L.index("## Recipe")
    L[head:head] = ["## Summary", "", "Differences in top-1 points (ours: McNemar p on 10,000 test images). Before "
                    f"#16: the same claims with the training signal before issue #16 ({was.data.get('source', '-')})."
                    , "", "| claim | paper | ours | verdict | before #16: ours | before #16: verdict |",
                    "|---|---|---|---|---|---|"] + [
        f"| {c} | {pa} | {o} | {v} | {' | '.join(was.summary(c))} |" for c, pa, o, v in S] + [""] + [
        tally(S, was), ""]
    text = "\n".join(L) + "\n"
    atomic_write(doc, lambda tmp: Path(tmp).write_text(text))
    print(text, end="")


if __name__ == "__main__":
    main()
