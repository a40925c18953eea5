"""The maths of LTMP (Bonnaerens & Dambre, TMLR 2023, section 3) as pure tensor functions.

Equation numbers follow the paper's LaTeX source:

- eq. 1-3: threshold masking module (hard mask, sigmoid surrogate, recursive mask),
- eq. 4-7: attention, attention with mask, masked softmax, attention logits,
- eq. 16-17: class attention and mean column attention importance scores,

plus ToMe's bipartite matching and size-weighted merge (Bolya et al., 2023), which LTMP's merging thresholds.
Each algorithm has one implementation here. Nothing here knows about timm or asks torch which mode it runs in:
the caller (:mod:`ltmp.step`) passes what differs between train, eval and export.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import LtmpError


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``; ``t`` itself when it already is (no operator call)."""
    return t if t.dtype == dtype else t.to(dtype)


def wide(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)`` for a float dtype, decided in Python (no operator call)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


_NO_OP = contextlib.nullcontext()


def exact(device_type: str):
    """A context in which matmuls run in their inputs' precision: autocast off where it is on (entering
    ``torch.autocast`` costs tens of microseconds, so not where it is off)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else _NO_OP


def threshold_mask(scores: Tensor, threshold: Tensor, tau: float, soft: bool) -> Tensor:
    """Threshold masking module, eq. 1-2: ``scores > threshold`` (eq. 1), and with ``soft`` as a straight-through
    estimator whose backward is the gradient of ``sigmoid((scores - threshold) / tau)`` (eq. 2). The form
    ``hard + (soft - soft.detach())`` keeps the forward value exactly 0 or 1, so train and eval decide alike.

    Args:
        scores: Any shape. threshold: a scalar (an ``nn.Parameter``). tau: temperature of eq. 2.
        soft: train mode: the straight-through form in the promoted dtype; else a bool mask.
    """
    hard = scores > threshold  # (...)
    if not soft:
        return hard
    # torch.result_type(scores, threshold) for a 0-d threshold, in a form torch.compile traces without a break
    dt = scores.dtype if threshold.dim() == 0 else torch.promote_types(scores.dtype, threshold.dtype)
    s = torch.sigmoid((scores - threshold) / tau)  # (...)
    return hard.to(dt) + (s - s.detach())


def key_bias(keep: Tensor | None, log_size: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The additive bias (B, N) of hard masks over the keys: log size (proportional attention), -inf for removed
    keys; None when there is neither."""
    mask = None if keep is None else cast(keep.detach(), dtype).log()  # (B, N) 0 kept, -inf removed (keep is 0/1)
    if log_size is None:
        return mask
    return cast(log_size, dtype) if mask is None else cast(log_size, dtype) + mask  # (B, N)


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    keep: Tensor | None,
    log_size: Tensor | None,
    dropout: float = 0.0,
    amp: bool = False,
) -> tuple[Tensor, Tensor]:
    """Attention with masked keys and proportional attention, eq. 5-7, for hard masks (eval; train mode's
    straight-through masks: :func:`soft_masked_attention`).

    ``S_ij = exp(A_ij) m_j / sum_k exp(A_ik) m_k`` (eq. 6) with ``A = QK^T / sqrt(d) + log(size)`` (eq. 7 plus
    ToMe's proportional attention) is attention with the masked keys removed: a -inf bias and one softmax, in at
    least float32 (``amp``: autocast runs the matmuls in lower precision, the bias is added after them).

    Args:
        q, k, v: (B, H, N, D). scale: multiplier of ``q k^T``.
        keep: (B, N) 0/1 mask of surviving keys, or None. log_size: (B, N) log token sizes, or None (all 1).

    Returns:
        out (B, H, N, D) and the probabilities S (B, H, N, N), in at least float32.
    """
    B, H, N, D = q.shape
    q3, k3, v3 = (t.view(B * H, N, D) for t in (q, k, v))  # (B * H, N, D) each (contiguous: eval's layouts)
    bias = key_bias(keep, log_size, wide(q.dtype))  # (B, N) or None
    if bias is None or amp or q.dtype != wide(q.dtype):  # the scale folded into the matmul (beta 0: no input)
        attn = cast(torch.baddbmm(q3.new_empty(()), q3, k3.transpose(1, 2), beta=0, alpha=scale), wide(q.dtype))
        if bias is not None:
            attn = (attn.view(B, H, N, N) + bias.view(B, 1, 1, N)).view(B * H, N, N)  # (B * H, N, N)
    else:  # scale and bias in one call, each head with its copy of the bias
        attn = torch.baddbmm(
            torch.cat([bias.view(B, 1, N)] * H, 1).view(B * H, 1, N), q3, k3.transpose(1, 2), alpha=scale
        )  # (B * H, N, N)
    probs = attn.softmax(dim=-1)  # (B * H, N, N)
    p = F.dropout(probs, dropout) if dropout else probs
    return torch.bmm(cast(p, v.dtype), v3).view(B, H, N, D), probs.view(B, H, N, N)


