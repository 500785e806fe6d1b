#!/usr/bin/env bash
# One machine, N processes, through torchrun --standalone (private rendezvous, free port).
# Lightning joins the environment torchrun makes: devices/num_nodes follow it.
#
#   launch/single_node.sh [hydra overrides...]
#   NPROC_PER_NODE=2 launch/single_node.sh trainer.accelerator=cpu trainer.max_epochs=3
#   TRAINER=raw launch/single_node.sh          # the same through the raw PyTorch DDP trainer
#
# Env: NPROC_PER_NODE (default: all GPUs, 1 without GPUs), MAX_RESTARTS (default 0: a failed
# worker ends the job; N: torchrun restarts the worker group up to N times), plus PYTHON,
# TRAINER, DRY_RUN from launch/common.sh.
set -euo pipefail
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

nproc="${NPROC_PER_NODE:-$(gpu_count)}"
check_count NPROC_PER_NODE "$nproc"
[[ "${MAX_RESTARTS:-0}" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=$MAX_RESTARTS must be a whole number"

run "${TORCHRUN[@]}" --standalone \
  --nproc-per-node="$nproc" \
  --max-restarts="${MAX_RESTARTS:-0}" \
  -m "$MODULE" "$@"
