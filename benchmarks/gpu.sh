#!/usr/bin/env bash
# What a lent GPU should measure, in one call of at most 10 minutes (the device is lent for minutes only).
# Default STEPS, in order of importance (about 9 minutes in all, each step bounded):
#   targets  the speed targets (benchmarks/targets.py, stops starting rows after 7 minutes): DeiT-S and ViT-B
#            shapes, fp32 batch 32 and bf16 batch 256, LTMP at r_FLOPs 0.5, ToMe and top-k at its GMACs, the
#            reference ToMe's own patch if TOME_REF names a checkout of facebookresearch/ToMe; eager first, then
#            compiled (CUDA graphs for dense and fixed rates)
#   profile  wall time against GPU kernel time per forward, DeiT-S batch 32 (benchmarks/profile_step.py; with
#            TOME_REF, the reference ToMe beside ours)
# Further steps (STEPS="..."), each several minutes:
#   check    correctness of the CUDA paths (benchmarks/cuda_check.py)
#   speed    benchmarks/speed.py unchanged on CUDA (fp32: the CPU run's settings)
#   vitb     benchmarks/speed.py on the ViT-B shape, bf16 autocast, batch 256 (a model that keeps the GPU busier)
#   bf16     benchmarks/speed.py on DeiT-S, bf16 autocast, batch 256
#   cli      ltmp bench and a short torchrun training run on CUDA
#   grouping attention in groups of similar token counts on CUDA (off by default there)
#   compile  speed.py with every model under torch.compile (Inductor/Triton), fp32; ltmp bench --compile with
#            learned (calibrated) and ToMe thresholds; a compiled training run
#   compile-vitb  the same speed.py on the ViT-B shape, bf16 autocast, batch 256
# Usage: [STEPS="check speed"] [TOME_REF=DIR] bash benchmarks/gpu.sh OUTDIR   (PYTHONPATH=src:benchmarks)
# TOME_REF: facebookresearch/ToMe's code is not part of ltmp; to time it, put a copy in an ignored folder here,
#   e.g. `git -C MIRROR archive HEAD tome | tar -x -C .gpu/ToMe`, carry .gpu, and pass TOME_REF=.gpu/ToMe.
# Results go to OUTDIR as they come, so a run cut short still leaves what it finished.
# How the logs in results/gpu-run*.log were made, on a machine with torch but another timm and without ../shared:
#   pip download --no-deps timm==1.0.31 -d .whl; cp -r ../shared/models/vit-cifar10 .gpu/   (here, both carried)
#   pip install --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks
#   mkdir -p ../shared/models && cp -r .gpu/vit-cifar10 ../shared/models/; STEPS="..." bash benchmarks/gpu.sh $OUT
# (without ../shared, speed.py falls back to the package's fp16 copy of the CIFAR model).
set -u
OUT=${1:?usage: gpu.sh OUTDIR}
STEPS=${STEPS:-targets profile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "### $* ($(date +%T))"; }
FAILED=()
run() { "$@" || { echo "!!! failed ($?): $*"; FAILED+=("$*"); }; }  # go on, but exit non-zero at the end

step environment
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
run $PY -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, torch.cuda.get_device_name())"

if want targets; then
    step "speed targets: DeiT-S and ViT-B, fp32 batch 32 and bf16 batch 256, eager then compiled"
    run timeout 450 $PY benchmarks/targets.py --device cuda --budget 420 --json "$OUT/targets-cuda.json" \
        ${TOME_REF:+--tome-ref "$TOME_REF"}
fi
if want profile; then
    for m in ltmp tome; do
        step "profile on CUDA: DeiT-S batch 32, $m at r 0.5"
        ref=""
        if [ "$m" = tome ] && [ -n "${TOME_REF:-}" ]; then ref="--tome-ref $TOME_REF"; fi  # the reference's too
        run timeout 45 $PY benchmarks/profile_step.py --model deit-s --batch-size 32 --forwards 4 --rows 12 \
            --method $m --target 0.5 --device cuda --summary $ref
    done
fi
if want check; then
    step "CUDA == CPU checks"
    run $PY benchmarks/cuda_check.py