def soft_masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    keep: Tensor,
    log_size: Tensor | None,
    dropout: float = 0.0,
    mask_grad: str = "secant",
) -> tuple[Tensor, Tensor]:
    """:func:`masked_attention` with a straight-through mask ``keep`` (B, N) (train mode): the mask multiplies in
    eq. 6, so gradients reach it and the thresholds behind it (:class:`MaskedSoftmax`); the same forward."""
    attn = cast((q * scale) @ k.transpose(-2, -1), wide(q.dtype))  # (B, H, N, N)
    if log_size is not None:
        attn = attn + log_size[:, None, None, :].to(attn.dtype)
    probs = MaskedSoftmax.apply(attn, keep.to(attn.dtype), mask_grad)  # (B, H, N, N)
    p = F.dropout(probs, dropout) if dropout else probs
    return p.to(v.dtype) @ v, probs  # (B, H, N, D), (B, H, N, N)


#: Forms of eq. 6's gradient with respect to a *removed* key's mask (see :class:`MaskedSoftmax`).
MASK_GRADS = ("clamp", "eps", "secant")
#: eps of the reference code's masked softmax denominator (the ``"eps"`` form).
REFERENCE_EPS = 1e-5


class MaskedSoftmax(torch.autograd.Function):
    """The masked softmax of eq. 6, ``S_ij = a_ij m_j`` with ``a_ij = exp(A_ij) / sum_k exp(A_ik) m_k``, with a
    hand-written backward (autograd of the formula keeps about ten (B, H, N, N) intermediates; this keeps two):

    - ``dL/dA_ij = S_ij (g_ij - sum_k g_ik S_ik)`` (the softmax backward),
    - ``dL/dm_j = sum_(h, i) w_ij (g_ij - sum_k g_ik S_ik)`` (the mask's gradient, also for removed keys).

    For a kept key, ``w_ij = a_ij = S_ij``, the exact derivative. For a removed key the exact derivative
    ``a_ij = exp(A_ij) / Z_i`` (``Z_i`` the kept keys' sum) is unbounded: it is huge in rows where the removed key
    would dominate (an attention sink). ``mask_grad`` picks a bounded form:

    - ``"clamp"``: the row max is taken over kept keys and removed keys' exponents are clamped at it,
      ``w_ij = min(exp(A_ij - max_kept), 1) / (Z_i exp(-max_kept)) <= 1``;
    - ``"eps"``: the reference code's, ``w_ij = exp(A_ij - max_all) / (Z_i exp(-max_all) + 1e-5)`` with the max over
      all keys, bounded only by 1e5;
    - ``"secant"`` (the default): ``w_ij = a_ij / (1 + a_ij) = sigmoid(A_ij - log Z_i)``, the probability key j
      would get if it were restored. The straight-through mask stands for a 0 -> 1 flip, and restoring key j
      changes row i's output by exactly ``w_ij (v_j - o_i)``: the secant of the flip rather than the tangent at 0.

    The forward is the same in all three: exactly attention with the removed keys left out.
    """

    @staticmethod
    def forward(ctx, attn: Tensor, keep: Tensor, mask_grad: str = "secant") -> Tensor:
        # attn (B, H, N, N), keep (B, N) straight-through 0/1 values
        kept = (keep > 0.5)[:, None, None, :]  # (B, 1, 1, N)
        row_max = attn.masked_fill(~kept, float("-inf")).amax(dim=-1, keepdim=True)  # (B, H, N, 1)
        z = attn - row_max  # (B, H, N, N); kept keys are <= 0
        a = z.clamp(max=0.0).exp()  # (B, H, N, N)
        probs = a * keep[:, None, None, :]  # (B, H, N, N)
        total = probs.sum(dim=-1, keepdim=True)  # (B, H, N, 1) = Z_i exp(-max_kept), >= 1
        probs.div_(total)
        if mask_grad == "clamp":
            a.div_(total)
        elif mask_grad == "secant":
            a = torch.where(kept, probs, torch.sigmoid(z - total.log()))  # (B, H, N, N)
        elif mask_grad == "eps":
            shift = (z.amax(dim=-1, keepdim=True)).clamp(min=0.0)  # (B, H, N, 1) max_all - max_kept
            eps_form = (z - shift).exp_().div_(total * (-shift).exp() + REFERENCE_EPS)  # (B, H, N, N)
            a = torch.where(kept, probs, eps_form)
        else:
            raise LtmpError(f"unknown mask_grad '{mask_grad}'; choose one of: {', '.join(MASK_GRADS)}")
        ctx.save_for_backward(probs, a)
        return probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        probs, a = ctx.saved_tensors
        d = g - (g * probs).sum(dim=-1, keepdim=True)  # (B, H, N, N)
        grad_keep = (a * d).sum(dim=(1, 2)) if ctx.needs_input_grad[1] else None  # (B, N)
        return (probs * d if ctx.needs_input_grad[0] else None), grad_keep, None


