"""Lines of the path a reader follows to learn one merge and prune in batched eval (docs/design.md, issue #37).

python benchmarks/path_lines.py
"""

from __future__ import annotations

import inspect

from ltmp import engine, ops, step

PATH = [
    (engine, ["block", "attend", "attention"]),
    (step, ["reduce_step", "decide_merge", "decide_prune", "_apply_rows", "Layout"]),
    (
        ops,
        [
            "threshold_mask",
            "key_bias",
            "masked_attention",
            "importance_scores",
            "head_sum",
            "match",
            "blocked_pairs",
            "group_max",
            "merge_rows",
        ],
    ),
]


def main() -> None:
    total = 0
    for mod, names in PATH:
        for name in names:
            src, start = inspect.getsourcelines(getattr(mod, name))
            total += len(src)
            print(f"{mod.__name__.split('.')[-1]}.py:{start}-{start + len(src) - 1} {name} ({len(src)} lines)")
    print(f"{total} lines in {len(PATH)} files")


if __name__ == "__main__":
    main()
