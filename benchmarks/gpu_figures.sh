#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md (section 3), on a machine with one NVIDIA GPU:
#   bash benchmarks/gpu_figures.sh
# Inner-training throughput of `350m` and `1b` on the GPU (one stage: a pipeline of several
# stages needs one GPU per stage), and the codecs on a real `350m` pseudo-gradient trained
# on the GPU (the codecs run on the CPU, where the averager process runs them). Each step is
# bounded in time (about 11 minutes in all) and writes benchmarks/results/<name>.json with the
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
# checkpoints off: a 1b checkpoint is 16 GB, and writing it each round ran past the step's time
step 150 benchmarks/inner_throughput.py --device cuda --preset 350m --stages 1 --set run.checkpoint_every=100 \
    --rounds 3 --inner-steps 10 --batch-size 16 --microbatches 4 --name inner_throughput_cuda_350m
step 220 benchmarks/inner_throughput.py --device cuda --preset 1b --stages 1 --set run.checkpoint_every=100 \
    --rounds 3 --inner-steps 2 --batch-size 16 --microbatches 4 --name inner_throughput_cuda_1b
step 300 benchmarks/compression.py --device cuda --preset 350m --stages 1 \
    --inner-steps 5 --batch-size 16 --microbatches 4 --repeats 2 --name compression_cuda_350m
exit $failed