def row_weights(rows: Tensor | None, heads: int, dtype: torch.dtype) -> Tensor | None:
    """Each query row's weight in eq. 17's mean: ``1/(h n)`` at the n surviving rows ``rows`` (B, N) (0/1 or
    bool), 0 at the others; None (every row alike) stays None."""
    if rows is None:
        return None
    w = cast(rows.detach(), dtype)  # (B, N)
    return w / (heads * w.sum(1, keepdim=True))  # (B, N)


def importance_scores(probs: Tensor, weights: Tensor | None, kind: str) -> Tensor:
    """Token importance from the attention probabilities S (B, H, N, N) of eq. 6.

    - ``"mean"``: mean column attention, eq. 17: ``s_i = 1/(h n) sum_heads sum_k S_hki``, averaged over heads and
      over the surviving query rows k, with their ``weights`` (B, N) (:func:`row_weights`; None: all rows).
    - ``"cls"``: class attention, eq. 16: ``s_i = sum_heads S_h0i`` (sums over heads, so its scale differs).

    Returns:
        (B, N) scores, in the probabilities' precision (not autocast's).
    """
    if kind == "cls":
        return probs[:, :, 0, :].sum(dim=1)  # (B, N)
    if weights is None:  # rows, then heads: ONNX Runtime's mean over both at once, or heads first, is 6x slower
        return probs.mean(dim=2).mean(dim=1)  # (B, N)
    with exact(probs.device.type):  # the weights (1 / (h n) at the surviving rows) after the sum over heads
        return torch.bmm(cast(weights, probs.dtype)[:, None], probs.sum(dim=1)).squeeze(1)  # (B, N)


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """A fused attention kernel that also returns the log-sum-exp of each query row, or None where none is at hand.

    CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``; CUDA: the memory-efficient kernel (whose
    log-sum-exp may be padded past N). Eval only (no dropout, no gradient to a mask).

    Args:
        q, k, v: (B, H, N, D). bias: (B, 1, 1, N) additive bias of the keys, or None.

    Returns:
        out (B, H, N, D) and lse (B, H, N), ``logsumexp_j(scale q_i . k_j + bias_j)``.
    """
    B, H, N, _ = q.shape
    if not (q.dtype == k.dtype == v.dtype):
        return None
    try:
        if q.device.type == "cpu":
            mask = None if bias is None else cast(bias, q.dtype).expand(B, H, N, N)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
        elif q.device.type == "cuda" and q.dtype != torch.float64:
            mask = None
            if bias is not None:  # the kernel wants the bias rows aligned (as SDPA pads them): 16 columns
                mask = bias.new_zeros(B, 1, 1, -(-N // 16) * 16, dtype=q.dtype)
                mask[..., :N] = bias
                mask = mask[..., :N].expand(B, H, N, N)
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, scale=scale)[:2]
        else:
            return None
    except (AttributeError, NotImplementedError, RuntimeError):  # an older torch or an unsupported shape
        return None
    return out, lse[..., :N]


def importance_from_lse(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    scale: float,
    bias: Tensor | None,
    weights: Tensor | None,
    kind: str,
    chunk: int = 1 << 22,
) -> Tensor:
    """:func:`importance_scores` from the log-sum-exp of a fused kernel, without its probabilities.

    The probability of query i for key j is ``exp(scale q_i . k_j + bias_j - lse_i)`` (eq. 6), so one more
    ``q k^T`` pass gives them back: for ``"cls"`` row 0 only, for ``"mean"`` every row, in chunks of query rows of
    about ``chunk`` elements (a memory bound), summed into the column means as they come.

    Args:
        q, k: (B, H, N, D); lse: (B, H, N) from :func:`attention_with_lse`; bias: (B, 1, 1, N) or None.
        weights: (B, N) of the surviving query rows (:func:`row_weights`; None: all); kind: ``"mean"`` (eq. 17) or
            ``"cls"`` (eq. 16).
    """
    B, H, N, _ = q.shape
    dt = wide(lse.dtype)
    kt = k.transpose(-2, -1)  # (B, H, D, N)

    def probs(sl: slice) -> Tensor:  # (B, H, n, N) probabilities of these query rows
        s = cast(q[:, :, sl] @ kt, dt) * scale  # (B, H, n, N)
        if bias is not None:
            s = s + cast(bias, dt)
        return (s - cast(lse[:, :, sl, None], dt)).exp_()

    if kind == "cls":
        return probs(slice(0, 1))[:, :, 0].sum(dim=1)  # (B, N)
    w = q.new_ones(B, N, dtype=dt) / (H * N) if weights is None else cast(weights, dt)  # (B, N)
    step = max(1, chunk // max(1, B * H * N))
    total = 0
    for i in range(0, N, step):
        with exact(q.device.type):
            total = total + torch.einsum("bhqn,bq->bn", probs(slice(i, i + step)), w[:, i : i + step])  # (B, N)
    return total


def head_sum(k: Tensor) -> Tensor:
    """ToMe's merge metric, the keys averaged over heads, without the division by H (only cosine similarities of
    it are used): (B, H, N, D) -> (B, N, D), or a layout's rows (T, H, D) -> (T, D)."""
    return k.sum(1)  # (B, N, D) or (T, D)


def match(
    metric: Tensor, blocked: Tensor | None, pad: bool = False, views: bool = False, first: tuple = (0, 1)
) -> tuple[Tensor, Tensor]:
    """ToMe's bipartite matching on tokens in order: set A is the even positions, set B the odd ones, and each A
    token's score is its highest cosine similarity with a B token (the first on ties). Similarities are float32 at
    least, also under autocast: bf16 rounds them to steps of 1/256 near 1, where thresholds sit.

    Args:
        metric: (B, N, D) the merge metric (:func:`head_sum`; any scale).
        blocked: (B, Na, Nb) or (Na, Nb) bool, the pairs that may not merge (:func:`blocked_pairs`), or None.
        first: the first positions of set A and of set B (even, odd): those past the prefix tokens.
        pad: add a column no token can match, so that an empty set B (one token) needs no branch on N (symbolic
            sizes); without it, that column is added when set B is empty.
        views: take sets A and B as strided views (fewer operator calls than slices; not with gradients).

    Returns:
        The score (B, Na), -inf where the A token cannot merge or no B token can receive (such a token never
        passes a threshold), and the index j (B, Na) of its B token (position ``first[1] + 2 j``).
    """
    u = cast(metric, wide(metric.dtype))
    u = u / u.norm(dim=-1, keepdim=True)  # (B, N, D)
    (a0, b0), (B, N, D), (sB, sN, sD) = first, u.shape, u.stride()
    if views:
        a = u.as_strided((B, max(N - a0 + 1, 0) // 2, D), (sB, 2 * sN, sD), u.storage_offset() + a0 * sN)  # (B, Na, D)
        bt = u.as_strided((B, D, max(N - b0 + 1, 0) // 2), (sB, sD, 2 * sN), u.storage_offset() + b0 * sN)  # (B, D, Nb)
    else:
        a, bt = u[:, a0::2], u[:, b0::2].transpose(1, 2)
    with exact(u.device.type):
        sim = torch.bmm(a, bt)  # (B, Na, Nb)
    sim = sim if blocked is None else sim.masked_fill_(blocked, float("-inf"))  # (B, Na, Nb)
    if pad or sim.shape[-1] == 0:
        sim = F.pad(sim, (0, 1), value=float("-inf"))  # (B, Na, Nb + 1)
    if sim.requires_grad:
        return sim.max(dim=-1)  # (B, Na) each
    return sim.amax(dim=-1), sim.argmax(dim=-1)  # (B, Na) each: fewer operator calls than max


def blocked_pairs(mergeable: Tensor, first: tuple = (0, 1)) -> Tensor:
    """The (A, B) pairs of :func:`match` that may not merge, (..., Na, Nb) bool, from the tokens (..., N) that may
    merge or receive (survivors past the prefix); ``first`` as for :func:`match`."""
    blocked = ~mergeable  # (..., N)
    return blocked[..., first[0] :: 2, None].bitwise_or(blocked[..., None, first[1] :: 2])  # (..., Na, Nb)


def rank(scores: Tensor, largest: bool, earlier: Tensor | None = None) -> Tensor:
    """Each token's rank in its row, best first: the number of tokens that come before it (a higher score for
    ``largest``, else a lower one, or an equal score at an earlier position). ``rank < k`` selects the k best of
    each row, ties to the earlier position; tokens that may not be chosen must score -inf (``largest``) or +inf.

    The rank of a stable sort, without a sort (ONNX has no stable sort, so eager and exported models select
    alike), in O(M^2) comparisons per row.

    Args:
        scores: (B, M). earlier: (M, M) bool or 0/1, [i, j] true where j < i (the caller may keep it, in the
            scores' dtype; made here if not given).

    Returns:
        (B, M) the ranks, 0 for the best, in the scores' dtype.
    """
    B, M = scores.shape
    if earlier is None:
        earlier = torch.ones(M, M, dtype=torch.bool, device=scores.device).tril(-1)
    big = torch.finfo(scores.dtype).max  # -inf (+inf) as a finite extreme: no difference is then NaN
    s = scores.clamp_min(-big) if largest else scores.clamp_max(big)  # (B, M)
    si, sj = s.view(B, M, 1), s.view(B, 1, M)
    better = sj - si if largest else si - sj  # (B, M, M) [b, i, j]: > 0 where j scores better than i
    # j comes before i: 1 where it scores better, ``earlier`` where equal (a float sum: no cast of a bool)
    return torch.heaviside(better, cast(earlier, better.dtype)).sum(-1)  # (B, M)


def group_max(importance: Tensor, src: Tensor, dst: Tensor, stays: Tensor) -> Tensor:
    """A merged group's importance is its members' max (as in the reference code): the tokens at ``src`` (B, K)
    join the tokens at ``dst`` (B, K) except where they ``stays`` (B, K); importance (B, N)."""
    moved = importance.gather(1, src).masked_fill_(stays, float("-inf"))  # (B, K)
    return importance.scatter_reduce(1, dst, moved, reduce="amax", include_self=True)  # (B, N)


def merge_rows(
    x: Tensor,
    size: Tensor,
    rows: Tensor,
    n: int,
    extra: Tensor | None = None,
    average: bool = True,
    weighted: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """ToMe's merge: the rows of x (M, C) with their sizes (M,) summed into rows ``rows`` (M,) of an output of
    ``n`` rows, each output row the size-weighted average of the rows it receives (in at least the size dtype:
    float32 under AMP), its size their sum. ``extra`` (M, K) rows are summed (the patch maps of which patches a
    token covers). Rows are summed in their order. Without ``average`` (every size 1, and each output row receives
    at most one row) the rows are copied; without ``weighted`` every size is 1 (x needs no weights). An output
    row that receives nothing is 0/0 (0 without ``average``); callers cut or replace it.

    Returns:
        x (n, C), size (n,), extra (n, K) or None.
    """
    C = x.shape[1]
    den = torch.zeros(n, dtype=size.dtype, device=size.device).index_add_(0, rows, size)  # (n,)
    if extra is not None:
        extra = torch.zeros(n, extra.shape[1], dtype=extra.dtype, device=extra.device).index_add_(0, rows, extra)
    if not average:
        return torch.zeros(n, C, dtype=x.dtype, device=x.device).index_add_(0, rows, x), den, extra  # (n, C)
    dt = x.dtype if x.dtype == size.dtype else torch.promote_types(x.dtype, size.dtype)
    xs = cast(x, dt) * cast(size, dt).view(-1, 1) if weighted else cast(x, dt)  # (M, C)
    num = torch.zeros(n, C, dtype=dt, device=x.device).index_add_(0, rows, xs)  # (n, C)
    return cast(num / cast(den, dt).view(-1, 1), x.dtype), den, extra  # (n, C), (n,), (n, K)
