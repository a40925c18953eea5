#!/usr/bin/env bash
# Training-free thresholds (ltmp calibrate, both modes) against the thresholds trained by
# benchmarks/cifar10_evidence.py (run that first: it writes runs/cifar10/test-ltmp-light-r*.json).
# Each evaluation runs on the 10,000 CIFAR-10 test images and a paired McNemar test against the trained run.
# About 6 minutes on a 2-core CPU. Results: runs/calib/test-*.json and the log printed here (docs/calibration.md).
set -euo pipefail
D=${D:-../shared/data/cifar10/cifar10-jpeg.tar.gz}
M=${M:-local-dir:../shared/models/vit-cifar10}
LTMP=${LTMP:-.venv/bin/ltmp}
mkdir -p runs/calib
for r in 0.7 0.5; do
  for mode in quantile shared; do
    $LTMP --quiet calibrate --model "$M" --pretrained --data-dir "$D" --r-target $r --mode $mode \
      --output runs/calib/$mode-r$r.safetensors
    $LTMP --quiet eval --model "$M" --pretrained --data-dir "$D" --val-split test \
      --thresholds runs/calib/$mode-r$r.safetensors --json runs/calib/test-$mode-r$r.json \
      --compare runs/cifar10/test-ltmp-light-r$r.json
  done
done
