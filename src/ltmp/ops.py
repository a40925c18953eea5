"""Pure tensor functions of LTMP (Bonnaerens & Dambre, TMLR 2023, section 3).

Equation numbers follow the order of the paper's LaTeX source:

- eq. 1-3: threshold masking module (hard mask, sigmoid surrogate, recursive mask),
- eq. 4-7: attention, attention with mask, masked softmax, attention logits,
- eq. 16-17: class attention and mean column attention importance scores.

Every function works on a *padded* token set: ``keep`` (B, N) is 1 for surviving tokens and 0 for tokens that
were pruned, merged away, or are padding. Decisions only ever look at surviving tokens, so the same function gives
the same decisions whether removed tokens are still in the tensor (train mode) or gathered out (eval mode).
Nothing here knows about timm.
"""
from __future__ import annotations

import collections
import contextlib
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _python_dispatch

from .errors import LtmpError


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``; ``t`` itself when it already is (no operator call, which counts at batch 1 and on GPUs)."""
    return t if t.dtype == dtype else t.to(dtype)


def wide(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)`` for a float dtype, decided in Python (no operator call)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types(a, b)``, without an operator call when they are equal."""
    return a if a == b else torch.promote_types(a, b)


def tracing() -> bool:
    """True while torch.compile or torch.export traces (``torch.compiler.is_compiling``, torch >= 2.3)."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None) or getattr(torch._dynamo, "is_compiling",
                                                                                  None)
    return fn is not None and bool(fn())


#: small constants kept for reuse, least recently used first; some are per batch size and token count, so at most
#: MAX_CONSTANTS are kept (a server that sees many batch sizes would otherwise keep one set per size forever)
_CONSTANTS: collections.OrderedDict[tuple, Tensor] = collections.OrderedDict()
_IN_GRAPHS: set[tuple] = set()  # constants a CUDA graph captured: never dropped (the graph reads their memory)
MAX_CONSTANTS = 512
_LOCK = threading.Lock()


def _dispatch_mode():
    """The innermost active tensor mode (FakeTensorMode, FlopCounterMode, ...), or None."""
    return getattr(_python_dispatch, "_get_current_dispatch_mode", lambda: None)()


def _capturing(t: Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _cached(key: tuple, make) -> Tensor:
    """A small constant tensor kept for reuse, made outside inference mode (so autograd may save it) and never
    written to. A fresh one, not kept, while torch.compile, torch.export or torch.jit traces, under a fake or other
    tensor mode, and while a CUDA graph is captured (none of those tensors may outlive it). Beyond
    ``MAX_CONSTANTS`` the least recently used is dropped, unless a CUDA graph captured it."""
    fresh = tracing() or torch.jit.is_tracing() or _dispatch_mode() is not None
    if not fresh:
        with _LOCK:  # forwards in several threads share the constants
            t = _CONSTANTS.get(key)
            if t is not None:
                _CONSTANTS.move_to_end(key)
                if _capturing(t):
                    _IN_GRAPHS.add(key)
                return t
    with torch.inference_mode(False):
        t = make()
    if not fresh and type(t) is torch.Tensor and not _capturing(t):
        with _LOCK:
            _CONSTANTS[key] = t
            if len(_CONSTANTS) > MAX_CONSTANTS:
                old = next((k for k in _CONSTANTS if k not in _IN_GRAPHS), None)
                if old is not None:
                    del _CONSTANTS[old]
    return t


def reshaped(t: Tensor, *shape: int) -> Tensor:
    """``t.reshape(*shape)``, as a view in one operator call where ``t`` is contiguous (``reshape`` makes 2). While
    tracing, ``reshape`` itself: asking whether a tensor of data-dependent size is contiguous would guard on it."""
    return t.view(*shape) if not tracing() and t.is_contiguous() else t.reshape(*shape)


def flat_rows(t: Tensor) -> Tensor:
    """``t`` (..., K) as a matrix of rows (M, K)."""
    return reshaped(t, -1, t.shape[-1])


def writable(t: Tensor) -> bool:
    """Whether an eval step may write its result over the intermediate ``t`` (``out=t``): not with gradients
    (``out=`` has no autograd), and not while tracing (a jit trace made without gradients would fail when run with
    them)."""
    return not (torch.is_grad_enabled() or t.requires_grad or tracing() or torch.jit.is_tracing())


def _views(t: Tensor) -> bool:
    """Whether :func:`qkv_heads` and the like may take ``as_strided`` views of ``t``: not while tracing (named
    views trace more simply) and not with gradients (``as_strided``'s backward is slow)."""
    return not (tracing() or torch.jit.is_tracing() or t.requires_grad)


def qkv_heads(qkv: Tensor, heads: int, contiguous: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v (B, H, N, D) from a qkv projection (B, N, 3 * H * D), split as timm's attention splits it:
    ``reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``, or with ``contiguous`` after one copy of all
    three (explicit attention reads them whole). Where :func:`_views` allows, the permuted tensor is one strided
    view (2 operator calls fewer, and less host time, than the reshape and the permute)."""
    B, N, C3 = qkv.shape
    D = C3 // (3 * heads)
    if contiguous or not _views(qkv):
        t = reshaped(qkv, B, N, 3, heads, D).permute(2, 0, 3, 1, 4)  # (3, B, H, N, D)
        return (t.contiguous() if contiguous else t).unbind(0)  # (B, H, N, D) each
    sB, sN, sC = qkv.stride()
    t = qkv.as_strided((3, B, heads, N, D), (heads * D * sC, sB, D * sC, sN, sC), qkv.storage_offset())
    return t.unbind(0)  # (B, H, N, D) each


def heads_merged(o: Tensor) -> Tensor:
    """Attention output (B, H, N, D) as token rows (B, N, H * D): ``o.transpose(1, 2).reshape(B, N, H * D)``. A
    fused kernel's output is laid out (B, N, H, D); there, where :func:`_views` allows, one strided view (2
    operator calls fewer)."""
    B, H, N, D = o.shape
    if _views(o) and o.stride() == (N * H * D, D, H * D, 1):
        return o.as_strided((B, N, H * D), (N * H * D, H * D, 1), o.storage_offset())  # (B, N, H * D)
    return reshaped(o.transpose(1, 2), B, N, H * D)  # (B, N, H * D)


def every_other_row(u: Tensor, first: int, transposed: bool = False) -> Tensor:
    """Rows ``first, first + 2, ...`` of ``u`` (B, N, D), (B, n, D), or with ``transposed`` (B, D, n), as one
    strided view where :func:`_views` allows (a slice and a transpose make 2 operator calls each)."""
    if not _views(u):
        rows = u[:, first::2]  # (B, n, D)
        return rows.transpose(1, 2) if transposed else rows
    B, N, D = u.shape
    sB, sN, sD = u.stride()
    n = max(0, (N - first + 1) // 2)
    size, stride = ((B, D, n), (sB, sD, 2 * sN)) if transposed else ((B, n, D), (sB, 2 * sN, sD))
    return u.as_strided(size, stride, u.storage_offset() + first * sN)


def row_index(index: Tensor, width: int) -> Tensor:
    """Token positions (..., k) as a gather/scatter index of whole rows of ``width`` channels: (..., k, width), an
    expanded view."""
    return index.view(*index.shape, 1).expand(*index.shape, width)


class PackedRows:
    """The real rows of a padded batch flattened to a matrix (B * N, K), at the flat indices ``idx`` (T,): taken
    out as (T, K) and added back. Each row width's gather/scatter index (T, K) is an expanded view of ``idx``,
    made once: ``gather`` with it makes 2 operator calls where ``index_select`` makes 6, and ``scatter_add_`` 1
    where ``index_add_`` makes 3, in about the same time on the CPU (0.9-1.2x, run to run; up to 1.19x for the
    gather at batch 256: benchmarks/packed_index.py). The results are the same: each real row is copied, or added
    once."""

    def __init__(self, idx: Tensor):
        self.idx = idx  # (T,)
        self._index: dict[int, Tensor] = {}  # row width -> (T, K)

    def index(self, width: int) -> Tensor:
        """``idx`` as a (T, width) index of whole rows."""
        if width not in self._index:
            self._index[width] = row_index(self.idx, width)  # (T, width)
        return self._index[width]

    def take(self, flat: Tensor) -> Tensor:
        """The real rows (T, K) of ``flat`` (B * N, K)."""
        return flat.gather(0, self.index(flat.shape[1]))  # (T, K)

    def add(self, flat: Tensor, rows: Tensor) -> Tensor:
        """``flat`` (B * N, K) with ``rows`` (T, K) added at the real rows, in ``flat``'s dtype; in place without
        gradients (the caller's own tensor)."""
        index = self.index(flat.shape[1])  # (T, K)
        rows = cast(rows, flat.dtype)  # (T, K)
        return flat.scatter_add(0, index, rows) if torch.is_grad_enabled() else flat.scatter_add_(0, index, rows)

    def pad(self, rows: Tensor, total: int) -> Tensor:
        """``rows`` (T, K) at the real rows of a (total, K) matrix of zeros."""
        out = torch.zeros(total, rows.shape[1], dtype=rows.dtype, device=rows.device)  # (total, K)
        return out.scatter_add_(0, self.index(rows.shape[1]), rows)  # (total, K); 0 + row is the row


def positions(n: int, device: torch.device, dtype: torch.dtype = torch.long, batch: int | None = None) -> Tensor:
    """``torch.arange(n)`` on ``device``, made once: every block reuses it (an arange is 4 calls); with ``batch``
    a contiguous (batch, n) copy of it in every row."""
    if batch is not None:
        return _cached(("arange", n, device, dtype, batch),
                       lambda: positions(n, device, dtype).expand(batch, n).contiguous())
    return _cached(("arange", n, device, dtype), lambda: torch.arange(n, device=device, dtype=dtype))


def ones(b: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A (b, n) tensor of ones, made once: the keep mask and sizes of tokens nothing has touched. Never written
    to (every step makes new masks and sizes)."""
    return _cached(("ones", b, n, dtype, device), lambda: torch.ones(b, n, dtype=dtype, device=device))


def row_offsets(b: int, n: int, device: torch.device, first: int = 0) -> Tensor:
    """(b, 1): ``n`` times each image's index, plus ``first``, made once; added to per-image indices (b, ...) of n
    rows (counted from ``first``) it gives row indices into the flattened (b * n, ...) batch."""
    return _cached(("offsets", b, n, device, first), lambda: (positions(b, device) * n + first).view(b, 1))


def batch_rows(b: int, n: int, stride: int, device: torch.device) -> Tensor:
    """(b, n): ``stride * i + j``, the row of image i's position j in a flattened (b * stride, ...) batch, made
    once."""
    return _cached(("batch rows", b, n, stride, device), lambda: positions(n, device) + row_offsets(b, stride, device))


def affine(t: Tensor, scale: int, shift: int) -> Tensor:
    """``scale * t + shift`` in one operator call (``torch.add`` of a kept 0-d ``shift`` and ``t`` times
    ``scale``; the expression makes two): token positions from set-A or set-B rows."""
    return torch.add(scalar(shift, t), t, alpha=scale)


def scalar(value: float, like: Tensor) -> Tensor:
    """A 0-d tensor ``value`` in ``like``'s dtype and device, made once: a comparison with it is one call, with a
    Python number five (the number's conversion). Not for ``masked_fill`` (it reads a tensor value on the host)."""
    return _cached(("scalar", value, like.dtype, like.device), lambda: torch.tensor(value, dtype=like.dtype,
                                                                                   device=like.device))


def patch_tokens(n: int, num_prefix: int, device: torch.device) -> Tensor:
    """(n,) bool, False at the ``num_prefix`` prefix tokens, made once (a masked copy is 8 calls, ``&`` with it 2)."""
    return _cached(("patches", n, num_prefix, device), lambda: positions(n, device) >= num_prefix)


def head_sum(k: Tensor) -> Tensor:
    """ToMe's merge metric, the keys averaged over heads, without the division by H: (B, H, N, D) -> (B, N, D), or
    token rows (T, H, D) -> (T, D). Only its cosine similarities are used, which do not change with the scale
    (with a power-of-2 H not even in rounding); the division would be one more operator call (``mean`` makes 9 on
    the CPU, converting H each time)."""
    return k.sum(1)  # (B, N, D) or (T, D)


def threshold_mask(scores: Tensor, threshold: Tensor, tau: float) -> Tensor:
    """Threshold masking module, eq. 1-2, as a straight-through estimator.

    Forwards the hard mask ``scores > threshold`` (eq. 1); backwards the gradient of
    ``sigmoid((scores - threshold) / tau)`` (eq. 2). The form ``hard + (soft - soft.detach())`` makes the
    forward value exactly 0 or 1 (``soft - soft.detach()`` is exactly zero), so train and eval decide alike.

    Args:
        scores: Any shape.
        threshold: A scalar (usually an ``nn.Parameter``).
        tau: Temperature of the sigmoid surrogate.

    Returns:
        Mask of the shape of ``scores``, in the promoted dtype of scores and threshold.
    """
    # torch.result_type(scores, threshold) for a 0-d threshold, in a form torch.compile traces without a break
    dt = scores.dtype if threshold.dim() == 0 else torch.promote_types(scores.dtype, threshold.dtype)
    hard = (scores > threshold).to(dt)  # (...)
    if not (torch.is_grad_enabled() and (scores.requires_grad or threshold.requires_grad)):
        return hard
    soft = torch.sigmoid((scores - threshold) / tau)  # (...)
    return hard + (soft - soft.detach())


def _autocast_on(device_type: str) -> bool:
    """Whether autocast is on for this device type (``torch.is_autocast_enabled(device_type)``, torch >= 2.4)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # older torch: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _autocast_off(device_type: str):
    """A context that runs its matmuls in their inputs' precision, not autocast's (a no-op when autocast is off)."""
    return torch.autocast(device_type, enabled=False) if _autocast_on(device_type) else contextlib.nullcontext()


def _hard(keep: Tensor) -> Tensor:
    """A keep mask's values (exactly 0 or 1, also straight-through ones) without its gradient."""
    return keep.detach() if keep.requires_grad else keep


def key_bias(keep: Tensor | None, log_size: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The additive bias (B, N) of hard masks over the keys: log size (proportional attention), -inf for removed
    keys; None when there is neither."""
    if keep is None and log_size is None:
        return None
    mask = None if keep is None else cast(_hard(keep).log(), dtype)  # (B, N) 0 kept, -inf removed (keep is 0/1)
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
        mask_grad: str = "secant",
) -> tuple[Tensor, Tensor]:
    """Attention with a multiplicative key mask and proportional attention, eq. 5-7.

    ``S_ij = exp(A_ij) m_j / sum_k exp(A_ik) m_k`` (eq. 6) with ``A = QK^T / sqrt(d) + log(size)`` (eq. 7 plus
    ToMe's proportional attention). The result equals attention computed with the masked keys removed: no eps
    leaks probability to removed tokens. When the mask needs a gradient it multiplies, so gradients reach it (a
    ``-inf`` fill would pass none); otherwise (eval) it is the equivalent ``-inf`` fill and a single softmax. The
    softmax runs in fp32 for fp16/bf16 inputs. In the multiplicative form the row max is taken over *kept* keys
    only; ``mask_grad`` bounds the gradient that removed keys pass to their mask (:class:`MaskedSoftmax`).

    Args:
        q, k, v: (B, H, N, D).
        scale: Multiplier of ``q @ k^T``.
        keep: (B, N) 0/1 (straight-through) mask of surviving keys, or None when all survive.
        log_size: (B, N) log of the token sizes, or None when all sizes are 1.
        dropout: Dropout probability on the attention probabilities (0 in eval).
        mask_grad: Form of a removed key's mask gradient, one of :data:`MASK_GRADS`.

    Returns:
        out (B, H, N, D) and the attention probabilities S (B, H, N, N), in fp32 (or float64 for float64 inputs).
    """
    hard = keep is None or not (torch.is_grad_enabled() and keep.requires_grad)
    if hard and not torch.is_grad_enabled() and q.dtype in (torch.float32, torch.float64) \
            and not _autocast_on(q.device.type) and not dropout:
        # eval: 3-D matmuls with the scale and the bias folded in (fewer operator calls)
        B, H, N, D = q.shape
        q3, k3, v3 = (reshaped(t, B * H, N, D) for t in (q, k, v))  # (B * H, N, D) each
        bias = key_bias(keep, log_size, q.dtype)  # (B, N) or None
        if bias is not None:
            bias = bias.view(B, 1, N)  # (B, 1, N)
            if H > 1:  # each head's copy: a concatenation is 2 calls, an expanded reshape 9
                bias = torch.cat([bias] * H, dim=1).view(B * H, 1, N)  # (B * H, 1, N)
        if bias is None:
            attn = torch.bmm(q3, k3.transpose(1, 2)).mul_(scale)  # (B * H, N, N)
        else:
            attn = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=scale)  # (B * H, N, N)
        # in place: one (B * H, N, N) buffer fewer, which glibc malloc would map fresh; 0.97-0.98 of LTMP's time
        # on DeiT-S at batch 32 (benchmarks/ab.py), same values
        probs = torch.softmax(attn, -1, out=attn) if writable(attn) else attn.softmax(dim=-1)  # (B * H, N, N)
        return torch.bmm(probs, v3).view(B, H, N, D), probs.view(B, H, N, N)  # (B, H, N, D), (B, H, N, N)
    attn = (q * scale) @ k.transpose(-2, -1)  # (B, H, N, N)
    attn = cast(attn, wide(attn.dtype))  # fp16/bf16 -> fp32, float64 stays
    if hard:  # no gradient to the mask: one additive bias (log size, -inf where masked) and one softmax
        bias = key_bias(keep, log_size, attn.dtype)  # (B, N) or None
        if bias is not None:
            bias = bias.view(bias.shape[0], 1, 1, -1)  # (B, 1, 1, N)
            attn = attn + bias if attn.requires_grad else attn.add_(bias)  # (B, H, N, N)
        probs = attn.softmax(dim=-1)  # (B, H, N, N)
    else:
        if log_size is not None:
            attn = attn + log_size[:, None, None, :].to(attn.dtype)  # (B, H, N, N)
        probs = MaskedSoftmax.apply(attn, keep.to(attn.dtype), mask_grad)  # (B, H, N, N)
    p = F.dropout(probs, dropout) if dropout else probs
    out = p.to(v.dtype) @ v  # (B, H, N, D)
    return out, probs


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

    - ``"clamp"`` (ltmp before issue #16): the row max is taken over kept keys and removed keys' exponents are
      clamped at it, ``w_ij = min(exp(A_ij - max_kept), 1) / (Z_i exp(-max_kept)) <= 1``;
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


def importance_scores(probs: Tensor, keep: Tensor | None, kind: str) -> Tensor:
    """Token importance from the attention probabilities.

    - ``"mean"``: mean column attention, eq. 17: ``s_i = 1/(h n) sum_heads sum_k S_hki``, averaged over heads and
      over the *surviving* query rows k (prefix rows included, unweighted).
    - ``"cls"``: class attention, eq. 16: ``s_i = sum_heads S_h0i`` (sums over heads, so its scale differs).

    Args:
        probs: (B, H, N, N) attention probabilities of eq. 6.
        keep: (B, N) survivors (None: all).
        kind: ``"mean"`` or ``"cls"``.

    Returns:
        (B, N) scores.
    """
    if kind == "cls":
        return probs[:, :, 0, :].sum(dim=1)  # (B, N)
    if keep is None:
        return probs.mean(dim=(1, 2))  # (B, N)
    B, H, N, _ = probs.shape
    rows = cast(_hard(keep), probs.dtype)  # (B, N)
    rows = torch.cat([rows] * H, dim=1).view(B, 1, H * N)  # (B, 1, H * N) each head's query rows
    w = rows / rows.sum(dim=2, keepdim=True)  # (B, 1, H * N) weight of each query row, 1 / (H n)
    # one pass over the probabilities: (B, 1, H*N) @ (B, H*N, N), in the probabilities' precision (not autocast's)
    with _autocast_off(probs.device.type):
        return torch.bmm(w, reshaped(probs, B, H * N, N)).view(B, N)  # (B, N)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None
                       ) -> tuple[Tensor, Tensor] | None:
    """A fused attention kernel that also returns the log-sum-exp of each query row, or None where none is at hand.

    CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``; CUDA: the memory-efficient kernel
    (``aten._scaled_dot_product_efficient_attention``, whose log-sum-exp may be padded past N). Eval only (no
    dropout, no gradient to a mask).

    Args:
        q, k, v: (B, H, N, D).
        bias: (B, 1, 1, N) additive bias of the keys (log size, -inf where removed), or None.

    Returns:
        out (B, H, N, D) and lse (B, H, N) in at least float32, ``logsumexp_j(scale q_i . k_j + bias_j)``.
    """
    B, H, N, _ = q.shape
    if not (q.dtype == k.dtype == v.dtype):
        return None
    mask = None
    try:
        if q.device.type == "cpu":
            mask = None if bias is None else cast(bias, q.dtype).expand(B, H, N, N)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask,
                                                                                   scale=scale)
        elif q.device.type == "cuda" and q.dtype != torch.float64:
            if bias is not None:  # the kernel wants the bias rows aligned (as SDPA pads them): 16 columns
                width = -(-N // 16) * 16
                mask = bias.new_zeros(B, 1, 1, width, dtype=q.dtype)
                mask[..., :N] = bias
                mask = mask[..., :N].expand(B, H, N, N)
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, scale=scale)[:2]
        else:
            return None
    except (AttributeError, NotImplementedError, RuntimeError):  # an older torch or an unsupported shape
        return None
    return out, lse[..., :N]


def importance_from_lse(q: Tensor, k: Tensor, lse: Tensor, scale: float, bias: Tensor | None, keep: Tensor | None,
                        kind: str, chunk: int = 1 << 22) -> Tensor:
    """:func:`importance_scores` from the log-sum-exp of a fused attention kernel, without its probabilities.

    The probability of query i for key j is ``exp(scale q_i . k_j + bias_j - lse_i)`` (eq. 6), so one more
    ``q k^T`` pass gives them back: for ``"cls"`` only row 0 (O(N) per head), for ``"mean"`` every row, in
    chunks of query rows of about ``chunk`` elements, summed into the column means as they come (the (B, H, N, N)
    matrix never exists at once). In at least float32, as the explicit probabilities.

    Args:
        q, k: (B, H, N, D); lse: (B, H, N) from :func:`attention_with_lse`; bias: (B, 1, 1, N) or None.
        keep: (B, N) survivors (None: all); kind: ``"mean"`` (eq. 17) or ``"cls"`` (eq. 16).

    Returns:
        (B, N) scores.
    """
    B, H, N, _ = q.shape
    dt = wide(lse.dtype)
    kt = k.transpose(-2, -1)  # (B, H, D, N)
    b = None if bias is None else cast(bias, dt)  # (B, 1, 1, N)

    def probs(rows: slice) -> Tensor:  # (B, H, n, N) probabilities of these query rows
        s = cast(q[:, :, rows] @ kt, dt) * scale  # (B, H, n, N)
        if b is not None:
            s = s + b
        return (s - cast(lse[:, :, rows, None], dt)).exp_()

    if kind == "cls":
        return probs(slice(0, 1))[:, :, 0].sum(dim=1)  # (B, N)
    w = q.new_ones(B, N, dtype=dt) if keep is None else (keep > 0.5).to(dt)  # (B, N) query rows averaged over
    w = w / (H * w.sum(dim=1, keepdim=True))  # (B, N)
    step = max(1, chunk // max(1, B * H * N))
    total = None
    for i in range(0, N, step):
        p = probs(slice(i, i + step))  # (B, H, n, N)
        with _autocast_off(q.device.type):  # the sum in the probabilities' precision, as importance_scores
            part = torch.einsum("bhqn,bq->bn", p, w[:, i:i + step])  # (B, N)
        total = part if total is None else total + part
    return total


def bipartite_sets(keep: Tensor, num_prefix: int) -> tuple[Tensor, Tensor]:
    """The alternating A/B split of ToMe over the surviving tokens, in their order.

    Survivors are numbered 0, 1, 2, ... in sequence order, prefix tokens included (as ToMe does in the first
    block); even ranks form set A, odd ranks set B. Prefix tokens are then taken out of both sets: they are never
    merged away and never a merge target.

    Args:
        keep: (B, N) survivors.
        num_prefix: Number of prefix tokens at the front of the sequence.

    Returns:
        Boolean masks ``is_a`` and ``is_b``, each (B, N).
    """
    alive = keep > 0.5  # (B, N)
    rank = alive.long().cumsum(dim=1) - 1  # (B, N)
    mergeable = alive.clone()
    mergeable[:, :num_prefix] = False
    even = rank % 2 == 0  # (B, N)
    return mergeable & even, mergeable & ~even


def cosine_similarity(metric: Tensor, first_a: int | None = None) -> Tensor:
    """Cosine similarities between the rows of ``metric``, in at least float32 also under autocast: merge
    decisions compare these scores with a threshold (eq. 1), and bf16 rounds them to steps of 1/256 near 1, where
    similar tokens lie, so whole groups of scores would tie at a threshold.

    Args:
        metric: (B, N, D) or (N, D), one row per token (rows are normalised once).
        first_a: None: every row with every row (..., N, N). Else ToMe's split of contiguous tokens: rows
            ``first_a, first_a + 2, ...`` (set A) with the odd rows (set B), (..., Na, Nb).
    """
    u = cast(metric, wide(metric.dtype))
    u = u / u.norm(dim=-1, keepdim=True)  # (..., N, D) rows of norm 1
    with _autocast_off(u.device.type):  # bmm/mm, not matmul: its folding would guard on whether N is even
        if u.dim() == 2:
            a, b = (u, u) if first_a is None else (u[first_a::2], u[1::2])  # (Na, D), (Nb, D)
            return torch.mm(a, b.T)  # (Na, Nb)
        if first_a is None:
            return torch.bmm(u, u.transpose(1, 2))  # (B, N, N)
        return torch.bmm(every_other_row(u, first_a), every_other_row(u, 1, transposed=True))  # (B, Na, Nb)


def row_max(t: Tensor) -> tuple[Tensor, Tensor]:
    """The maximum over the last dimension of ``t`` and its index, the first one on ties (``torch.max``); without
    a gradient as ``amax`` and ``argmax``, which take 5 operator calls instead of 9."""
    if t.requires_grad:
        return t.max(dim=-1)
    return t.amax(dim=-1), t.argmax(dim=-1)


def best_match(metric: Tensor, is_a: Tensor, is_b: Tensor) -> tuple[Tensor, Tensor]:
    """Similarity score of each A token: its highest cosine similarity with any B token (ToMe).

    Args:
        metric: (B, N, D) keys summed over heads (ops.head_sum; any scale).
        is_a, is_b: (B, N) set masks from :func:`bipartite_sets`.

    Returns:
        ``score`` (B, N), -inf outside set A or where B is empty; ``dst`` (B, N) index of the best B token
        (the first one on ties).
    """
    sim = cosine_similarity(metric)  # (B, N, N)
    sim = sim.masked_fill(~is_b[:, None, :], float("-inf"))
    score, dst = row_max(sim)  # (B, N), (B, N)
    score = score.masked_fill(~is_a, float("-inf"))
    return score, dst


def best_match_contiguous(metric: Tensor, keep: Tensor, num_prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`bipartite_sets` + :func:`best_match` for survivors stored contiguously (eval mode after compaction).

    Survivor ranks are then the positions themselves, so A and B are the even and odd positions, as in ToMe's
    ``metric[::2]`` / ``metric[1::2]`` split, and the similarity matrix is (N/2) x (N/2) instead of N x N. B tokens
    stay in sequence order, so ties resolve exactly as in :func:`best_match`.

    Args:
        metric: (B, N, D) keys summed over heads (ops.head_sum; any scale).
        keep: (B, N) survivors, all at the front of each row (padding after them).
        num_prefix: Prefix tokens at the front.

    Returns:
        ``score`` (B, N), ``dst`` (B, N) and ``is_a`` (B, N), as :func:`best_match` and :func:`bipartite_sets`.
    """
    B, N, _ = metric.shape
    pos = torch.arange(N, device=metric.device)
    alive = (keep > 0.5) & (pos >= num_prefix)  # (B, N) mergeable survivors
    sim = cosine_similarity(metric, first_a=0)  # (B, Na, Nb)
    sim = sim.masked_fill(~alive[:, None, 1::2], float("-inf"))
    if sim.shape[-1] == 0:  # a single token left: nothing to merge into
        best, j = sim.new_full(sim.shape[:2], float("-inf")), torch.zeros(sim.shape[:2], dtype=torch.long,
                                                                           device=sim.device)
    else:
        best, j = row_max(sim)  # (B, Na)
    is_a = torch.zeros_like(alive)
    is_a[:, ::2] = alive[:, ::2]
    score = torch.full((B, N), float("-inf"), dtype=best.dtype, device=best.device)
    score[:, ::2] = best.masked_fill(~alive[:, ::2], float("-inf"))
    dst = torch.zeros(B, N, dtype=torch.long, device=metric.device)
    dst[:, ::2] = (2 * j + 1).clamp(max=N - 1)  # in range even where set B is empty (such rows never merge)
    return score, dst, is_a


def topk_mask(scores: Tensor, candidates: Tensor, k: Tensor, largest: bool) -> Tensor:
    """Select the ``k`` highest (or lowest) scoring candidates per image.

    Ties are broken by sequence position, which padding never changes.

    Args:
        scores: (B, N).
        candidates: (B, N) bool, tokens that may be selected.
        k: (B,) how many to select per image (clamped to the number of candidates).

    Returns:
        (B, N) bool mask of the selected tokens.
    """
    fill = float("-inf") if largest else float("inf")
    s = scores.detach().to(wide(scores.dtype)).masked_fill(~candidates, fill)
    order = torch.sort(s, dim=1, descending=largest, stable=True).indices  # (B, N)
    rank = torch.empty_like(order).scatter_(1, order, positions(s.shape[1], s.device).expand_as(order))
    return (rank < k[:, None]) & candidates  # (B, N)


def merge_tokens(
        x: Tensor,
        size: Tensor,
        merge: Tensor,
        dst: Tensor,
        extra: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Merge every token with ``merge == 1`` into its destination as a size-weighted average.

    ``x_dst <- (size_dst x_dst + sum_a size_a x_a) / (size_dst + sum_a size_a)`` and the sizes add up. The
    (straight-through) merge mask multiplies the weights, so gradients reach the merge thresholds. Tokens that
    receive nothing are returned bit-identical.

    Args:
        x: (B, N, C) tokens.
        size: (B, N) how many patches each token stands for.
        merge: (B, N) 0/1 mask of the tokens merged away (straight-through values allowed).
        dst: (B, N) destination index of each token.
        extra: Optional (B, N, K) per-token rows that are summed (not averaged) into the destination, e.g. the
            source map of which patches a token covers.

    Returns:
        The new x (B, N, C), size (B, N) and extra (B, N, K).
    """
    dt = promote(x.dtype, size.dtype)  # weighted sums in at least the size dtype (fp32 under AMP)
    xs = x.to(dt)
    w = merge.to(dt) * size  # (B, N)
    den = size.to(dt).scatter_add(1, dst, w)  # (B, N)
    num = (xs * size[..., None]).scatter_add(1, dst[..., None].expand_as(xs), xs * w[..., None])  # (B, N, C)
    received = torch.zeros_like(w).scatter_add(1, dst, merge.detach().to(dt)) > 0  # (B, N)
    # Tokens that receive nothing are returned unchanged, without the surrogate gradient of would-be merges:
    # passing it (x.detach() + (q - q.detach())) was measured to derail threshold training on the CIFAR-10 ViT
    # (r_target 0.5 ended at held-out r_FLOPs 0.225, and 1 point below ToMe); see docs/training.md.
    x = torch.where(received[..., None], (num / den[..., None]).to(x.dtype), x)  # (B, N, C)
    if extra is not None:
        hard = (merge.detach() > 0.5).to(extra.dtype)
        extra = extra.scatter_add(1, dst[..., None].expand_as(extra), extra * hard[..., None])  # (B, N, K)
    return x, den.to(size.dtype), extra


def group_max(scores: Tensor, merge: Tensor, dst: Tensor) -> Tensor:
    """A merged token's importance is the max over its group (as in the reference code).

    Args:
        scores: (B, N).
        merge: (B, N) merged-away mask.
        dst: (B, N) destinations.

    Returns:
        (B, N) scores with each destination raised to its group's max.
    """
    src = scores.masked_fill(merge.detach() <= 0.5, float("-inf"))  # (B, N)
    return scores.scatter_reduce(1, dst, src, reduce="amax", include_self=True)


def contract(alive: Tensor, x: Tensor, size: Tensor, source: Tensor | None = None, merge: Tensor | None = None,
             dst: Tensor | None = None, counts: list[int] | None = None, rank: Tensor | None = None,
             real: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor, list[int]]:
    """Eval mode: compaction, with the merges of eq. 7 (size-weighted averages, sizes add up) in the same scatter.

    Each surviving token goes to its slot (its rank among the image's survivors, so order is kept); a token
    merged into a survivor adds its size-weighted value to that survivor's slot; every other token goes to a
    dump slot that is cut off. Each image's survivors end up at the front, zero-padded to the longest image. O(B N)
    (a cumulative sum and a scatter), without sorting.

    Args:
        alive: (B, N) bool, the tokens that survive the block.
        x: (B, N, C) tokens, or the packed rows (T, C) of the real ones at the flat positions ``real`` (T,).
        size: (B, N) patches per token; source: (B, N, N0) patch map, or None.
        merge: (B, N) bool, tokens merged away into ``dst`` (B, N) positions, or None.
        counts: each image's survivors, if known on the host: then nothing is read back.
        rank: ``alive.cumsum(1)``, if the caller has it (:func:`slots`).
        real: see x.

    Returns:
        x (B, N', C) (packed input: packed rows of the survivors (T', C), or (B, N', C) if no image is padded),
        size (B, N'), source (B, N', N0) or None, the new keep mask (B, N') and ``counts`` (read back from the
        device when not given: the one host synchronisation of a learned-threshold block).
    """
    target, counts = slots(alive, counts, rank)  # (B, N)
    if merge is not None:  # a token merged into a survivor joins its slot (into a removed token: the dump)
        target = torch.where(merge, target.gather(1, dst), target)  # (B, N)
    return gather_slots(target, max(counts), x, size, source, merge is not None, real, sum(counts)) + (counts,)


def slots(alive: Tensor, counts: list[int] | None = None, rank: Tensor | None = None) -> tuple[Tensor, list[int]]:
    """Where :func:`contract` puts each token (B, N): a row of the flattened (B * n + 1, ...) output, n =
    ``max(counts)``: image i's survivors ``alive`` (B, N) at rows ``n * i + rank`` (their order kept), every removed
    token at the one dump row ``B * n`` (cut off); and ``counts``, each image's survivors (read back from the device
    when not given). ``rank``: ``alive.cumsum(1)``, if the caller has it."""
    B = alive.shape[0]
    rank = alive.cumsum(1) if rank is None else rank  # (B, N) survivors up to each position
    if counts is None:
        counts = rank[:, -1].tolist()  # the one host synchronisation
    n = max(counts)
    return (rank + row_offsets(B, n, alive.device, first=-1)).masked_fill_(~alive, B * n), counts  # (B, N)


def into_rows(flat: Tensor, rows: Tensor, total: int, add: bool = True) -> Tensor:
    """The rows of ``flat`` (M, ...) summed (``add``) or copied into ``rows`` (M,) of a (total, ...) tensor, 0 where
    nothing lands. Token rows (M, K) move with ``index_add_`` / ``index_copy_`` of whole rows (2-3x faster than a
    scatter along dim 1 on the CPU), sizes (M,) or (M, 1) with a scatter (2 operator calls, ``index_add_`` makes
    3-4)."""
    out = torch.zeros(total, *flat.shape[1:], dtype=flat.dtype, device=flat.device)  # (total, ...)
    if flat.dim() == 1 or (flat.dim() == 2 and flat.shape[1] == 1):
        index = rows if flat.dim() == 1 else rows.view(-1, 1)  # (M,) or (M, 1)
        return out.scatter_add_(0, index, flat) if add else out.scatter_(0, index, flat)
    return out.index_add_(0, rows, flat) if add else out.index_copy_(0, rows, flat)


def weighted_sums(x: Tensor, size: Tensor, rows: Tensor, total: int, weighted: bool = True
                  ) -> tuple[Tensor, Tensor]:
    """Eq. 7's sums: the tokens x (B, N, C) times their sizes (B, N) and the sizes, each added into its row of
    ``rows`` (B * N,): (total, C) and (total, 1), in at least the size dtype (fp32 under AMP). ``weighted``: some
    size may differ from 1 (else x is added as it is). The sizes stay a column, as the division by them wants them
    (2 reshapes fewer than a scatter of (B * N,) sizes)."""
    dt = promote(x.dtype, size.dtype)
    s = reshaped(cast(size, dt), -1, 1)  # (B * N, 1)
    xw = flat_rows(cast(x, dt))  # (B * N, C)
    if weighted:
        xw = xw * s  # (B * N, C)
    return into_rows(xw, rows, total), into_rows(s, rows, total)  # (total, C), (total, 1)


def gather_slots(target: Tensor, n_new: int, x: Tensor, size: Tensor, source: Tensor | None, merged: bool,
                 real: Tensor | None = None, n_real: int = 0) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """The tokens x (B, N, C), sizes (B, N) and patch maps (B, N, N0) summed into their rows ``target`` (B, N) of
    :func:`slots`, ``n_new`` per image plus the dump row (cut off): each slot's tokens as a size-weighted average if
    ``merged`` (sizes add up), else a copy. Returns x (B, n_new, C), size (B, n_new), source (B, n_new, N0) or None
    (contiguous) and the keep mask (B, n_new), 1 at real tokens and 0 at padding.

    x may be the packed rows (T, C) of the real tokens at the flat positions ``real`` (T,) of the (B, N) batch;
    x is then returned as packed rows of the ``n_real`` new real tokens (T', C), in their order (image by image),
    or as (B, n_new, C) if no image is padded. The same sums in the same order as the padded batch's: the same bits."""
    B = target.shape[0]
    rows, total = target.view(-1), B * n_new + 1  # (B * N,), rows of the output with the dump row

    def cut(t: Tensor) -> Tensor:  # (total, ...) -> (B, n_new, ...) without the dump row
        return t[:B * n_new].view(B, n_new, *t.shape[1:])

    if real is not None:  # packed rows
        x = _packed_slots(target, real, n_real, x, size, n_new, merged)  # (T', C) or (B, N', C)
        size = cut(into_rows(reshaped(size, -1), rows, total, add=merged))  # (B, N')
        if source is not None:
            source = cut(into_rows(flat_rows(source), rows, total))  # (B, N', N0)
        return x, size, source, _hard(size).sign()
    if not merged:  # survivors only: exact copies
        x = cut(into_rows(flat_rows(x), rows, total, add=False))  # (B, N', C)
        size = cut(into_rows(reshaped(size, -1), rows, total, add=False))  # (B, N')
    else:  # every survivor becomes the size-weighted average of its group (one pass: those that received
        # nothing are x * s / s, equal to x up to rounding, as a batched matmul differs from a single one)
        num, den = (cut(t) for t in weighted_sums(x, size, rows, total))  # (B, N', C), (B, N', 1); 0 for padding
        den_c = den.clamp_min(1.0)  # (B, N', 1)
        x = cast(num / den_c if num.requires_grad else num.div_(den_c), x.dtype)  # (B, N', C)
        size = cast(den.view(B, n_new), size.dtype)  # (B, N')
    if source is not None:
        source = cut(into_rows(flat_rows(source), rows, total))  # (B, N', N0) patch maps add up
    return x, size, source, _hard(size).sign()  # every real token stands for >= 1 patch, padding for 0


def _packed_slots(target: Tensor, real: Tensor, n_real: int, x: Tensor, size: Tensor, n_new: int, merged: bool
                  ) -> Tensor:
    """:func:`gather_slots`'s x for packed rows x (T, C) at the flat positions ``real`` (T,) of the (B, N) batch:
    the ``n_real`` new real tokens as packed rows (T', C), image by image, or (B, n_new, C) when none is padding
    (the packed order is then the padded one)."""
    B = target.shape[0]
    slot = reshaped(target, -1)  # (B * N,)
    hit = slot.new_zeros(B * n_new + 1).index_fill_(0, slot, 1)  # (B * n_new + 1,) the rows some token lands in
    # a slot's packed row is the number of slots before it; the dump row (last, hit if anything is removed)
    # becomes row n_real, cut off
    rows = hit.cumsum(0).sub_(1).index_select(0, slot.index_select(0, real))  # (T,) each packed row's new row
    if not merged:
        out = into_rows(x, rows, n_real + 1, add=False)[:n_real]  # (T', C)
    else:
        s = reshaped(size, -1).index_select(0, real)  # (T,)
        num, den = weighted_sums(x.view(1, *x.shape), s.view(1, -1), rows, n_real + 1)  # (T' + 1, C), (T' + 1, 1)
        out = cast(num[:n_real].div_(den[:n_real].clamp_min(1.0)), x.dtype)  # (T', C)
    return out.view(B, n_new, x.shape[1]) if n_real == B * n_new else out  # (B, n_new, C) or (T', C)


def plan_buckets(counts: list[int], pair_cost: float, group_cost: float, max_buckets: int = 4,
                 max_splits: int = 48) -> list[tuple[list[int], int]] | None:
    """Group the images of a padded batch by token count, so that attention runs on less padding.

    Attention costs an image ``pair_cost * n^2`` for the ``n`` tokens of its group's longest member, and each
    group a fixed ``group_cost`` (its gathers and kernel calls); one group for the whole batch is plain padding.
    Images sorted by count are split into at most ``max_buckets`` consecutive groups of least total cost, by
    dynamic programming over split points on the host (the counts compaction already synchronised). Splits only
    fall where the count changes (splitting equal counts never helps), and at most ``max_splits`` such places are
    considered (evenly spread, for very large batches); below that the plan is exact.

    Args:
        counts: Tokens of each image (survivors, prefix included).
        pair_cost: Cost of one (query, key) pair, e.g. its multiply-accumulates.
        group_cost: Fixed cost of one more group, in the same unit.
        max_buckets: Most groups to form.
        max_splits: Most places to consider for a split.

    Returns:
        ``[(image indices, group length), ...]`` or None when one group is cheapest.
    """
    B = len(counts)
    if B < 2 or max_buckets < 2:
        return None
    order = sorted(range(B), key=counts.__getitem__)
    c = [counts[i] for i in order]  # ascending
    ends = [j for j in range(1, B) if c[j] != c[j - 1]]  # a group may end before these sorted positions
    if not ends:
        return None
    if len(ends) > max_splits:
        ends = [ends[round(k * (len(ends) - 1) / (max_splits - 1))] for k in range(max_splits)]
    pts = np.array([0] + ends + [B])  # (P,) candidate group boundaries
    P = len(pts)
    # a group over sorted images pts[i]:pts[j] costs (pts[j] - pts[i]) * last[j] + group_cost (its longest last)
    last = pair_cost * np.array([0] + [c[j - 1] for j in pts[1:]], dtype=np.float64) ** 2  # (P,)
    span = (pts[None, :] - pts[:, None]) * last[None, :]  # (P, P) [i, j]
    later = np.triu(np.ones((P, P), dtype=bool), k=1)  # (P, P) i < j: a group ends after it starts
    # best[g][j]: cheapest split of the sorted images before pts[j] into g groups; cut[g][j]: its last start
    best, cut = [np.full(P, np.inf)], [np.zeros(P, dtype=np.int64)]
    best[0][0] = 0.0
    for _ in range(max_buckets):
        cost = np.where(later, best[-1][:, None] + span + group_cost, np.inf)  # (P, P)
        cut.append(cost.argmin(0))  # (P,) the first cheapest start on ties
        best.append(cost[cut[-1], np.arange(P)])  # (P,)
    g = min(range(1, max_buckets + 1), key=lambda n: best[n][P - 1])
    if g == 1:
        return None
    groups, j = [], P - 1
    while g > 0:
        i = int(cut[g][j])
        groups.append((order[pts[i]:pts[j]], c[pts[j] - 1]))
        j, g = i, g - 1
    return groups[::-1]
