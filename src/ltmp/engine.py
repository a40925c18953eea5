"""The forward of a patched model: the plan, attention on the token layout, the blocks, and the record.

:func:`forward` is the patched model's ``forward``: the model's adapter (:mod:`ltmp.adapters`) embeds the inputs,
:func:`encode` runs the blocks with the reduction step in each, and the adapter applies the family's head. The mode
is read once into a :class:`ltmp.step.Plan` (train or eval, fixed rates, export, compile); nothing below asks torch
again.

Token layout. Train mode keeps every token in a (B, N, C) tensor with a straight-through keep mask. Eval mode keeps
only the surviving tokens, as rows (T, C) packed image by image (:class:`ltmp.step.Layout`): norms, projections and
the MLP run on the T real tokens, not on a padded batch (a padded batch took 1.49x the time of packed rows for LTMP
at r 0.5 on the DeiT-S shape, batch 32, on the 2-core CPU of docs/performance.md: ``python benchmarks/layout.py``).
Attention runs on the batch padded to its longest image, padding keys masked. Its backend is explicit attention
with its probabilities where the method needs them (the importance of eq. 16/17) or train mode's straight-through
masks need eq. 6's gradient, else ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops
from .config import BlockView, ReduceConfig
from .step import Layout, Plan, StepResult, TokenState, reduce_step

_EXPORTING = False  # set by :func:`exporting` while torch.export traces a patched model


@contextlib.contextmanager
def exporting():
    """Mark a torch.export trace of a patched model for :func:`is_exporting` (``ltmp.export`` does)."""
    global _EXPORTING
    before, _EXPORTING = _EXPORTING, True
    try:
        yield
    finally:
        _EXPORTING = before


#: torch.compiler.is_exporting tells export from compile only from torch 2.14: before, Dynamo replaced the call by
#: a constant True, also under torch.compile (pytorch/pytorch#176347, fixed by #176499).
_TORCH_IS_EXPORTING_EXACT = torch.torch_version.TorchVersion(torch.__version__) >= (2, 14)


def is_exporting() -> bool:
    """True while torch.export traces the model: inside :func:`exporting`, or where ``torch.compiler.is_exporting``
    says so on torch >= 2.14."""
    fn = getattr(torch.compiler, "is_exporting", None)
    return _EXPORTING or (_TORCH_IS_EXPORTING_EXACT and fn is not None and bool(fn()))


def plan(cfg: ReduceConfig, training: bool) -> Plan:
    """The forward's plan, from the mode and the method: read once, passed to every block."""
    symbolic = is_exporting()
    tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    return Plan(train=training, static=not (training or cfg.learned), symbolic=symbolic,
                compiling=tracing and not symbolic)  # fmt: skip


