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

from .config import MASK_GRADS
from .errors import LtmpError


def wide(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float32 for a narrower float: scores and attention probabilities are never below float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def exact(device_type: str):
    """A context in which matmuls run in their inputs' precision: autocast off where it is on."""
    on = torch.is_autocast_enabled(device_type)
    return torch.autocast(device_type, enabled=False) if on else contextlib.nullcontext()


def threshold_mask(scores: Tensor, threshold: Tensor, tau: float, soft: bool) -> tuple[Tensor, Tensor | None]:
    """Threshold masking module, eq. 1-2: ``scores > threshold`` (eq. 1), and with ``soft`` also as a
    straight-through estimator whose backward is the gradient of ``sigmoid((scores - threshold) / tau)`` (eq. 2).
    The form ``hard + (soft - soft.detach())`` keeps the forward value exactly 0 or 1, so train and eval decide
    alike.

    Args:
        scores: Any shape. threshold: a scalar (an ``nn.Parameter``). tau: temperature of eq. 2.
        soft: train mode: also the straight-through form, in the promoted dtype.

    Returns:
        The bool mask, and the straight-through mask with ``soft`` (else None); both shaped as ``scores``.
    """
    hard = scores > threshold  # (...)
    if not soft:
        return hard, None
    s = torch.sigmoid((scores - threshold) / tau)  # (...)
    return hard, hard.to(s.dtype) + (s - s.detach())


def key_bias(keep: Tensor | None, log_size: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The additive bias (B, N) over the keys of hard masks: log size (proportional attention) and -inf at removed
    keys; None when there is neither."""
    bias = None if keep is None else keep.detach().to(dtype).log()  # (B, N) 0 kept, -inf removed (keep is 0/1)
    if log_size is not None:
        bias = log_size.to(dtype) if bias is None else bias + log_size.to(dtype)
    return bias


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    keep: Tensor | None,
    log_size: Tensor | None,
    dropout: float = 0.0,
    mask_grad: str = "secant",
) -> tuple[Tensor, Tensor]:
    """Attention with masked keys and proportional attention, eq. 5-7.

    ``S_ij = exp(A_ij) m_j / sum_k exp(A_ik) m_k`` (eq. 6) with ``A = QK^T / sqrt(d) + log(size)`` (eq. 7 plus
    ToMe's proportional attention) is attention with the masked keys removed, in at least float32. A hard mask is a
    -inf bias (:func:`key_bias`) before one softmax; a straight-through mask (train mode, ``keep.requires_grad``)
    multiplies in eq. 6, so gradients reach it and the thresholds behind it (:class:`MaskedSoftmax`, whose
    ``mask_grad`` form bounds them); the forward is the same.

    Args:
        q, k, v: (B, H, N, D). scale: multiplier of ``q k^T``. keep: (B, N) 0/1, the keys that count (None: all).
        log_size: (B, N) the tokens' log sizes, or None (every size 1).

    Returns:
        out (B, H, N, D) and the probabilities S (B, H, N, N), in at least float32.
    """
    attn = ((q * scale) @ k.transpose(-2, -1)).to(wide(q.dtype))  # (B, H, N, N)
    soft = keep is not None and keep.requires_grad
    bias = key_bias(None if soft else keep, log_size, attn.dtype)  # (B, N) or None
    if bias is not None:
        attn = attn + bias[:, None, None, :]
    probs = straight_through_softmax(attn, keep.to(attn.dtype), mask_grad) if soft else attn.softmax(dim=-1)
    p = F.dropout(probs, dropout) if dropout else probs
    return p.to(v.dtype) @ v, probs  # (B, H, N, D), (B, H, N, N)


#: eps of the reference code's masked softmax (the ``"eps"`` form and :func:`reference_softmax`).
REFERENCE_EPS = 1e-5


def straight_through_softmax(attn: Tensor, keep: Tensor, mask_grad: str) -> Tensor:
    """Eq. 6 with train mode's straight-through mask ``keep`` (B, N) on the logits ``attn`` (B, H, N, N): the
    reference code's own softmax for ``mask_grad="reference"`` (:func:`reference_softmax`), else attention with the
    removed keys left out and ``mask_grad``'s form of their masks' gradient (:class:`MaskedSoftmax`)."""
    if mask_grad == "reference":
        return reference_softmax(attn, keep)
    return MaskedSoftmax.apply(attn, keep, mask_grad)


def reference_softmax(attn: Tensor, keep: Tensor) -> Tensor:
    """The reference code's train-mode masked softmax of eq. 6 (its ``softmax_with_mask``), forward and autograd:
    ``(exp(A_ij - max_k A_ik) m_j + eps / N) / (sum_k exp(A_ik - max_k A_ik) m_k + eps)``, the max over every key.
    Unlike :class:`MaskedSoftmax` its forward is not attention with the removed keys left out: where removed keys
    hold a row's largest logits by more than about ``log(1 / eps)`` (attention sinks, a block that pruned
    everything), eps outweighs the kept keys and the row's attention spreads over every key, removed ones included.

    Args:
        attn: (B, H, N, N) logits. keep: (B, N) straight-through 0/1 mask.
    """
    e = (attn - attn.amax(dim=-1, keepdim=True)).exp() * keep[:, None, None, :]  # (B, H, N, N)
    return (e + REFERENCE_EPS / attn.shape[-1]) / (e.sum(dim=-1, keepdim=True) + REFERENCE_EPS)


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


def importance(probs: Tensor, rows: Tensor | None, kind: str) -> Tensor:
    """Token importance from the attention probabilities S (B, H, N, N) of eq. 6.

    - ``"mean"``: mean column attention, eq. 17: ``s_i = 1/(h n) sum_heads sum_k S_hki``, over the heads and the
      n surviving query rows k, ``rows`` (B, N) 0/1 (None: every row).
    - ``"cls"``: class attention, eq. 16: ``s_i = sum_heads S_h0i`` (sums over heads, so its scale differs).

    Returns:
        (B, N) scores, in the probabilities' precision.
    """
    if kind == "cls":
        return probs[:, :, 0, :].sum(dim=1)  # (B, N)
    if rows is None:  # rows, then heads: ONNX Runtime's mean over both axes at once is 6x slower
        return probs.mean(dim=2).mean(dim=1)  # (B, N)
    w = rows.detach().to(probs.dtype)  # (B, N)
    w = w / w.sum(1, keepdim=True)
    with exact(probs.device.type):
        return (w[:, None, :] @ probs.mean(dim=1)).squeeze(1)  # (B, N)


def match(
    metric: Tensor, blocked: Tensor | None, first: tuple[int, int] = (0, 1), pad: bool = False
) -> tuple[Tensor, Tensor]:
    """ToMe's bipartite matching on tokens in order: set A is every other position from ``first[0]``, set B every
    other one from ``first[1]``, and each A token's score is its highest cosine similarity with a B token (the first
    on ties). Similarities are float32 at least, also under autocast: bf16 rounds them to steps of 1/256 near 1,
    where thresholds sit.

    Args:
        metric: (B, N, D) the merge metric (keys summed over heads; any scale).
        blocked: (B, Na, Nb) bool, the pairs that may not merge (:func:`blocked_pairs`), or None.
        first: the first positions of set A and set B (those past the prefix tokens).
        pad: add a column no token can match, so that an empty set B needs no branch on N (symbolic sizes);
            without it, that column is added only when set B is empty.

    Returns:
        The score (B, Na), -inf where the A token cannot merge or no B token can receive (such a token never
        passes a threshold), and the index j (B, Na) of its B token (position ``first[1] + 2 j``).
    """
    u = metric.to(wide(metric.dtype))
    u = u / u.norm(dim=-1, keepdim=True)  # (B, N, D)
    with exact(u.device.type):
        sim = torch.bmm(u[:, first[0] :: 2], u[:, first[1] :: 2].transpose(1, 2))  # (B, Na, Nb)
    if blocked is not None:
        sim = sim.masked_fill(blocked, float("-inf"))
    if pad or sim.shape[-1] == 0:
        sim = F.pad(sim, (0, 1), value=float("-inf"))  # (B, Na, Nb + 1)
    return sim.max(dim=-1)  # (B, Na) each


def blocked_pairs(mergeable: Tensor, first: tuple[int, int] = (0, 1)) -> Tensor:
    """The (A, B) pairs of :func:`match` that may not merge, (..., Na, Nb) bool, from the tokens (..., N) that may
    merge or receive (survivors past the prefix)."""
    blocked = ~mergeable  # (..., N)
    return blocked[..., first[0] :: 2, None] | blocked[..., None, first[1] :: 2]  # (..., Na, Nb)


def rank(scores: Tensor, largest: bool) -> Tensor:
    """Each token's rank in its row, best first: the number of tokens that come before it (a higher score for
    ``largest``, else a lower one, or an equal score at an earlier position). ``rank < k`` selects the k best of
    each row, ties to the earlier position; tokens that may not be chosen must score -inf (``largest``) or +inf.
    The rank of a stable sort without a sort (ONNX has no stable sort, so eager and exported models select alike).

    Returns:
        (B, M) the ranks, 0 for the best.
    """
    M = scores.shape[1]
    si, sj = scores[:, :, None], scores[:, None, :]  # [b, i, j]
    better = sj > si if largest else sj < si  # (B, M, M): j scores better than i
    earlier = torch.ones(M, M, dtype=torch.bool, device=scores.device).tril(-1)  # (M, M): j comes before i
    return (better | ((sj == si) & earlier)).sum(-1)  # (B, M)


def group_max(importance: Tensor, src: Tensor, dst: Tensor, stays: Tensor) -> Tensor:
    """A merged group's importance is its members' max (as in the reference code): the tokens at ``src`` (B, K)
    join the tokens at ``dst`` (B, K) except where they ``stays`` (B, K); importance (B, N)."""
    moved = importance.gather(1, src).masked_fill(stays, float("-inf"))  # (B, K)
    return importance.scatter_reduce(1, dst, moved, reduce="amax", include_self=True)  # (B, N)


def merge_rows(
    x: Tensor, size: Tensor, rows: Tensor, n: int, extra: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """ToMe's merge: the rows of x (M, C) with their sizes (M,) summed into rows ``rows`` (M,) of an output of ``n``
    rows, each output row the size-weighted average of the rows it receives (in the sizes' dtype, at least float32
    and at least x's), its size their sum. ``extra`` (M, K) rows are summed (which patches a token covers). An
    output row that receives nothing is 0/0; callers cut or replace it.

    Returns:
        x (n, C), size (n,), extra (n, K) or None.
    """
    den = torch.zeros(n, dtype=size.dtype, device=size.device).index_add_(0, rows, size)  # (n,)
    if extra is not None:
        extra = extra.new_zeros(n, extra.shape[1]).index_add_(0, rows, extra)  # (n, K)
    xs = x.to(size.dtype) * size[:, None]  # (M, C) in the sizes' precision (never below float32)
    num = torch.zeros(n, x.shape[1], dtype=size.dtype, device=x.device).index_add_(0, rows, xs)  # (n, C)
    return (num / den[:, None]).to(x.dtype), den, extra  # (n, C), (n,), (n, K)
