# shellcheck shell=bash
# Shared by the launch scripts (sourced, not run): which Python, which trainer, how to run.
#   PYTHON   interpreter (default: the repo's .venv if present, else python3)
#   TRAINER  lightning (default) | raw: the plain PyTorch DDP trainer
#   DRY_RUN  1: print the command and exit without running it

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

case "${TRAINER:-lightning}" in
  lightning) MODULE=project.train ;;
  raw) MODULE=project.raw_train ;;
  *) echo "error: TRAINER=${TRAINER} is not one of: lightning, raw" >&2; exit 2 ;;
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

# Print the exact command (copy-pastable), then run it. SIGTERM/SIGINT, and SIGUSR1 (SLURM's
# early warning), are passed on to torchrun as SIGTERM: it stops the workers, which agree on a
# step, save checkpoints/last.ckpt and exit. This script then exits 143 ("stopped by a
# signal, checkpoint saved: run the same command, same RUN_ID, to resume"), whatever exit
# code torchrun itself reports for being signalled.
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
  STOPPED=""
  trap 'STOPPED=1; kill -TERM "$child" 2>/dev/null' TERM INT USR1
  code=0
  while true; do
    wait "$child" && code=0 || code=$?
    kill -0 "$child" 2>/dev/null || break  # a trapped signal interrupts wait: wait again
  done
  [[ -n "$STOPPED" ]] && exit 143
  exit "$code"
}