def attend(plan: Plan, view: BlockView, cfg: ReduceConfig, y: Tensor, state: TokenState
           ) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """Attention of eq. 5-7 on the token layout: train mode's (B, N, C) batch with its keep mask, or eval's rows
    (T, C) as the batch padded to its longest image (padding keys masked).

    Returns:
        The output like y, (B, N, H * D) or (T, H * D); the importance (B, N) of eq. 16/17 if the method prunes and
        the merge metric (B, N, D) (keys summed over heads) if it merges, both padded.
    """
    L = state.layout
    B, N, H = L.batch, L.length, view.heads
    qkv = view.qkv(y) if plan.train else L.pad(view.qkv(y))  # (B, N, 3 * H * D)
    q, k, v = qkv.view(B, N, 3, H, -1).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) each
    q, k = view.q_norm(q), view.k_norm(k)
    size = state.size if plan.train else L.pad(state.size)  # (B, N); 0 at padding
    log_size = size.log() if state.merged_once else None  # (B, N); -inf at padding: masked
    keep = state.keep if plan.train else (None if L.real is None or log_size is not None else L.real)  # (B, N)
    prunes = "prune" in cfg.ops
    if keep is not None and keep.requires_grad:  # eq. 6's gradient to the straight-through mask
        o, probs = ops.soft_masked_attention(q, k, v, view.scale, keep, log_size, view.attn_drop, cfg.mask_grad)
    else:
        bias = ops.key_bias(keep, log_size, ops.wide(q.dtype))  # (B, N) or None
        if prunes or not view.fused or (plan.symbolic and cfg.learned):  # (SDPA's mask would guard on counts)
            o, probs = ops.masked_attention(q, k, v, view.scale, bias, view.attn_drop)
        else:
            mask = None if bias is None else bias[:, None, None, :].to(q.dtype)  # (B, 1, 1, N)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=view.attn_drop, scale=view.scale)
    importance = None
    if prunes:  # eq. 17 over the surviving query rows (train: optionally all rows; eval: the real ones)
        rows = L.real if not plan.train else (state.keep if cfg.importance_rows == "survivors" else None)
        importance = ops.importance(probs, rows, cfg.importance)  # (B, N)
    metric = k.sum(1) if "merge" in cfg.ops else None  # (B, N, D)
    o = o.transpose(1, 2).reshape(B * N, -1)  # (B N, H D)
    return (o.view(B, N, -1) if plan.train else L.take(o)), importance, metric


def block(plan: Plan, view: BlockView, blk: nn.Module, x: Tensor, state: TokenState, cfg: ReduceConfig,
          layer: int, rate: int) -> tuple[Tensor, TokenState, StepResult]:  # fmt: skip
    """A pre-norm block with the reduction step between attention and MLP (the paper's Figure 2)."""
    y = view.norm1(x)  # (B, N, C) or (T, C)
    o, importance, metric = attend(plan, view, cfg, y, state)
    x = x + view.out(o, y)
    merge, prune = getattr(blk, "merge_threshold", None), getattr(blk, "prune_threshold", None)
    x, state, step = reduce_step(x, state, cfg, plan, layer, importance, metric, merge, prune, rate)
    return x + view.mlp(x), state, step


def encode(model: nn.Module, x: Tensor) -> tuple[Tensor, TokenState]:
    """The blocks of a patched model with the reduction step in each, on embedded tokens; sets the record.

    Args:
        model: A patched model. x: (B, N, C) tokens entering the first block, prefix tokens first.

    Returns:
        The tokens leaving the last block as a padded batch (B, N', C), before the final norm, and their state
        with padded (B, N') sizes and keep mask (0 at removed and padding tokens; None if neither exists), for the
        family's head (``ltmp.adapters.mean_pool``, ``ltmp.adapters.pool_bias``).
    """
    cfg: ReduceConfig = model.ltmp_config
    adapter = type(model)._ltmp_adapter
    B, N, C = x.shape
    p = plan(cfg, model.training)
    size = torch.ones(B, N, dtype=ops.wide(x.dtype), device=x.device)  # (B, N)
    source = torch.eye(N, dtype=size.dtype, device=x.device).expand(B, N, N) if cfg.trace_source else None
    if p.train:
        state = TokenState(size, Layout(B, N), source=source)
    else:  # rows (T, C)
        x = x.reshape(B * N, C)
        state = TokenState(size.view(-1), Layout(B, N), source=None if source is None else source.reshape(B * N, N))
    steps, padded, sources, keeps = [], [N], [], []
    for i, blk in enumerate(adapter.blocks(model)):
        rate = 0 if cfg.rate is None else cfg.rate[i]
        x, state, step = block(p, adapter.view(model, blk), blk, x, state, cfg, i, rate)
        steps.append(step)
        padded.append(state.layout.length)
        if cfg.trace_source:
            out = _padded(state, p)
            sources.append(out.source[:, :, cfg.num_prefix :])  # (B, N_l, N0 - P)
            keeps.append(out.size > 0 if out.keep is None else out.keep > 0.5)  # (B, N_l)
    out = _padded(state, p)
    x = x if p.train else state.layout.pad(x)  # (B, N', C)
    if not (p.symbolic or torch.jit.is_tracing()):  # exported graphs have no record (their counts are symbolic)
        model.ltmp_record = Record(cfg.method, padded, N - cfg.num_prefix, cfg.num_prefix, steps, out.size.dtype,
                                   x.device, B, sources or None, keeps or None)  # fmt: skip
        if p.train and steps and steps[0].kept_frac.requires_grad:
            model.ltmp_record.counts()  # built now, with its gradients, whatever mode a first read is in
    return x, out


