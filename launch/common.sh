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

# Processes per node when NPROC_PER_NODE is not given: every GPU, or 1 without GPUs.
gpu_count() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  echo "${n:-0}" | awk '{print ($1 > 0 ? $1 : 1)}'
}

# Print the exact command (copy-pastable), then replace this shell with it so that signals
# from a scheduler reach torchrun directly.
run() {
  local shown
  shown=$(printf '%q ' "$@")
  echo "+ ${shown% }"
  [[ "${DRY_RUN:-0}" == 1 ]] && exit 0
  if [[ "${TRAINER:-lightning}" == raw ]] && ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$MODULE') is None)"; then
    echo "error: TRAINER=raw needs the module $MODULE, which this checkout does not have" >&2
    exit 2
  fi
  exec "$@"
}
