"""What a patched model reduces: the methods and the configuration every block's reduction step reads."""
from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass
class Execution:
    """Speed choices that do not change results; None takes the device's value from ``ltmp.engine.TUNING``."""

    max_buckets: int | None = None  # attention of a padded eval batch in at most this many groups (1: never)
    group_macs: float | None = None  # the cost of one more attention group, in multiply-accumulates
    importance_from_lse: bool | None = None  # importance from a fused kernel's log-sum-exp (ops.importance_from_lse)


@dataclasses.dataclass
class ReduceConfig:
    """What the reduction step does; shared by all blocks of a patched model."""

    method: str = "ltmp"  # a key of METHODS
    tau: float = 0.1  # temperature of the sigmoid surrogate, eq. 2
    importance: str = "mean"  # "mean": mean column attention (eq. 17); "cls": class attention (eq. 16)
    num_prefix: int = 1  # prefix tokens (class, distillation, registers) at the front; never reduced
    keep_one: bool = False  # pruning always leaves one patch token (models that pool patch tokens)
    rate: tuple[int, ...] | None = None  # fixed-rate methods: tokens per layer (r for ToMe, k for top-k)
    mask_grad: str = "secant"  # train mode: bounded form of eq. 6's gradient to removed keys' masks (ops.MASK_GRADS)
    merge_grad: str = "average"  # train mode: merge thresholds learn through the masks of eq. 5-7 and the merged
    #                              averages ("average"), or through the masks only ("mask", the reference code)
    trace_source: bool = False  # carry a map of which patches each token covers (for viz)
    capture: list | None = None  # analysis: each decision appends its scores and candidates (a Captured)
    fit: tuple[float, float] | None = None  # calibration: set each threshold to the batch quantile that merges /
    #                                         prunes these fractions of the block's candidates (fit_threshold)
    execution: Execution = dataclasses.field(default_factory=Execution)

    @property
    def ops(self) -> tuple[str, ...]:
        return METHODS[self.method][0]

    @property
    def learned(self) -> bool:
        return METHODS[self.method][1] == "threshold"

    @property
    def needs_importance(self) -> bool:
        return "prune" in self.ops

    @property
    def needs_metric(self) -> bool:
        return "merge" in self.ops

    @property
    def set_starts(self) -> tuple[int, int]:
        """The first positions of ToMe's set A (even) and set B (odd) past the prefix tokens."""
        return self.num_prefix + self.num_prefix % 2, self.num_prefix + 1 - self.num_prefix % 2
