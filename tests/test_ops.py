"""The pure tensor functions of ltmp.ops against their definitions (paper eq. 1-7, 16-17, ToMe's merging)."""

from __future__ import annotations

import pytest
import torch

from ltmp import ops


def qkv(B=2, H=3, N=9, D=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype) * 2 for _ in range(3)]


def reference_attention(q, k, v, scale, keep, size):
    """Attention computed per image on the kept tokens only (keys removed)."""
    outs, probs = [], []
    for b in range(q.shape[0]):
        idx = keep[b].nonzero().squeeze(1)
        a = (q[b] * scale) @ k[b][:, idx].transpose(-1, -2) + size[b, idx].log()
        p = a.softmax(-1)
        outs.append(p @ v[b][:, idx])
        full = torch.zeros(q.shape[1], q.shape[2], q.shape[2], dtype=p.dtype)
        full[:, :, idx] = p
        probs.append(full)
    return torch.stack(outs), torch.stack(probs)


def test_threshold_mask_is_hard_forward_and_sigmoid_backward():
    s = torch.tensor([0.1, 0.5, 0.5000001, 0.9], dtype=torch.float64)
    theta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    hard, m = ops.threshold_mask(s, theta, tau=0.1, soft=True)
    assert m.tolist() == [0.0, 0.0, 1.0, 1.0]  # eq. 1: strictly greater keeps
    assert hard.tolist() == [False, False, True, True]
    eval_hard, eval_soft = ops.threshold_mask(s, theta, tau=0.1, soft=False)
    assert torch.equal(eval_hard, hard) and eval_soft is None
    m.sum().backward()
    sig = torch.sigmoid((s - 0.5) / 0.1)
    assert torch.allclose(theta.grad, -(sig * (1 - sig) / 0.1).sum(), atol=1e-12)  # eq. 2


def test_threshold_mask_forward_is_exactly_zero_or_one_with_grad():
    s = torch.rand(1000, requires_grad=True)
    _, m = ops.threshold_mask(s, torch.tensor(0.3, requires_grad=True), tau=0.1, soft=True)
    assert set(m.detach().unique().tolist()) <= {0.0, 1.0}


def test_masked_attention_equals_attention_with_tokens_removed():
    q, k, v = qkv()
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1, 0, 1, 0]], dtype=torch.float64)
    size = torch.tensor([[1, 2, 1, 3, 1, 1, 1, 2, 1], [1, 1, 4, 1, 1, 2, 1, 1, 1]], dtype=torch.float64)
    out, probs = ops.masked_attention(q, k, v, 0.5, keep, size.log())
    ref_out, ref_probs = reference_attention(q, k, v, 0.5, keep.bool(), size)
    assert torch.allclose(out, ref_out, atol=1e-12, rtol=0), (out - ref_out).abs().max()
    assert torch.allclose(probs, ref_probs, atol=1e-12, rtol=0)
    assert probs[..., keep[0] == 0][:1].abs().max() == 0  # no eps leaks to removed keys


def test_masked_attention_passes_gradient_to_the_mask():
    q, k, v = qkv()
    keep_soft = torch.full((2, 9), 0.3, dtype=torch.float64, requires_grad=True)
    hard = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1, 1]] * 2, dtype=torch.float64)
    keep = hard + (keep_soft - keep_soft.detach())
    out, _ = ops.masked_attention(q, k, v, 0.5, keep, None)
    out.pow(2).sum().backward()
    assert keep_soft.grad[hard == 0].abs().min() > 0  # removed keys' masks receive gradient too
    assert torch.isfinite(keep_soft.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masked_attention_finite_when_a_masked_key_holds_the_row_max(dtype):
    q, k, v = qkv(dtype=torch.float64)
    k[:, :, 2] = q.mean(2) * 400  # key 2 dominates every row ...
    keep = torch.ones(2, 9, dtype=torch.float64)
    keep[:, 2] = 0  # ... and is masked
    keep_grad = keep.clone().requires_grad_(True)
    out, _ = ops.masked_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.5, keep_grad.to(dtype), None)
    out.float().sum().backward()
    ref, _ = reference_attention(q, k, v, 0.5, keep.bool(), torch.ones(2, 9, dtype=torch.float64))
    assert torch.isfinite(out).all() and torch.isfinite(keep_grad.grad).all()
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 2e-2}[dtype]
    assert torch.allclose(out.double(), ref, atol=tol, rtol=0), (out.double() - ref).abs().max()


