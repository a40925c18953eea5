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
    m = ops.threshold_mask(s, theta, tau=0.1)
    assert m.tolist() == [0.0, 0.0, 1.0, 1.0]  # eq. 1: strictly greater keeps
    m.sum().backward()
    sig = torch.sigmoid((s - 0.5) / 0.1)
    assert torch.allclose(theta.grad, -(sig * (1 - sig) / 0.1).sum(), atol=1e-12)  # eq. 2


def test_threshold_mask_forward_is_exactly_zero_or_one_with_grad():
    s = torch.rand(1000, requires_grad=True)
    m = ops.threshold_mask(s, torch.tensor(0.3, requires_grad=True), tau=0.1)
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


def test_mean_column_importance_averages_surviving_rows_only():
    q, k, v = qkv()
    keep = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1, 1]] * 2, dtype=torch.float64)
    _, probs = ops.masked_attention(q, k, v, 0.5, keep, None)
    s = ops.importance_scores(probs, keep, "mean")
    idx = keep[0].bool()
    ref = probs[:, :, idx][:, :, :, idx].mean(1).mean(1)  # eq. 17 on the kept tokens only
    assert torch.allclose(s[:, idx], ref, atol=1e-12)
    assert torch.allclose(s[:, idx].sum(1), torch.ones(2, dtype=torch.float64))
    cls = ops.importance_scores(probs, keep, "cls")
    assert torch.allclose(cls, probs[:, :, 0].sum(1))  # eq. 16: summed over heads


def test_bipartite_split_alternates_over_survivors_and_skips_prefix():
    keep = torch.tensor([[1, 1, 0, 1, 1, 0, 0, 1, 1]], dtype=torch.float32)
    a, b = ops.bipartite_sets(keep, num_prefix=2)
    # survivors 0,1,3,4,7,8 have ranks 0..5; prefix 0 (A) and 1 (B) are excluded
    assert a.nonzero()[:, 1].tolist() == [3, 7]
    assert b.nonzero()[:, 1].tolist() == [4, 8]


def test_best_match_picks_the_most_similar_b_token_first_on_ties():
    metric = torch.tensor([[[1.0, 0], [1.0, 0], [0, 1.0], [1.0, 0.1], [2.0, 0]]])
    is_a = torch.tensor([[False, False, True, False, True]])
    is_b = torch.tensor([[False, True, False, True, False]])
    score, dst = ops.best_match(metric, is_a, is_b)
    assert dst[0, 4] == 1 and score[0, 4] == pytest.approx(1.0)
    assert score[0, 0] == float("-inf") and score[0, 1] == float("-inf")


def test_merge_is_size_weighted_and_sizes_add_up():
    x = torch.tensor([[[1.0, 0.0], [3.0, 3.0], [5.0, 1.0], [7.0, 7.0]]], dtype=torch.float64)
    size = torch.tensor([[1.0, 2.0, 3.0, 1.0]], dtype=torch.float64)
    merge = torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    dst = torch.tensor([[0, 0, 0, 3]])
    src = torch.eye(4, dtype=torch.float64)[None]
    new_x, new_size, new_src = ops.merge_tokens(x, size, merge, dst, src)
    assert new_size.tolist() == [[6.0, 2.0, 3.0, 1.0]]
    expect = (1 * x[0, 0] + 2 * x[0, 1] + 3 * x[0, 2]) / 6
    assert torch.allclose(new_x[0, 0], expect)
    assert torch.equal(new_x[0, 3], x[0, 3])  # untouched tokens are bit-identical
    assert new_src[0, 0].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_group_max_raises_destination_to_group_max():
    s = torch.tensor([[0.1, 0.5, 0.2, 0.9]])
    merge = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    dst = torch.tensor([[0, 0, 2, 2]])
    assert ops.group_max(s, merge, dst)[0].tolist() == pytest.approx([0.5, 0.5, 0.9, 0.9])


def test_topk_mask_selects_k_lowest_candidates_ties_by_position():
    s = torch.tensor([[0.3, 0.1, 0.1, 0.5, 0.0]])
    cand = torch.tensor([[False, True, True, True, True]])
    assert ops.topk_mask(s, cand, torch.tensor([2]), largest=False).tolist() == [[False, True, False, False, True]]
    assert ops.topk_mask(s, cand, torch.tensor([9]), largest=True).sum() == 4


