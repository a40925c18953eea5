"""torch.compile on patched models: the same results as eager, graphs that break only where compaction needs the
token counts, no recompilation once warm, and a train step that compiles into one graph.

The Dynamo-only ("eager") and AOTAutograd ("aot_eager") backends test what our code controls (tracing, graph
breaks, guards, the custom autograd Function) in seconds; Inductor's code generation is exercised by
``benchmarks/speed.py --compile`` and ``ltmp bench --compile``.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import ltmp
from conftest import THRESHOLDS, images, make_model

pytestmark = [pytest.mark.skipif(not hasattr(torch, "compile"), reason="needs torch.compile"), pytest.mark.slow]


@pytest.mark.parametrize(
    "name, method, batch",
    [
        ("cls", "ltmp", 1),
        ("cls", "ltmp", 4),
        ("registers", "ltmp", 4),
        ("no-cls-avg", "ltpm", 4),
    ],
)
def test_compiled_eval_matches_eager_and_stops_recompiling(name, method, batch):
    torch._dynamo.reset()
    counters.clear()
    model = ltmp.patch(make_model(name), method, **THRESHOLDS).eval()
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=cnt, dynamic=True)
    x = images(8 * batch, seed=3)
    with torch.no_grad():
        for i in range(8):
            xi = x[i * batch : (i + 1) * batch]
            # the first images compile the few variants (first block, padding or not); then new images compile
            # nothing (an error, not a silent fallback to eager): no guard depends on the token counts
            with torch._dynamo.config.patch(error_on_recompile=i >= 2):
                got = compiled(xi)
            kept = ltmp.stats(model).kept.clone()
            want = model(xi)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert torch.equal(kept, ltmp.stats(model).kept)
    reasons = list(counters["graph_break"])
    assert reasons and all("depend" in r.lower() for r in reasons), reasons  # only compaction's token counts


@pytest.mark.parametrize(
    "name, method, kw",
    [
        ("cls", "tome", dict(r=[8, 6, 4])),
        ("registers", "tome", dict(r=5)),
        ("no-cls-avg", "topk-prune", dict(k=4)),
        ("cls", "topk-mp", dict(k=[3, 2, 2])),
    ],
)
def test_fixed_rate_eval_compiles_into_one_graph(name, method, kw):
    """Fixed rates: token counts follow from the shapes, so the eval forward is one graph (fullgraph raises on
    any graph break) with the eager results and counts, for every batch of the same size."""
    torch._dynamo.reset()
    model = ltmp.patch(make_model(name), method, **kw).eval()
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for xi in images(12, seed=3).split(4):
            got = compiled(xi)
            kept = ltmp.stats(model).kept.clone()
            want = model(xi)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            assert torch.equal(kept, ltmp.stats(model).kept)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("method", ["ltmp", "tome"])
def test_compiled_graphs_do_not_depend_on_the_block_index(method):
    """A deeper model compiles no more graphs: the block function is one code object for every block, and a guard
    on the block index would compile it once per block (past Dynamo's recompile limit at 12 blocks)."""
    frames = []
    for depth in (3, 6):
        torch._dynamo.reset()
        model = make_model("cls", depth=depth)
        model = ltmp.patch(model, method, **(dict(r=[4] * depth) if method == "tome" else THRESHOLDS)).eval()
        cnt = CompileCounterWithBackend("eager")
        compiled = torch.compile(model, backend=cnt, dynamic=True)
        with torch.no_grad():
            for i in range(2):
                compiled(images(4, seed=3 + i))
        assert ltmp.stats(model).kept.shape[1] == depth
        frames.append(cnt.frame_count)
    assert frames[0] == frames[1], frames


def test_compile_ignores_is_exporting_where_torch_cannot_tell_export_from_compile(monkeypatch):
    """Before torch 2.14 Dynamo answered torch.compiler.is_exporting() with True under torch.compile too; ltmp then
    relies on its own flag (ReduceConfig.exporting, set by ltmp.export.exporting), so a compiled model still
    records its token counts."""
    import ltmp.engine
    from ltmp.export import exporting

    monkeypatch.setattr(ltmp.engine, "_TORCH_IS_EXPORTING_EXACT", False)
    model = ltmp.patch(make_model("cls"), "ltmp", **THRESHOLDS).eval()
    with monkeypatch.context() as m:  # (torch.compile itself would not compile under this answer)
        m.setattr(torch.compiler, "is_exporting", lambda: True)  # what Dynamo answered before 2.14
        assert not ltmp.engine.plan(model.ltmp_config, False, "cpu", False).symbolic
        with exporting(model):
            assert ltmp.engine.plan(model.ltmp_config, False, "cpu", False).symbolic
    assert not ltmp.engine.plan(model.ltmp_config, False, "cpu", False).symbolic
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=True)
    x = images(1)
    with torch.no_grad():
        got = compiled(x)
        kept = ltmp.stats(model).kept.clone()
        model.ltmp_record = None
        torch.testing.assert_close(got, model(x), rtol=0, atol=1e-12)
    assert torch.equal(kept, ltmp.stats(model).kept)


@pytest.mark.parametrize("name", ["cls", "no-cls-avg"])
def test_compiled_train_step_is_one_graph_with_eager_gradients(name):
    torch._dynamo.reset()
    model = ltmp.patch(make_model(name), "ltmp", **THRESHOLDS).train()
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith(ltmp.patching.THRESHOLD_NAMES))
    x = images(4)

    def step(net):
        model.zero_grad(set_to_none=True)
        out = net(x)
        loss = out.logsumexp(-1).mean() + 10.0 * ltmp.budget_loss(model, 0.5)  # eq. 15, through the record
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        return out.detach(), torch.stack([torch.zeros(()) if g is None else g.detach() for g in grads])

    out_c, grad_c = step(torch.compile(model, backend="aot_eager", fullgraph=True))  # raises on any graph break
    out_e, grad_e = step(model)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=1e-12)
    assert grad_e.abs().sum() > 0
    torch.testing.assert_close(grad_c, grad_e, rtol=0, atol=1e-12)