def test_reference_softmax_is_the_reference_codes_and_spreads_where_a_removed_key_dominates():
    """mask_grad="reference": the reference code's softmax_with_mask (eps 1e-5 over and under, max over every key),
    forward and mask gradient; where a removed key dominates a row it is not attention with the key removed."""
    q, k, v = qkv()
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1, 0, 1, 0]], dtype=torch.float64)
    g = torch.randn(2, 3, 9, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def theirs(k, m):  # the formula of ltmp/timm/threshold_masking.py, written out
        a = (q * 0.5) @ k.transpose(-2, -1)
        e = (a - a.max(-1, keepdim=True).values).exp() * m[:, None, None, :]
        return (e + 1e-5 / 9) / (e.sum(-1, keepdim=True) + 1e-5)

    for key in (k, torch.cat([k[:, :, :2], q.mean(2, keepdim=True) * 400, k[:, :, 3:]], 2)):  # then key 2 a sink
        m_ours, m_theirs = keep.clone().requires_grad_(), keep.clone().requires_grad_()
        _, probs = ops.masked_attention(q, key, v, 0.5, m_ours, None, mask_grad="reference")
        want = theirs(key, m_theirs)
        assert torch.allclose(probs, want, atol=1e-15, rtol=0)
        (probs * g).sum().backward()
        (want * g).sum().backward()
        assert torch.allclose(m_ours.grad, m_theirs.grad, atol=1e-12, rtol=1e-9)
    exact = ops.masked_attention(q, key, v, 0.5, keep.clone().requires_grad_(), None, mask_grad="eps")[1]
    assert exact[0, :, :, 2].max() == 0 and probs[0, :, :, 2].max() > 0.05  # the sink takes attention back


def test_mean_column_importance_averages_surviving_rows_only():
    q, k, v = qkv()
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1, 1]] * 2, dtype=torch.float64)
    _, probs = ops.masked_attention(q, k, v, 0.5, keep, None)
    s = ops.importance(probs, keep, "mean")
    idx = keep[0].bool()
    ref = probs[:, :, idx][:, :, :, idx].mean(1).mean(1)  # eq. 17 on the kept tokens only
    assert torch.allclose(s[:, idx], ref, atol=1e-12)
    assert torch.allclose(s[:, idx].sum(1), torch.ones(2, dtype=torch.float64))
    cls = ops.importance(probs, keep, "cls")
    assert torch.allclose(cls, probs[:, :, 0].sum(1))  # eq. 16: summed over heads


def test_masked_softmax_backward_equals_autograd_of_eq6():
    """The hand-written backward of MaskedSoftmax against autograd of the formula, for logits and mask."""
    torch.manual_seed(0)
    attn = torch.randn(2, 3, 7, 7, dtype=torch.float64) * 3
    hard = (torch.rand(2, 7) > 0.4).double()
    hard[:, 0] = 1
    soft = torch.rand(2, 7, dtype=torch.float64)
    g = torch.randn(2, 3, 7, 7, dtype=torch.float64)

    def grads(fn):
        a = attn.clone().requires_grad_(True)
        s = soft.clone().requires_grad_(True)
        keep = hard + (s - s.detach())
        out = fn(a, keep)
        (out * g).sum().backward()
        return out.detach(), a.grad, s.grad

    def formula(a, keep):  # eq. 6 with the kept-key row max and clamped removed exponents, by autograd
        kept = (keep > 0.5)[:, None, None, :]
        z = a - a.masked_fill(~kept, float("-inf")).amax(-1, keepdim=True).detach()
        e = torch.where(kept, z, z.clamp(max=0.0)).exp() * keep[:, None, None, :]
        return e / e.sum(-1, keepdim=True)

    def clamp(a, keep):
        return ops.MaskedSoftmax.apply(a, keep, "clamp")

    for ours, ref in zip(grads(clamp), grads(formula)):
        assert torch.allclose(ours, ref, atol=1e-12, rtol=0), (ours - ref).abs().max()
    assert grads(clamp)[2][hard == 0].abs().min() > 0  # removed keys' masks get gradient