def test_compact_keeps_order_and_zero_pads():
    keep = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.float32)
    x = torch.arange(8, dtype=torch.float32).view(2, 4, 1) + 1
    new_x, _, none, new_keep, counts = ops.contract(keep > 0.5, x, torch.ones_like(keep), None)
    assert none is None and counts == [3, 1]
    assert new_keep.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert new_x[..., 0].tolist() == [[1, 3, 4], [6, 0, 0]]


@pytest.mark.parametrize("prefix", [0, 1, 2, 5])
def test_contiguous_best_match_equals_the_general_split(prefix):
    g = torch.Generator().manual_seed(prefix)
    metric = torch.randn(3, 11, 4, generator=g, dtype=torch.float64)
    metric[:, 7] = metric[:, 3]  # a tie: the first B token must win in both
    keep = torch.tensor([[1.0] * 11, [1.0] * 8 + [0.0] * 3, [1.0] * (prefix + 1) + [0.0] * (10 - prefix)],
                        dtype=torch.float64)
    is_a, is_b = ops.bipartite_sets(keep, prefix)
    score, dst = ops.best_match(metric, is_a, is_b)
    score_c, dst_c, is_a_c = ops.best_match_contiguous(metric, keep, prefix)
    assert torch.equal(is_a, is_a_c)
    assert torch.allclose(score[is_a], score_c[is_a], atol=1e-12)
    assert torch.equal(dst[is_a & torch.isfinite(score)], dst_c[is_a & torch.isfinite(score)])
    assert torch.isinf(score_c[~is_a]).all()


def _bucket_cost(groups, pair, fixed):
    return sum(len(rows) * pair * n ** 2 + fixed for rows, n in groups)


def test_plan_buckets_groups_similar_counts():
    assert ops.plan_buckets([10] * 8, 1.0, 1.0) is None  # no padding: one group
    assert ops.plan_buckets([100, 10, 100, 10], 1.0, 100.0) == [([1, 3], 10), ([0, 2], 100)]
    assert ops.plan_buckets([100, 10, 100, 10], 1.0, 100.0, max_buckets=1) is None
    assert ops.plan_buckets([100, 10, 100, 10], 1.0, 2e4) is None  # a group costs more than it saves


@pytest.mark.parametrize("seed", range(5))
def test_plan_buckets_is_the_cheapest_split(seed):
    import itertools
    import random

    rng = random.Random(seed)
    counts = [rng.randint(5, 200) for _ in range(12)]
    pair, fixed = 2.0, rng.choice([1e3, 1e4, 1e5])
    plan = ops.plan_buckets(counts, pair, fixed, max_buckets=4)
    groups = plan or [(list(range(12)), max(counts))]
    assert sorted(i for rows, _ in groups for i in rows) == list(range(12))  # every image exactly once
    assert all(n == max(counts[i] for i in rows) for rows, n in groups)
    order = sorted(range(12), key=counts.__getitem__)
    best = min(_bucket_cost([(order[a:b], counts[order[b - 1]]) for a, b in zip((0,) + cuts, cuts + (12,))],
                            pair, fixed)
               for g in range(4) for cuts in itertools.combinations(range(1, 12), g))
    assert _bucket_cost(groups, pair, fixed) == pytest.approx(best)


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
    ref = ops.importance_scores(probs.double(), keep.double(), "mean")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = ops.importance_scores(probs, keep, "mean")
    assert s.dtype == torch.float32
    assert torch.allclose(s.double(), ref, atol=1e-6, rtol=0), (s.double() - ref).abs().max()


def test_similarity_scores_stay_in_float32_under_autocast():
    # bf16 would round similarities near 1 to steps of 1/256 and tie whole groups of tokens at a merge threshold
    g = torch.Generator().manual_seed(3)
    metric = torch.randn(2, 12, 8, generator=g)  # (B, N, D)
    keep = torch.ones(2, 12)
    ref, ref_dst, _ = ops.best_match_contiguous(metric.double(), keep.double(), 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        score, dst, _ = ops.best_match_contiguous(metric, keep, 1)
        sim = ops.cosine_similarity(metric)
    assert score.dtype == sim.dtype == torch.float32
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(score)) and torch.equal(dst, ref_dst)
    err = (score[fin].double() - ref[fin]).abs().max()
    assert torch.allclose(score[fin].double(), ref[fin], atol=1e-6, rtol=0), err