def _padded(state: TokenState, p: Plan) -> TokenState:
    """The state as a padded batch: (B, N) sizes and keep mask (1 surviving, 0 removed or padding; None if
    neither exists), and (B, N, N0) sources if traced."""
    if p.train:
        return state
    L = state.layout
    keep = None if L.real is None else L.real.to(state.size.dtype)  # (B, N)
    source = None if state.source is None else L.pad(state.source)  # (B, N, N0)
    return TokenState(L.pad(state.size), L, keep, source, state.merged_once)


def forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` of a patched model: its adapter's, with :func:`encode` for the blocks."""
    return type(model)._ltmp_adapter.forward(model, encode, *args, **kwargs)


class Record:
    """The record of the last forward of a patched model, overwritten by every forward (read with ``ltmp.stats``).

    Per-layer tensors are (B, L): one row per image, one column per block. They are built on first read from the
    blocks' counts (:class:`ltmp.step.StepResult`), so that a forward nobody inspects launches no operators for it.
    """

    def __init__(self, method: str, padded: list[int], num_patches: int, num_prefix: int, steps: list,
                 dtype: torch.dtype, device: torch.device, batch: int, sources: list[Tensor] | None = None,
                 keeps: list[Tensor] | None = None):  # fmt: skip
        self.method = method  # the patched method
        self.padded = padded  # (L + 1) longest image's tokens entering each block and leaving the last
        self.num_patches = num_patches  # n of eq. 13
        self.num_prefix = num_prefix  # prefix tokens, always kept
        self.sources = sources  # per block (B, N_l, n) patch membership of each token, if traced
        self.keeps = keeps  # per block (B, N_l) survivors, if traced
        self._steps, self._dtype, self._device, self._batch = steps, dtype, device, batch
        self._counts = None  # (merged, pruned, kept, keep_frac) once built

    def counts(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(merged, pruned, kept, keep_frac), built once."""
        if self._counts is None:

            def column(v) -> Tensor:  # (B,) from an int, a host list, a (B,) tensor or a (B, K) mask
                if isinstance(v, int):
                    return torch.full((self._batch,), v, device=self._device)
                if isinstance(v, list):
                    return torch.tensor(v, device=self._device)
                return v.sum(1) if v.dim() == 2 else v

            merged, pruned, kept = (
                torch.stack([column(getattr(s, f)) for s in self._steps], 1) for f in ("merged", "pruned", "kept")
            )  # (B, L) each
            frac = torch.stack([column(s.kept_frac) for s in self._steps], 1).to(self._dtype) / self.num_patches
            keep_frac = torch.cat([torch.ones_like(frac[:, :1]), frac], 1)  # (B, L + 1)
            self._counts, self._steps = (merged, pruned, kept, keep_frac), None
        return self._counts

    @property
    def merged(self) -> Tensor:
        """(B, L) tokens merged away in each block."""
        return self.counts()[0]

    @property
    def pruned(self) -> Tensor:
        """(B, L) tokens pruned in each block."""
        return self.counts()[1]

    @property
    def kept(self) -> Tensor:
        """(B, L) patch tokens left after each block."""
        return self.counts()[2]

    @property
    def keep_frac(self) -> Tensor:
        """(B, L + 1) fraction of patch tokens kept, m-bar of eq. 13 (column 0 is 1); differentiable in train mode."""
        return self.counts()[3]