fi
if want speed; then
    step "speed.py on CUDA, fp32 (the CPU run's settings)"
    run $PY benchmarks/speed.py --device cuda --json "$OUT/speed-cuda.json" --out "$OUT/speed-cuda.md"
fi
if want vitb; then
    step "speed.py on CUDA, ViT-B shape, bf16 autocast, batch 256"
    run $PY benchmarks/speed.py --device cuda --amp --models vit-b --batch-size 256 --singles 4 --train-batch 64 \
        --json "$OUT/speed-cuda-vitb-bf16.json" --out "$OUT/speed-cuda-vitb-bf16.md"
fi
if want bf16; then
    step "speed.py on CUDA, DeiT-S, bf16 autocast, batch 256"
    run $PY benchmarks/speed.py --device cuda --amp --batch-size 256 --train-batch 64 --models deit-s \
        --json "$OUT/speed-cuda-bf16.json" --out "$OUT/speed-cuda-bf16.md"
fi
if want cli; then
    step "CLI on CUDA: ltmp bench (ToMe r=4, bundled images)"
    run $PY -m ltmp bench --model local-dir:src/ltmp/assets/vit-cifar10 --pretrained --method tome --r 4 \
        --batch-size 64 --data-dir src/ltmp/assets/cifar10-subset.tar.gz --val-split test --device cuda \
        --json "$OUT/bench-cuda.json"
    step "CLI on CUDA: torchrun, 1 process, 30 steps, bf16"
    run torchrun --nproc-per-node 1 -m ltmp train --model local-dir:src/ltmp/assets/vit-cifar10 --pretrained \
        --data-dir src/ltmp/assets/cifar10-subset.tar.gz --val-split test --output /tmp/ltmp-train --r-target 0.7 \
        --steps 30 --batch-size 64 --amp --device cuda --workers 4
    run cp /tmp/ltmp-train/eval.json "$OUT/train-eval.json"
fi
if want grouping; then
    step "grouping on CUDA (off by default there): group cost 1e6 and 1e8 MACs"
    for g in 1e6 1e8; do run $PY benchmarks/grouping.py --device cuda --group-macs $g --models deit-s; done
fi
if want compile; then
    step "speed.py on CUDA, every model under torch.compile, fp32 DeiT-S + CIFAR"
    run $PY benchmarks/speed.py --device cuda --compile --json "$OUT/speed-cuda-compile.json" \
        --out "$OUT/speed-cuda-compile.md"
    step "CLI on CUDA: ltmp bench --compile (calibrated LTMP, then ToMe r=4) and a compiled 30-step training run"
    M="--model local-dir:src/ltmp/assets/vit-cifar10 --pretrained"
    D="--data-dir src/ltmp/assets/cifar10-subset.tar.gz --val-split test"
    run $PY -m ltmp calibrate $M --data-dir src/ltmp/assets/cifar10-subset.tar.gz --r-target 0.7 --device cuda \
        --output "$OUT/calibrated.safetensors"
    run $PY -m ltmp bench $M --thresholds "$OUT/calibrated.safetensors" --batch-size 64 $D --device cuda --compile \
        --json "$OUT/bench-cuda-compile-ltmp.json"
    run $PY -m ltmp bench $M --method tome --r 4 --batch-size 64 $D --device cuda --compile \
        --json "$OUT/bench-cuda-compile-tome.json"
    run $PY -m ltmp train --model local-dir:src/ltmp/assets/vit-cifar10 --pretrained \
        --data-dir src/ltmp/assets/cifar10-subset.tar.gz --val-split test --output /tmp/ltmp-train-c --r-target 0.7 \
        --steps 30 --batch-size 64 --amp --device cuda --workers 4 --compile
    run cp /tmp/ltmp-train-c/eval.json "$OUT/train-compile-eval.json"
fi
if want compile-vitb; then
    step "speed.py on CUDA, torch.compile, ViT-B shape, bf16 autocast, batch 256"
    run $PY benchmarks/speed.py --device cuda --compile --amp --models vit-b --batch-size 256 --singles 4 \
        --train-batch 64 --json "$OUT/speed-cuda-vitb-bf16-compile.json" --out "$OUT/speed-cuda-vitb-bf16-compile.md"
fi
step done
if ((${#FAILED[@]})); then printf '!!! failed step: %s\n' "${FAILED[@]}"; exit 1; fi
