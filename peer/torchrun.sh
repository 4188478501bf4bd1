#!/usr/bin/env bash
# One node of a peer that spans a multi-node cluster: run this on every node, at about the same
# time. torchrun starts NPROC_PER_NODE processes here, one pipeline stage each: stage = global
# RANK = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK, on GPU cuda:LOCAL_RANK (launch.py,
# resolve_device in worker.py). Stage 0, and with it the control plane and metrics, runs on
# NODE_RANK 0. Static rendezvous (--node-rank + --master-addr), so ranks map to nodes fixedly.
#
#   NNODES=2 NPROC_PER_NODE=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 \
#   DILOCOX_CONFIG=peer/cluster-torchrun.toml DILOCOX_RUN_DIR=/shared/dilocox/open-1b \
#   DILOCOX_IDENTITY=/shared/dilocox/peer.pem \
#   DILOCOX_ANNOUNCE_MADDRS=/ip4/THIS_NODE_PUBLIC_IP/tcp/31400 peer/torchrun.sh
#
# Variables: NNODES, NODE_RANK, MASTER_ADDR (node 0's address on the cluster network) are required;
# NPROC_PER_NODE (default 1), MASTER_PORT (default 29500), and every DILOCOX_* variable of
# peer/launch.sh, which this script runs (doctor, join --resume auto, exec). NNODES x NPROC_PER_NODE
# must equal model.stages, and DILOCOX_RUN_DIR must be one shared directory (same path on every
# node): every process decides `--resume auto` from it, and must find every stage's checkpoint.
#
# Stopping: SIGTERM to torchrun reaches every stage of this node; torchrun sends SIGKILL after
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (set to 240 here; torchrun versions that do not read it
# wait 30 s). A node that stops or fails stops the pipeline: restart all nodes together.
set -euo pipefail

: "${NNODES:?set NNODES (nodes of this peer)}"
: "${NODE_RANK:?set NODE_RANK (0 on the node at MASTER_ADDR, then 1, 2, ...)}"
: "${MASTER_ADDR:?set MASTER_ADDR (node 0 address on the cluster network)}"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}
export DILOCOX_TORCHRUN="--nnodes $NNODES --nproc-per-node ${NPROC_PER_NODE:-1} --node-rank $NODE_RANK \
--master-addr $MASTER_ADDR --master-port ${MASTER_PORT:-29500} --max-restarts 0"
exec "$here/launch.sh"