def test_plan_buckets_on_a_large_batch_considers_few_splits():
    import random

    rng = random.Random(0)
    counts = [rng.randint(5, 200) for _ in range(512)]
    plan = ops.plan_buckets(counts, 2.0, 1e4, max_splits=16)
    assert plan is not None and 2 <= len(plan) <= 4
    assert sorted(i for rows, _ in plan for i in rows) == list(range(512))
    assert all(n == max(counts[i] for i in rows) for rows, n in plan)


@pytest.mark.parametrize("sized", [False, True])
def test_single_image_attention_path_equals_the_general_one(sized):
    q, k, v = qkv(B=1)
    size = torch.tensor([[1, 2, 1, 3, 1, 1, 1, 2, 1]], dtype=torch.float64)
    ls = size.log() if sized else None
    with torch.no_grad():  # one image without gradients: the 3-D path
        out, probs = ops.masked_attention(q, k, v, 0.5, None, ls)
    ref_out, ref_probs = ops.masked_attention(q, k, v, 0.5, None, ls)  # grad mode: the general path
    assert out.shape == ref_out.shape and probs.shape == ref_probs.shape
    assert torch.allclose(out, ref_out, atol=1e-12, rtol=0) and torch.allclose(probs, ref_probs, atol=1e-12, rtol=0)


@pytest.mark.parametrize("batched", [True, False])
def test_cosine_similarity_of_tome_split_equals_torch_on_the_slices(batched):
    g = torch.Generator().manual_seed(5)
    metric = torch.randn(2, 11, 6, generator=g, dtype=torch.float64)  # (B, N, D)
    m = metric if batched else metric[0]
    for first_a in (0, 2):
        a, b = m[..., first_a::2, :], m[..., 1::2, :]  # (..., Na, D), (..., Nb, D)
        ref = torch.nn.functional.cosine_similarity(a[..., :, None, :], b[..., None, :, :], dim=-1)  # (..., Na, Nb)
        got = ops.cosine_similarity(m, first_a=first_a)
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-12, rtol=0)
    full = ops.cosine_similarity(m)  # every row with every row
    assert torch.allclose(full.diagonal(dim1=-2, dim2=-1), torch.ones(()).double(), atol=1e-12, rtol=0)
    assert torch.allclose(full[..., 2::2, 1::2], ops.cosine_similarity(m, first_a=2), atol=1e-12, rtol=0)


