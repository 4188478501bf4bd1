#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md (section 3), on a machine with one NVIDIA GPU:
#   bash benchmarks/gpu_figures.sh [inner-350m] [codecs] [inner-1b]     (no argument: all three, in that order)
#   bash benchmarks/gpu_figures.sh quality-small                        (docs/benchmarks.md section 7, issue 40)
# inner-*: ours (`join --no-swarm --stages 1`, its CUDA defaults: bf16 autocast + compile) in the delayed and
# streaming modes beside the plain loop's best variant (bf16 autocast + torch.compile of the whole model), one
# stage (a pipeline of several stages needs one GPU per stage), all in one process tree on one GPU.
# codecs: every compression strategy on a real 350m pseudo-gradient trained on the GPU in bf16, as member 0 of a
# group of 3 over its real transport, on this machine's CPU cores (where a peer's exchange thread runs them),
# beside a bf16 round of H=100 of the same preset.
# Each step is bounded in time (inner-350m 5 min, codecs 4, inner-1b 5.5: with a 15-minute lease, run them in
# separate calls while the machine is warm) and writes benchmarks/results/<name>.json with the GPU's name; a step
# that fails or runs out of time is reported and the next one runs. The whole-stage compilation takes about 40 s
# of each run of ours (its first round, not counted).
# quality-small: the quality lab (benchmarks/convergence.py) on the ~25M `small` preset, 4 peers' inner steps in bf16
# on the GPU and their codecs and outer steps on its CPU cores: sync fp32 beside int8 (4x) and top-k x3 (~114x) at the
# outer lr and momentum the CPU lab found best, the three at once (8 minutes); runs/quality/quality_small_cuda keeps
# every round as it goes, and the same command resumes it from its last checkpoint.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
failed=0
step() {
    local limit=$1; shift
    timeout "$limit" "$PY" "$@" || { echo "FAILED (exit $?): $*" >&2; failed=1; }
}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(inner-350m codecs inner-1b)
nvidia-smi -L
for part in "${parts[@]}"; do
    echo "=== $part ($(date -u +%H:%M:%S))"
    case $part in
    inner-350m)
        step 300 benchmarks/inner_reference.py --device cuda --preset 350m --steps 20 --rounds 3 \
            --batch-size 16 --microbatches 4 --variants bf16-compile --ours delayed streaming ;;
    inner-1b)
        step 330 benchmarks/inner_reference.py --device cuda --preset 1b --steps 10 --rounds 3 \
            --batch-size 16 --microbatches 4 --variants bf16-compile --ours delayed ;;
    codecs)
        step 240 benchmarks/compression.py --device cuda --preset 350m --stages 1 --inner-steps 10 \
            --batch-size 16 --microbatches 4 --repeats 2 --no-memory --name compression_cuda_350m ;;
    quality-small)
        step 480 benchmarks/convergence.py --device cuda --preset small --peers 4 --rounds 30 --inner-steps 20 \
            --jobs 3 --threads 4 --checkpoint-every 5 --name quality_small_cuda \
            --configs "sync fp32" "sync int8 at 1.0" "sync topk x3" \
            --best-from benchmarks/results/quality_tiny_300.json benchmarks/results/quality_mini_int8_100.json ;;
    *) echo "unknown part $part (inner-350m, codecs, inner-1b, quality-small)" >&2; exit 2 ;;
    esac
done
exit $failed
