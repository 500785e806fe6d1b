#!/usr/bin/env bash
# Several machines: run this once per node, with the same env on every node but NODE_RANK.
# torchrun makes the distributed environment; Lightning joins it (devices/num_nodes follow).
#
# Static rendezvous (fixed node ranks; node 0 hosts the store at MASTER_ADDR:MASTER_PORT):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 launch/multinode.sh trainer=gpu   # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 launch/multinode.sh trainer=gpu   # on node 1
# c10d rendezvous (elastic: nodes may arrive in any order, NNODES may be MIN:MAX):
#   NNODES=2 RDZV_ENDPOINT=10.0.0.1:29400 RDZV_ID=job42 launch/multinode.sh trainer=gpu
# Started by torchrun itself (no second torchrun: the training runs directly), with or without
# --no-python (without it torchrun runs this file with Python, and the last line hands it to
# bash: both forms do the same):
#   torchrun --nnodes=2 --nproc-per-node=8 ... launch/multinode.sh trainer=gpu
#
# Env: NNODES (default 1), NPROC_PER_NODE (default: all GPUs, or 1), NODE_RANK (default 0),
# MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default: derived from RUN_ID or the SLURM job
# id, so two jobs on one node differ; else 29500), RDZV_ENDPOINT (host:port: selects c10d),
# RDZV_ID (default none; names the job), LOCAL_ADDR (this node's address as peers should
# reach it; needed for c10d when the hostname resolves to a loopback address), RDZV_TIMEOUT
# (default 300: seconds to wait for every node before failing with a diagnosis),
# MAX_RESTARTS (default 0), plus PYTHON, TRAINER, DRY_RUN from launch/common.sh.
# Elastic membership (NNODES=MIN:MAX with c10d; docs/elastic.md): RDZV_LAST_CALL (default
# 3; torch's 30: seconds a rendezvous waits for more nodes once MIN are there),
# RDZV_KEEP_ALIVE (default 1; torch's 5: seconds between a node's heartbeats; a node silent
# for RDZV_KEEP_ALIVE_ATTEMPTS of them, default 3, is dead and dropped), MONITOR_INTERVAL
# (default 0.1, torchrun's: seconds between the agent's looks at its workers and at
# waiting nodes). With the defaults survivors train again within seconds of a node's death
# (python -m project.bench.recovery measures it).
# Passed through untouched: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (the network interface
# to use, e.g. eth0 or ib0), NCCL_DEBUG=INFO (what NCCL chose), TORCH_DISTRIBUTED_DEBUG.
''':'
# Bash reads the line above as the no-op `:`, Python as the start of a string that ends at
# the `exit` line at the bottom: Python then runs only the lines below that.
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

# Check the input before torchrun starts: a wrong value otherwise shows as a long silent wait.
nnodes="${NNODES:-1}" node_rank="${NODE_RANK:-0}" nproc="${NPROC_PER_NODE:-$(gpu_count)}"
[[ "$nnodes" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES=$nnodes must be N or MIN:MAX (whole numbers >= 1)"
check_count NPROC_PER_NODE "$nproc"
[[ "${MAX_RESTARTS:-0}" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=$MAX_RESTARTS must be a whole number"
rdzv_timeout="${RDZV_TIMEOUT:-300}" last_call="${RDZV_LAST_CALL:-3}"
keep_alive="${RDZV_KEEP_ALIVE:-1}" attempts="${RDZV_KEEP_ALIVE_ATTEMPTS:-3}"
monitor="${MONITOR_INTERVAL:-0.1}"
check_count RDZV_TIMEOUT "$rdzv_timeout"
check_count RDZV_LAST_CALL "$last_call"
check_count RDZV_KEEP_ALIVE "$keep_alive"
check_count RDZV_KEEP_ALIVE_ATTEMPTS "$attempts"
[[ "$monitor" =~ ^[0-9]*\.?[0-9]+$ && ! "$monitor" =~ ^[0.]+$ ]] \
  || die "MONITOR_INTERVAL=$monitor must be a number of seconds > 0"

# The rendezvous settings torch's c10d handler reads (torch/distributed/elastic/rendezvous/
# dynamic_rendezvous.py): after a node dies the survivors wait for its heartbeats to expire
# (keep-alive x attempts), then for last call; torch's defaults made that ~45 s.
rdzv_conf="join_timeout=$rdzv_timeout,timeout=$rdzv_timeout,last_call_timeout=$last_call"
rdzv_conf+=",keep_alive_interval=$keep_alive,keep_alive_max_attempt=$attempts"
args=(--nnodes="$nnodes" --nproc-per-node="$nproc" --max-restarts="${MAX_RESTARTS:-0}"
      --monitor-interval="$monitor" --rdzv-conf="$rdzv_conf")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  [[ "$RDZV_ENDPOINT" == *:* ]] || die "RDZV_ENDPOINT=$RDZV_ENDPOINT must be host:port"
  check_host RDZV_ENDPOINT "${RDZV_ENDPOINT%:*}"
  check_port "RDZV_ENDPOINT port" "${RDZV_ENDPOINT##*:}"
  args+=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-none}")
else
  [[ "$nnodes" =~ ^[0-9]+$ ]] || die "NNODES=$nnodes: a range needs c10d rendezvous (set RDZV_ENDPOINT)"
  if ! [[ "$node_rank" =~ ^[0-9]+$ ]] || (( node_rank >= nnodes )); then
    die "NODE_RANK=$node_rank must be one of 0..$((nnodes - 1)) (NNODES=$nnodes)"
  fi
  master_addr="${MASTER_ADDR:-127.0.0.1}"
  # The port: given, else derived from the job's name (RUN_ID / SLURM job), else 29500.
  job="${RUN_ID:-${SLURM_JOB_ID:-}}"
  master_port="${MASTER_PORT:-$([[ -n "$job" ]] && port_for "$job" || echo 29500)}"
  check_host MASTER_ADDR "$master_addr"
  check_port MASTER_PORT "$master_port"
  args+=(--node-rank="$node_rank" --master-addr="$master_addr" --master-port="$master_port")
fi
[[ -n "${LOCAL_ADDR:-}" ]] && args+=(--local-addr="$LOCAL_ADDR")

run "${TORCHRUN[@]}" "${args[@]}" -m "$MODULE" "$@"
# shellcheck disable=SC2317  # the Python part: bash never gets past `exit`
exit <<'# end of the Python part' # '''
# Python: run this file with bash, as `torchrun --no-python` does. Bash reads these lines
# only as the here-document of `exit` above, so it neither runs nor parses them.
from project.engine.launch.bash_script import exec_bash

exec_bash()
# end of the Python part
