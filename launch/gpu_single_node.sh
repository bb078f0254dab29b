#!/usr/bin/env bash
# Train grpo_jax on one machine with one or more GPUs.
#
# One process drives every visible GPU: JAX lists them all in jax.devices(), the
# mesh (config keys mesh.data / mesh.fsdp / mesh.tensor) spans them, and no
# jax.distributed start-up is needed. For several machines use launch/slurm.sbatch.
#
#   launch/gpu_single_node.sh [options] [STEP...] [-- extra grpo_jax.main args]
#
# Steps: install (venv with requirements.txt + jax[cuda12]), train (the default).
#
# Example (4 GPUs, FSDP over all of them):
#   launch/gpu_single_node.sh --gpus 0,1,2,3 --config configs/gsm8k.py:model=qwen2.5-0.5b \
#     --workdir /data/runs/qwen_gsm8k -- --config.mesh.data=1 --config.mesh.fsdp=-1
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/gpu_single_node.sh [options] [install] [train] [-- extra grpo_jax.main args]

Options (each also settable by the environment variable in capitals):
  --config C        grpo_jax config file[:arg]          (CONFIG, default configs/default.py)
  --workdir W       run directory                       (WORKDIR, default runs/grpo_jax)
  --gpus LIST       GPUs to use, e.g. 0,1,2,3           (GPUS, default: all)
  --python PY       Python >= 3.11 for the venv         (PYTHON, default python3)
  --jax-extra E     pip extra of jax: cuda12 or cuda13  (JAX_EXTRA, default cuda12)
  --mem-fraction F  share of GPU memory JAX may take    (MEM_FRACTION, default 0.9)
  --dry-run         print every command, run nothing   (DRY_RUN=1)
  -h, --help        this help
EOF
}

CONFIG="${CONFIG:-configs/default.py}"
WORKDIR="${WORKDIR:-runs/grpo_jax}"
GPUS="${GPUS:-}"
PYTHON="${PYTHON:-python3}"
JAX_EXTRA="${JAX_EXTRA:-cuda12}"
MEM_FRACTION="${MEM_FRACTION:-0.9}"
DRY_RUN="${DRY_RUN:-0}"

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STEPS=()
EXTRA_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --jax-extra) JAX_EXTRA="$2"; shift 2 ;;
    --mem-fraction) MEM_FRACTION="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA_ARGS=("$@"); break ;;
    install | train) STEPS+=("$1"); shift ;;
    *) echo "gpu_single_node.sh: unknown step or option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ ${#STEPS[@]} -eq 0 ]]; then
  STEPS=(train)
fi
if [[ -n "$GPUS" && ! "$GPUS" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "gpu_single_node.sh: --gpus '$GPUS' must be a comma-separated list of GPU indices" >&2
  exit 2
fi

# The arguments as one line of shell words, quoted only where needed (paste-able).
quote() {
  local arg words=()
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      words+=("$arg")
    else
      words+=("'${arg//\'/\'\\\'\'}'")
    fi
  done
  echo "${words[*]}"
}

# Prints the command; runs it unless this is a dry run.
run() {
  echo "+ $(quote "$@")"
  if [[ "$DRY_RUN" != 1 ]]; then
    "$@"
  fi
}

step_install() {
  run "$PYTHON" -m venv "$ROOT/.venv"
  run "$ROOT/.venv/bin/pip" install -q -U pip
  run "$ROOT/.venv/bin/pip" install -q -r "$ROOT/requirements.txt" -e "$ROOT" "jax[$JAX_EXTRA]"
}

step_train() {
  local env_vars=("XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION")
  if [[ -n "$GPUS" ]]; then
    env_vars+=("CUDA_VISIBLE_DEVICES=$GPUS")
  fi
  run env "${env_vars[@]}" "$ROOT/.venv/bin/python" -m grpo_jax.main \
    "--config=$CONFIG" "--workdir=$WORKDIR" "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"
}

cd "$ROOT"
for step in "${STEPS[@]}"; do
  "step_$step"
done