def _masked_softmax_grads(attn, hard, g, mode):
    a = attn.clone().requires_grad_(True)
    s = torch.zeros_like(hard, requires_grad=True)
    out = ops.MaskedSoftmax.apply(a, hard + (s - s.detach()), mode)
    (out * g).sum().backward()
    return out.detach(), a.grad, s.grad


@pytest.mark.parametrize("mode", ["eps", "secant"])
def test_mask_gradient_forms_change_only_removed_keys(mode):
    """Every form has the same forward and the same gradients for the logits and for kept keys' masks."""
    torch.manual_seed(0)
    attn = torch.randn(2, 3, 7, 7, dtype=torch.float64) * 3
    hard = (torch.rand(2, 7) > 0.4).double()
    hard[:, 0] = 1
    g = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    base, other = _masked_softmax_grads(attn, hard, g, "clamp"), _masked_softmax_grads(attn, hard, g, mode)
    assert torch.equal(base[0], other[0])
    assert torch.allclose(base[1], other[1], atol=1e-12, rtol=0)
    kept = hard > 0.5
    assert torch.allclose(base[2][kept], other[2][kept], atol=1e-12, rtol=0)
    assert not torch.allclose(base[2][~kept], other[2][~kept])


def test_secant_mask_gradient_is_the_exact_change_when_a_key_is_restored():
    """For a loss linear in the attention output, the secant form's gradient of a removed key's mask equals the
    change of the loss when that key is put back (the 0 -> 1 flip the straight-through mask stands for)."""
    torch.manual_seed(1)
    B, H, N, D = 1, 2, 6, 4
    attn = torch.randn(B, H, N, N, dtype=torch.float64) * 4
    v = torch.randn(B, H, N, D, dtype=torch.float64)
    c = torch.randn(B, H, N, D, dtype=torch.float64)  # loss = sum(c * (S @ v))
    hard = torch.tensor([[1.0, 1, 0, 1, 0, 1]], dtype=torch.float64)
    _, _, grad = _masked_softmax_grads(attn, hard, c @ v.transpose(-1, -2), "secant")

    def loss(mask):
        probs = (attn.masked_fill(mask[:, None, None, :] < 0.5, float("-inf"))).softmax(-1)
        return float((c * (probs @ v)).sum())

    for j in (2, 4):
        restored = hard.clone()
        restored[0, j] = 1
        assert grad[0, j].item() == pytest.approx(loss(restored) - loss(hard), rel=1e-12, abs=1e-12)


def test_eps_mask_gradient_is_the_exact_derivative_away_from_sinks():
    """The reference code's form is the tangent exp(A_ij) / Z_i, up to its eps, when no removed key dominates."""
    torch.manual_seed(2)
    attn = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    hard = (torch.rand(2, 7) > 0.4).double()
    hard[:, 0] = 1
    g = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    _, _, ours = _masked_softmax_grads(attn, hard, g, "eps")
    m = hard.clone().requires_grad_(True)
    e = attn.exp() * m[:, None, None, :]
    ((e / e.sum(-1, keepdim=True)) * g).sum().backward()
    assert torch.allclose(ours, m.grad, rtol=1e-3, atol=1e-9), (ours - m.grad).abs().max()


def test_mean_importance_stays_in_float32_under_autocast():
    q, k, v = qkv(dtype=torch.float32)
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    _, probs = ops.masked_attention(q, k, v, 0.5, keep, None)
    ref = ops.importance(probs.double(), keep, "mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = ops.importance(probs, keep, "mean")
    assert s.dtype == torch.float32
    assert torch.allclose(s.double(), ref, atol=1e-6, rtol=0), (s.double() - ref).abs().max()


@pytest.mark.parametrize("sized", [False, True])
def test_masked_attention_hard_and_soft_masks_agree(sized):
    """Eval's -inf bias and train's multiplicative mask give the same attention."""
    q, k, v = qkv()
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1, 0, 1, 0]], dtype=torch.float64)
    ls = torch.tensor([[1, 2, 1, 3, 1, 1, 1, 2, 1]] * 2, dtype=torch.float64).log() if sized else None
    hard = ops.masked_attention(q, k, v, 0.5, keep, ls)
    soft = ops.masked_attention(q, k, v, 0.5, keep.requires_grad_(), ls)
    for a, b in zip(hard, soft):
        assert torch.allclose(a, b.detach(), atol=1e-12, rtol=0), (a - b).abs().max()


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a[:, :, None], b[:, None, :], dim=-1)  # (B, Na, Nb)


