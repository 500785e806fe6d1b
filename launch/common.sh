# shellcheck shell=bash
# Shared by the launch scripts (sourced, not run): which Python, which trainer, how to run.
#   PYTHON   interpreter (default: the repo's .venv if present, else python3)
#   TRAINER  lightning (default), or one of the others below (raw: the plain PyTorch DDP
#            trainer; doctor: project.doctor, which checks the set-up instead of training)
#   DRY_RUN  1: print the command and exit without running it

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

case "${TRAINER:-lightning}" in
  lightning) MODULE=project.train ;;
  raw) MODULE=project.raw_train ;;  # feature:raw
  doctor) MODULE=project.doctor ;;  # feature:doctor
  *) echo "error: TRAINER=${TRAINER} is not one of the trainers listed in launch/common.sh" >&2; exit 2 ;;
esac

# torchrun shares its rendezvous store with the workers' process group by default; after a
# worker-group restart (MAX_RESTARTS) the new workers then read the dead group's addresses
# and fail to connect (pytorch/pytorch#135712). A store per attempt avoids that.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# Processes per node when NPROC_PER_NODE is not given: every GPU, or 1 without GPUs.
gpu_count() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  echo "${n:-0}" | awk '{print ($1 > 0 ? $1 : 1)}'
}

# The torchrun the scripts run: torch's own (same arguments), with the job-level failure
# handling of src/project/launcher.py (exit codes, no restarts of bad input, SIGUSR1/2).
# shellcheck disable=SC2034  # used by the scripts that source this file
TORCHRUN=("$PYTHON" -m project.launcher)

# The command as typed, with the launch knobs set in the environment: `RUN_ID=<id>` before
# it resumes this run (a stop, the launcher and the hang report print that line). Not when
# torchrun started this script: the workers then name torchrun's own command.
if [[ -z "${TORCHELASTIC_RUN_ID:-}" ]]; then
  typed=""
  for var in NNODES NODE_RANK NPROC_PER_NODE MASTER_ADDR MASTER_PORT RDZV_ENDPOINT RDZV_ID \
             LOCAL_ADDR MAX_RESTARTS TRAINER PYTHON; do
    [[ -n "${!var:-}" ]] && typed+="$var=$(printf '%q' "${!var}") "
  done
  PROJECT_COMMAND="$typed$(printf '%q ' "$0" "$@")"
  export PROJECT_COMMAND="${PROJECT_COMMAND% }"
fi

# One-line input checks before anything starts (exit 2).
die() { echo "error: $*" >&2; exit 2; }
check_count() {  # name value: a whole number >= 1
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1=$2 must be a whole number >= 1"
}
check_port() {  # name value
  if ! [[ "$2" =~ ^[0-9]+$ ]] || (( $2 < 1 || $2 > 65535 )); then
    die "$1=$2 is not a TCP port (1-65535)"
  fi
}
check_host() {  # name value: resolvable here
  [[ -n "$2" ]] || die "$1 is empty: give the address of node 0"
  getent hosts "$2" >/dev/null 2>&1 || [[ "$2" =~ ^[0-9.:]+$ ]] \
    || die "$1=$2 does not resolve on $(hostname): check the name (or give an IP address)"
}
# A port derived from a job name (the same on every node, different for another job), in
# 20000-59999: two jobs on one node then do not share a rendezvous store.
port_for() { echo $(( 20000 + $(printf '%s' "$1" | cksum | cut -d' ' -f1) % 40000 )); }

# Print the exact command (copy-pastable), then run it. SIGTERM, SIGINT, SIGUSR1 and SIGUSR2
# (SLURM's early warning: launch/slurm.sbatch's and submitit's) are passed on to the launcher:
# it stops the workers, which agree on a step, save checkpoints/last.ckpt and exit. The script
# exits with the launcher's code: 143 when the workers stopped on the signal ("run the same
# command, same RUN_ID, to resume"; SLURM requeues on it), 0 when training had already
# finished, 2 for bad input, 1 for a failure.
run() {
  local shown child code
  shown=$(printf '%q ' "$@")
  echo "+ ${shown% }"
  [[ "${DRY_RUN:-0}" == 1 ]] && exit 0
  if [[ "${TRAINER:-lightning}" == raw ]] && ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$MODULE') is None)"; then
    echo "error: TRAINER=raw needs the module $MODULE, which this checkout does not have" >&2
    exit 2
  fi
  "$@" &
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null' TERM
  trap 'kill -INT "$child" 2>/dev/null' INT
  trap 'kill -USR1 "$child" 2>/dev/null' USR1
  trap 'kill -USR2 "$child" 2>/dev/null' USR2
  code=0
  while true; do
    wait "$child" && code=0 || code=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal interrupts wait: wait again
  done
  exit "$code"
}
