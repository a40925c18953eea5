"""What a patched model reduces: the methods and the configuration every block's reduction step reads (plain
data, read by the command line without torch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

#: The order of reduction operations of each method, and whether they use learned thresholds or a fixed rate.
METHODS: dict[str, tuple[tuple[str, ...], str]] = {
    "ltmp": (("merge", "prune"), "threshold"),  # learned thresholds, merge then prune (the paper's default)
    "ltpm": (("prune", "merge"), "threshold"),  # learned thresholds, prune then merge (Table 4)
    "ltm": (("merge",), "threshold"),  # learned thresholds, merging only (Table 5)
    "ltp": (("prune",), "threshold"),  # learned thresholds, pruning only (Table 5)
    "tome": (("merge",), "topk"),  # ToMe: r tokens merged per layer
    "topk-prune": (("prune",), "topk"),  # k least important tokens pruned per layer
    "topk-mp": (("merge", "prune"), "topk"),  # k merged and k pruned per layer
}
#: Methods with learned thresholds (``ltmp train`` trains them; their thresholds files load them).
LEARNED = tuple(m for m, (_, kind) in METHODS.items() if kind == "threshold")
#: Fixed-rate methods (ToMe's ``r``, the top-k baselines' ``k``).
FIXED_RATE = tuple(m for m, (_, kind) in METHODS.items() if kind == "topk")
#: How merge thresholds learn in train mode (``ReduceConfig.merge_grad``).
MERGE_GRADS = ("average", "mask")
#: Train mode's masked softmax (``ReduceConfig.mask_grad``): the form of eq. 6's gradient with respect to a
#: *removed* key's mask (``ltmp.ops.MaskedSoftmax``), or the reference code's own softmax
#: (``ltmp.ops.reference_softmax``).
MASK_GRADS = ("clamp", "eps", "reference", "secant")
#: A removed token's dense output (``ReduceConfig.dense_fill``).
DENSE_FILLS = ("last", "zero")


@dataclasses.dataclass
class ReduceConfig:
    """What the reduction step does; shared by all blocks of a patched model."""

    method: str = "ltmp"  # a key of METHODS
    tau: float = 0.1  # temperature of the sigmoid surrogate, eq. 2
    importance: str = "mean"  # "mean": mean column attention (eq. 17); "cls": class attention (eq. 16)
    num_prefix: int = 1  # prefix tokens (class, distillation, registers) at the front; never reduced
    rate: tuple[int, ...] | None = None  # fixed-rate methods: tokens per layer (r for ToMe, k for top-k)
    mask_grad: str = "secant"  # train mode: bounded form of eq. 6's gradient to removed keys' masks (MASK_GRADS)
    merge_grad: str = "average"  # train mode: merge thresholds learn through the masks of eq. 5-7 and the merged
    #                              averages ("average"), or through the masks only ("mask", the reference code)
    combine: str = "product"  # train mode, a token two of a block's modules decide on (LTMP's set A): its keep mask
    #                           is the product of theirs ("product"), or the later module's replaces the earlier
    #                           one's ("overwrite": the reference code, whose merge threshold then learns only from
    #                           the tokens it merges)
    importance_rows: str = "survivors"  # train mode: eq. 17 averages over the surviving query rows, or over "all"
    #                                     rows, removed ones included (the reference code; eval has only survivors)
    train_order: str = "positions"  # train mode: tokens keep their positions and A/B alternate over the survivors
    #                                 ("positions", as eval), or A/B alternate over all positions and the tokens
    #                                 are reordered set A first, then set B, after every block ("reference")
    trace_source: bool = False  # carry a map of which patches each token covers (for viz)
    dense_output: bool = False  # the family's token outputs per patch (B, N, C), as the unpatched model's
    dense_fill: str = "last"  # a removed token's dense output: the feature it had when removed, or "zero"
    capture: Callable | None = None  # called with each decision's scores (a ``step.Captured``) before eq. 1 reads
    #                                  the threshold: analysis keeps them, calibration sets the threshold from them
    exporting: bool = False  # torch.export traces the model (``ltmp.export`` sets it): token counts are symbolic
    # derived from the fields above when made (``dataclasses.replace`` makes them anew)
    ops: tuple[str, ...] = dataclasses.field(init=False)  # the method's operations in order (METHODS)
    learned: bool = dataclasses.field(init=False)  # learned thresholds (else a fixed rate)
    set_starts: tuple[int, int] = dataclasses.field(init=False)  # the first positions of ToMe's set A (even) and
    #                                                              set B (odd) past the prefix tokens

    def __post_init__(self):
        self.ops, kind = METHODS[self.method]
        self.learned = kind == "threshold"
        p = self.num_prefix
        self.set_starts = (p + p % 2, p + 1 - p % 2)


def identity(t: Tensor) -> Tensor:
    return t


@dataclasses.dataclass
class BlockView:
    """What the reduction needs from one transformer block; an adapter (``ltmp.adapters``) builds it for each
    forward. Shapes: ``C`` model width, ``H`` heads of width ``D``; ``...`` any leading token dimensions."""

    norm1: Callable[[Tensor], Tensor]  # (..., C) -> (..., C): the norm before attention
    qkv: Callable[[Tensor], Tensor]  # (..., C) -> (..., 3 * H * D): queries | keys | values
    heads: int  # H
    head_dim: int  # D
    scale: float  # multiplier of q k^T
    attn_drop: float  # dropout probability on the attention probabilities (0 in eval)
    out: Callable[[Tensor, Tensor], Tensor]  # the heads' output (..., H * D) and the normed input (..., C) ->
    #                                          (..., C): the attention branch after the heads (norm, gate, output
    #                                          projection, dropout, layer scale, drop path), before the residual
    mlp: Callable[[Tensor], Tensor]  # (..., C) -> (..., C): the whole second branch (norm2, MLP, layer scale, drop
    #                                  path), before the residual add
    q_norm: Callable[[Tensor], Tensor] = identity  # (B, H, N, D) per-head query norm
    k_norm: Callable[[Tensor], Tensor] = identity  # (B, H, N, D) per-head key norm
    fused: bool = True  # the family allows scaled_dot_product_attention here
