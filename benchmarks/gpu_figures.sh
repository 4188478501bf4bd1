#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md (section 3), on a machine with one NVIDIA GPU:
#   bash benchmarks/gpu_figures.sh
# Inner-training throughput of `350m` and `1b` on the GPU (one stage: a pipeline of several
# stages needs one GPU per stage), and the codecs on a real `350m` pseudo-gradient trained
# on the GPU (the codecs run on the CPU, where the averager process runs them). Each step is
# bounded in time (about 9 minutes in all) and writes benchmarks/results/<name>.json with the
# GPU's name; a step that fails or runs out of time is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
failed=0
step() {
    local limit=$1; shift
    timeout "$limit" "$PY" "$@" || { echo "FAILED (exit $?): $*" >&2; failed=1; }
}
nvidia-smi -L
# ours (join --no-swarm, its CUDA defaults: bf16 + compile) beside the plain loop's variants, same process tree
step 240 benchmarks/inner_reference.py --device cuda --preset 350m --steps 20 --batch-size 16 --microbatches 4
step 300 benchmarks/inner_reference.py --device cuda --preset 1b --steps 10 --batch-size 16 --microbatches 4 \
    --variants bf16 bf16-compile
step 300 benchmarks/compression.py --device cuda --preset 350m --stages 1 \
    --inner-steps 5 --batch-size 16 --microbatches 4 --repeats 2 --name compression_cuda_350m
exit $failed
