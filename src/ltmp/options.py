"""The choices of the commands' options and the training recipes of ``ltmp train --recipe`` (plain data, read by
the command line without torch)."""

from __future__ import annotations

#: How data folders map to a model's classes where they do not match its class names (``--labels``,
#: ``ltmp.data.label_map``): by name, or the sorted folders as its classes 0, 1, ...
LABELS = ("names", "order")
#: Training augmentations (``ltmp.data.transforms_for``).
AUGMENTS = ("timm", "timm-random", "light", "none")
#: Training recipes (``ltmp train --recipe``): the values a recipe gives the options not set on the command line (the
#: rest keep ``ltmp.train.TrainConfig``'s defaults). "paper" is the reference code's (github Mxbonn/ltmp, tools/train.py
#: and ltmp/timm/lt_*.py; docs/training.md has each point, where the reference does it, and the measured effect of
#: switching it to the default): SGD without momentum at the paper's fixed learning rates (5e-6 prune, 5e-3 merge),
#: merge thresholds from 0.9, label smoothing 0.1, the reference's own train-mode softmax (eq. 6 with eps in numerator
#: and denominator) with detached merged averages, the prune mask overwriting a set-A token's merge mask, importance
#: over every query row and A/B over every position (reordered set A, set B) in training, eq. 13 over all tokens with
#: the batch's mean masks, thresholds clamped to [0, 1], timm's augmentation with random interpolation, 2% held out, no
#: settle step, no stop when a block collapses, no check of the first step. Its tau is the paper's 0.1 (the reference's
#: command line defaults to 0.5).
RECIPES: dict[str, dict] = {
    "default": {},
    "paper": dict(
        optimizer="sgd",
        lr_merge=5e-3,
        lr_prune=5e-6,
        merge_init=0.9,
        label_smoothing=0.1,
        mask_grad="reference",
        merge_grad="mask",
        combine="overwrite",
        importance_rows="all",
        train_order="reference",
        budget_tokens="all",
        budget_pool="batch",
        clamp="unit",
        augment="timm-random",
        holdout=0.02,
        settle=False,
        stop_collapsed=False,
        check_first_step=False,
        tau=0.1,
        lam=10.0,
        batch_size=128,
        epochs=1.0,
    ),
}


#: The values of ``ltmp.train.TrainConfig``'s recipe options (the first is the default).
CHOICES = {
    "combine": ("product", "overwrite"),
    "importance_rows": ("survivors", "all"),
    "train_order": ("positions", "reference"),
    "budget_tokens": ("patches", "all"),
    "budget_pool": ("image", "batch"),
    "clamp": ("scores", "unit"),
    "augment": AUGMENTS,
    "recipe": tuple(RECIPES),
}
