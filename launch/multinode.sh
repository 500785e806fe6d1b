#!/usr/bin/env bash
# Several machines: run this once per node, with the same env on every node but NODE_RANK.
# torchrun makes the distributed environment; Lightning joins it (devices/num_nodes follow).
#
# Static rendezvous (fixed node ranks; node 0 hosts the store at MASTER_ADDR:MASTER_PORT):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/multinode.sh trainer=gpu   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/multinode.sh trainer=gpu   # on node 1
# c10d rendezvous (elastic: nodes may arrive in any order, NNODES may be MIN:MAX):
#   NNODES=2 RDZV_ENDPOINT=10.0.0.1:29400 RDZV_ID=job42 launch/multinode.sh trainer=gpu
# Started by torchrun itself (no second torchrun: the training runs directly):
#   torchrun --nnodes=2 --nproc-per-node=8 ... --no-python launch/multinode.sh trainer=gpu
#
# Env: NNODES (default 1), NPROC_PER_NODE (default: all GPUs, or 1), NODE_RANK (default 0),
# MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500), RDZV_ENDPOINT (host:port:
# selects c10d), RDZV_ID (default none; names the job), LOCAL_ADDR (this node's address as
# peers should reach it; needed for c10d when the hostname resolves to a loopback address),
# MAX_RESTARTS (default 0), plus PYTHON, TRAINER, DRY_RUN from launch/common.sh.
# Passed through untouched: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (the network interface
# to use, e.g. eth0 or ib0), NCCL_DEBUG=INFO (what NCCL chose), TORCH_DISTRIBUTED_DEBUG.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ -n "${TORCHELASTIC_RUN_ID:-}" ]]; then
  # Already a torchrun worker (torchrun --no-python launch/multinode.sh): just train.
  run "$PYTHON" -m "$MODULE" "$@"
fi

for var in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME NCCL_DEBUG TORCH_DISTRIBUTED_DEBUG; do
  [[ -n "${!var:-}" ]] && echo "# $var=${!var}"
done

args=(--nnodes="${NNODES:-1}" --nproc-per-node="${NPROC_PER_NODE:-$(gpu_count)}"
      --max-restarts="${MAX_RESTARTS:-0}")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  args+=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-none}")
else
  args+=(--node-rank="${NODE_RANK:-0}" --master-addr="${MASTER_ADDR:-127.0.0.1}"
         --master-port="${MASTER_PORT:-29500}")
fi
[[ -n "${LOCAL_ADDR:-}" ]] && args+=(--local-addr="$LOCAL_ADDR")

run "$PYTHON" -m torch.distributed.run "${args[@]}" -m "$MODULE" "$@"