@pytest.mark.parametrize("n", [1, 2, 9, 10])
def test_match_pairs_even_positions_with_their_most_similar_odd_position(n):
    """ToMe's bipartite matching: set A the even positions, set B the odd ones; the score is the best cosine
    similarity with a B token that may receive, -inf for an A token that may not merge or has no B token."""
    g = torch.Generator().manual_seed(n)
    metric = torch.randn(3, n, 5, generator=g, dtype=torch.float64)
    mergeable = torch.rand(3, n, generator=g) > 0.3
    mergeable[:, 0] = False  # a class token
    score, j = ops.match(metric, ops.blocked_pairs(mergeable))
    sim = _cosine(metric[:, 0::2], metric[:, 1::2]).masked_fill(~mergeable[:, None, 1::2], float("-inf"))
    assert score.shape == j.shape == (3, (n + 1) // 2)
    for b in range(3):
        for i in range(score.shape[1]):
            if not mergeable[b, 2 * i] or sim.shape[2] == 0 or not mergeable[b, 1::2].any():
                assert score[b, i] == float("-inf")
            else:
                assert score[b, i] == pytest.approx(float(sim[b, i].max()), abs=1e-12)
                assert sim[b, i, j[b, i]] == sim[b, i].max()


def test_match_breaks_ties_to_the_first_b_token_and_pads_for_symbolic_sizes():
    metric = torch.tensor([[[1.0, 0], [1.0, 0], [0, 1.0], [2.0, 0], [3.0, 0]]])  # B tokens 1 and 3 tie for 0, 4
    score, j = ops.match(metric, ops.blocked_pairs(torch.ones(1, 5, dtype=torch.bool)))
    assert j.tolist() == [[0, 0, 0]] and score[0, [0, 2]].tolist() == [1.0, 1.0]
    padded, jp = ops.match(metric, ops.blocked_pairs(torch.ones(1, 5, dtype=torch.bool)), pad=True)
    assert torch.equal(padded, score) and torch.equal(jp, j)  # the padding column is never the best


def test_similarity_scores_stay_in_float32_under_autocast():
    # bf16 would round similarities near 1 to steps of 1/256 and tie whole groups of tokens at a merge threshold
    g = torch.Generator().manual_seed(3)
    metric = torch.randn(2, 12, 8, generator=g)  # (B, N, D)
    mergeable = ops.blocked_pairs(torch.ones(2, 12, dtype=torch.bool))
    ref, ref_j = ops.match(metric.double(), mergeable)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        score, j = ops.match(metric.bfloat16(), mergeable)
    assert score.dtype == torch.float32 and torch.equal(j, ref_j)
    assert torch.allclose(score.double(), ref, atol=1e-2, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        score, _ = ops.match(metric, mergeable)  # float32 keys: the similarities are not rounded to bf16
    assert torch.allclose(score.double(), ref, atol=1e-6, rtol=0), (score.double() - ref).abs().max()


def test_rank_selects_k_per_row_ties_to_the_earlier_position():
    s = torch.tensor([[9.0, 0.1, 0.1, 0.5, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])  # 9.0: not a candidate (lowest)
    assert ops.rank(s, largest=False).tolist() == [[4, 1, 2, 3, 0], [0, 1, 2, 3, 4]]
    assert (ops.rank(s, largest=False) < 2).tolist() == [
        [False, True, False, False, True],
        [True, True, False, False, False],
    ]
    assert (ops.rank(s, largest=True) < 2).tolist() == [
        [True, False, False, True, False],
        [True, True, False, False, False],
    ]
    assert (ops.rank(s, largest=True) < torch.tensor([[1], [3]])).sum(1).tolist() == [1, 3]


@pytest.mark.parametrize("seed", range(3))
def test_rank_equals_a_stable_sort(seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 4, (6, 20), generator=g).double()  # many ties
    for largest in (False, True):
        order = s.sort(dim=1, descending=largest, stable=True).indices  # (6, 20)
        ref = torch.empty_like(order).scatter_(1, order, torch.arange(20).expand(6, 20))  # each token's place
        assert torch.equal(ops.rank(s, largest), ref)


def test_group_max_raises_targets_to_their_group_max():
    s = torch.tensor([[0.1, 0.5, 0.2, 0.9]])
    src, dst = torch.tensor([[1, 3]]), torch.tensor([[0, 2]])
    assert ops.group_max(s, src, dst, torch.tensor([[False, False]]))[0].tolist() == pytest.approx([0.5, 0.5, 0.9, 0.9])
    assert ops.group_max(s, src, dst, torch.tensor([[False, True]]))[0].tolist() == pytest.approx([0.5, 0.5, 0.2, 0.9])


def test_merge_rows_averages_by_size_and_sizes_add_up():
    x = torch.tensor([[1.0, 0.0], [3.0, 3.0], [5.0, 1.0], [7.0, 7.0]], dtype=torch.float64)
    size = torch.tensor([1.0, 2.0, 3.0, 1.0], dtype=torch.float64)
    src = torch.eye(4, dtype=torch.float64)
    new_x, new_size, new_src = ops.merge_rows(x, size, torch.tensor([0, 0, 2, 1]), 4, src)
    assert new_size.tolist() == [3.0, 1.0, 3.0, 0.0]
    assert torch.allclose(new_x[0], (1 * x[0] + 2 * x[1]) / 3) and torch.equal(new_x[1], x[3])
    assert torch.isnan(new_x[3]).all()  # received nothing: 0 / 0, for the caller to cut
    assert new_src[0].tolist() == [1.0, 1.0, 0.0, 0.0]
    copied, ones, _ = ops.merge_rows(x, torch.ones(4, dtype=torch.float64), torch.tensor([2, 0, 1, 4]), 5)
    assert torch.equal(copied[:3], x[[1, 2, 0]]) and ones.tolist() == [1, 1, 1, 0, 1]  # size 1: copies, exactly


def _group_cost(groups, pair, fixed):
    return sum(len(rows) * pair * n**2 + fixed for rows, n in groups)


def test_plan_groups_groups_similar_counts():
    from ltmp.engine import plan_groups

    assert plan_groups([10] * 8, 1.0, 1.0, 4) is None  # no padding: one group
    assert plan_groups([100, 10, 100, 10], 1.0, 100.0, 4) == [([1, 3], 10), ([0, 2], 100)]
    assert plan_groups([100, 10, 100, 10], 1.0, 100.0, 1) is None
    assert plan_groups([100, 10, 100, 10], 1.0, 2e4, 4) is None  # a group costs more than it saves


@pytest.mark.parametrize("seed", range(5))
def test_plan_groups_is_the_cheapest_split(seed):
    import itertools
    import random

    from ltmp.engine import plan_groups

    rng = random.Random(seed)
    counts = [rng.randint(5, 200) for _ in range(12)]
    pair, fixed = 2.0, rng.choice([1e3, 1e4, 1e5])
    groups = plan_groups(counts, pair, fixed, 4) or [(list(range(12)), max(counts))]
    assert sorted(i for rows, _ in groups for i in rows) == list(range(12))  # every image exactly once
    assert all(n == max(counts[i] for i in rows) for rows, n in groups)
    order = sorted(range(12), key=counts.__getitem__)
    best = min(
        _group_cost([(order[a:b], counts[order[b - 1]]) for a, b in zip((0,) + cuts, cuts + (12,))], pair, fixed)
        for g in range(4)
        for cuts in itertools.combinations(range(1, 12), g)
    )
    assert _group_cost(groups, pair, fixed) == pytest.approx(best)