def test_contract_merges_into_survivors_and_compacts_in_order():
    """Eval's one scatter: survivors keep their order at the front, a token merged into a survivor joins it as a
    size-weighted average (sizes add up), one merged into a removed token is dropped with it, padding is zero."""
    x = torch.arange(12, dtype=torch.float64).view(2, 6, 1)  # token values 0..5 and 6..11
    size = torch.tensor([[1.0, 2, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    alive = torch.tensor([[1, 1, 0, 1, 0, 1], [1, 0, 0, 1, 0, 0]], dtype=torch.bool)
    merge = torch.tensor([[0, 0, 1, 0, 1, 0], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    dst = torch.tensor([[0, 0, 1, 0, 3, 0], [0, 2, 0, 0, 0, 0]])  # image 1 merges token 1 into removed token 2
    out, new_size, _, keep, counts = ops.contract(alive, x, size, None, merge, dst)
    assert counts == [4, 2]
    assert torch.equal(keep, torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64))
    assert torch.equal(new_size, torch.tensor([[1.0, 3, 2, 1], [1, 1, 0, 0]], dtype=torch.float64))
    expected = torch.tensor([[0.0, (2 * 1 + 2) / 3, (3 + 4) / 2, 5], [6, 9, 0, 0]], dtype=torch.float64)
    assert torch.allclose(out[..., 0], expected, atol=1e-12, rtol=0), out[..., 0]
    # counts known on the host (fixed rates): nothing read back, the same result
    from ltmp.runtime import HostSyncs
    with HostSyncs() as syncs:
        again = ops.contract(alive, x, size, None, merge, dst, counts=[4, 2])
    assert syncs.count == 0 and torch.equal(again[0], out)


@pytest.mark.parametrize("merged", [False, True], ids=["pruned", "merged"])
@pytest.mark.parametrize("padded_out", [True, False], ids=["padding-out", "no-padding-out"])
def test_contract_of_packed_rows_equals_the_padded_batch(merged, padded_out):
    """The packed stream: x given as the rows (T, C) of the real tokens of a padded batch comes out as the rows of
    the new real tokens, image by image, with the same bits as the padded batch's compaction; as (B, N', C) when
    no image is padded after the step."""
    torch.manual_seed(0)
    B, N, C = 3, 7, 5
    counts_in = [7, 5, 6]  # real tokens entering; padding at the end of images 1 and 2
    real_in = torch.arange(N) < torch.tensor(counts_in).view(B, 1)  # (B, N)
    x = torch.randn(B, N, C, dtype=torch.float64) * real_in[..., None]
    size = torch.randint(1, 4, (B, N)).double() * real_in
    alive = real_in & (torch.rand(B, N) > 0.4)
    alive[:, 0] = True
    if not padded_out:  # every image keeps its first four real tokens
        alive = real_in & (torch.arange(N) < 4)
    merge = dst = None
    if merged:  # each removed real token merges into a random earlier survivor (position 0 always survives)
        merge = real_in & ~alive
        dst = torch.stack([torch.tensor([int(torch.randint(0, max(1, j), ())) if merge[b, j] else 0
                                         for j in range(N)]) for b in range(B)])
        dst = torch.where(alive.gather(1, dst), dst, torch.zeros_like(dst))
    ref, ref_size, _, ref_keep, counts = ops.contract(alive, x, size, None, merge, dst)
    flat = real_in.view(-1).nonzero().squeeze(1)  # (T,) the packed rows' flat positions
    rows, new_size, _, keep, again = ops.contract(alive, x.view(-1, C)[flat], size, None, merge, dst, real=flat)
    assert again == counts and torch.equal(new_size, ref_size) and torch.equal(keep, ref_keep)
    if padded_out:
        assert rows.shape == (sum(counts), C)
        assert torch.equal(rows, ref.view(-1, C)[ref_keep.view(-1) > 0])  # the same bits, image by image
    else:
        assert torch.equal(rows, ref)  # (B, N', C): nothing to skip


@pytest.mark.parametrize("merged", [False, True], ids=["pruned", "merged"])
def test_contract_of_packed_rows_when_every_token_goes(merged):
    """No prefix and every token removed: packed rows come out as an empty (B, 0, C) batch, as padded ones do."""
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    alive = torch.zeros(2, 3, dtype=torch.bool)
    flat = torch.tensor([0, 1, 2, 3, 4])  # image 1's last token is padding
    merge, dst = (~alive, torch.zeros(2, 3, dtype=torch.long)) if merged else (None, None)
    ref = ops.contract(alive, x, torch.ones(2, 3, dtype=torch.float64), None, merge, dst)
    out = ops.contract(alive, x.view(-1, 4)[flat], torch.ones(2, 3, dtype=torch.float64), None, merge, dst,
                       real=flat)
    assert ref[0].shape == out[0].shape == (2, 0, 4) and out[4] == ref[4] == [0, 0]


@pytest.mark.parametrize("kind", ["mean", "cls"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_importance_from_log_sum_exp_equals_the_explicit_probabilities(kind, masked):
    """Issue #17: a fused kernel's output and log-sum-exp, plus one q k^T pass (in row chunks), give the
    explicit attention's output and importance scores within 1e-12 (float64), with log sizes and removed keys."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 3, 4, 11, 8
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    ls = torch.rand(B, N, generator=g, dtype=torch.float64).mul(2).log1p()
    keep = torch.ones(B, N, dtype=torch.float64)
    if masked:
        keep[0, 7:] = 0  # padding
        keep[2, [3, 5]] = 0
    keep_arg = keep if masked else None
    out, probs = ops.masked_attention(q, k, v, 0.3, keep_arg, ls)
    expected = ops.importance_scores(probs, keep_arg, kind)
    bias = ls.masked_fill(keep <= 0.5, float("-inf"))[:, None, None, :]
    fused_out, lse = ops.attention_with_lse(q, k, v, 0.3, bias)
    got = ops.importance_from_lse(q, k, lse, 0.3, bias, keep_arg, kind, chunk=B * H * N * 4)  # 4-row chunks
    assert torch.allclose(got, expected, atol=1e-12, rtol=0), (got - expected).abs().max()
    real = keep > 0.5
    assert torch.allclose(fused_out.transpose(1, 2)[real], out.transpose(1, 2)[real], atol=1e-12, rtol=0)


@pytest.mark.parametrize("heads", [4, 6])
def test_head_sum_gives_the_similarities_of_the_mean_over_heads(heads):
    # as timm's attention makes the keys: a strided slice of the permuted qkv projection
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        qkv_proj = torch.randn(3, 11, 3, heads, 8, generator=g, dtype=dtype).permute(2, 0, 3, 1, 4)  # (3, B, H, N, D)
        k = qkv_proj.unbind(0)[1]  # (B, H, N, D)
        got, ref = ops.cosine_similarity(ops.head_sum(k), 2), ops.cosine_similarity(k.mean(1), 2)  # (B, Na, Nb)
        if heads == 4:  # a power of 2: the same bits
            assert torch.equal(got, ref)
        else:
            assert torch.allclose(got, ref, atol=1e-12 if dtype == torch.float64 else 1e-6, rtol=0)


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_qkv_heads_split_as_timm_does(contiguous, grad):
    # channels of a wider projection (not contiguous): the strides must come from the tensor, not its shape
    wide = torch.randn(3, 5, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))[1:]  # offset
    proj = wide[..., :36].requires_grad_(grad) if grad else wide[..., :36]  # (B, N, 3 * H * D), H 3, D 4
    ref = proj.reshape(2, 5, 3, 3, 4).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) each
    got = ops.qkv_heads(proj, 3, contiguous=contiguous)
    assert len(got) == 3
    for r, t in zip(ref, got):
        assert t.shape == r.shape and torch.equal(t, r)
        assert t.is_contiguous() if contiguous else t.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr()
    if grad:  # the gradient reaches the projection
        sum(t.sum() * (i + 1) for i, t in enumerate(got)).backward()
        assert torch.equal(proj.grad, torch.arange(1., 4.).repeat_interleave(12).expand(2, 5, 36).double())


def test_heads_merged_are_the_token_rows_of_the_heads():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(2, 5, 3, 4, generator=g).transpose(1, 2)  # (B, H, N, D) laid out (B, N, H, D), as SDPA's
    explicit = torch.randn(2, 3, 5, 4, generator=g)  # (B, H, N, D) contiguous, as a bmm's
    for o in (fused, explicit, fused[:, :, 1:], torch.randn(3, 5, 3, 4, generator=g).transpose(1, 2)[1:]):
        got = ops.heads_merged(o)
        assert got.shape == (2, o.shape[2], 12) and torch.equal(got, o.transpose(1, 2).reshape(2, -1, 12))
    assert ops.heads_merged(fused).data_ptr() == fused.data_ptr()  # a view


def test_kept_constants_are_real_tensors_made_outside_tensor_modes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops._CONSTANTS.clear()
    with FakeTensorMode():  # e.g. shape propagation: a fake tensor must not be kept for later real forwards
        ops.positions(5, torch.device("cpu"))
    got = ops.positions(5, torch.device("cpu"))
    assert type(got) is torch.Tensor and torch.equal(got, torch.arange(5))


def test_kept_constants_drop_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(ops, "MAX_CONSTANTS", 3)
    ops._CONSTANTS.clear()
    cpu = torch.device("cpu")
    first = ops.positions(1, cpu)
    ops.positions(2, cpu)
    ops.positions(3, cpu)
    assert ops.positions(1, cpu) is first  # used again: now the most recent
    ops.positions(4, cpu)  # drops 2, the least recently used
    assert len(ops._CONSTANTS) == 3 and ops.positions(1, cpu) is first
    assert ("arange", 2, cpu, torch.long) not in ops._CONSTANTS
    ops._CONSTANTS.clear()
