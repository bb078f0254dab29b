#!/usr/bin/env bash
# Train grpo_jax on a Cloud TPU VM (a single host or a multi-host pod slice).
#
# Every worker (host) of the slice runs the same command; grpo_jax.main calls
# jax.distributed.initialize(), which finds the other workers from the TPU VM's
# metadata, and one global mesh spans every chip of the slice.
#
#   launch/tpu_pod.sh [options] STEP... [-- extra grpo_jax.main args]
#
# Steps (run in the order given):
#   create   create the TPU VM, or reuse it when one of that name exists
#   copy     copy this checkout (git archive of HEAD) to every worker
#   install  make a venv (uv, Python >= 3.11) on every worker with requirements.txt + jax[tpu]
#   train    run "python -m grpo_jax.main --config=... --workdir=..." on every worker
#   status   show the TPU VM
#   stop     stop training on every worker (SIGTERM: it checkpoints, then exits)
#   delete   delete the TPU VM
#   all      create copy install train
#
# Example (a v5e pod slice of 4 hosts x 4 chips):
#   PROJECT=my-proj ZONE=us-west4-a ACCELERATOR_TYPE=v5litepod-16 \
#   RUNTIME_VERSION=v2-alpha-tpuv5-lite TPU_NAME=grpo-v5e-16 \
#   CONFIG=configs/gsm8k.py:model=qwen2.5-0.5b WORKDIR=gs://my-bucket/grpo/run1 \
#   launch/tpu_pod.sh all -- --config.train.steps=500
#
# WORKDIR must be reachable from every worker with the same path (a gs:// bucket
# or a shared filesystem): every worker takes part in Orbax's multi-host
# checkpoint writes, and only worker 0 writes metrics and TensorBoard files.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh [options] STEP... [-- extra grpo_jax.main args]

Steps: create copy install train status stop delete all (= create copy install train)

Options (each also settable by the environment variable in capitals):
  --project P            Google Cloud project            (PROJECT, default: gcloud's)
  --zone Z               zone of the TPU                  (ZONE, default us-central2-b)
  --accelerator-type T   e.g. v4-32, v5litepod-16         (ACCELERATOR_TYPE, default v4-8)
  --runtime-version R    TPU VM software version          (RUNTIME_VERSION, default tpu-ubuntu2204-base)
  --tpu-name N           name of the TPU VM               (TPU_NAME, default grpo-jax)
  --config C             grpo_jax config file[:arg]       (CONFIG, default configs/default.py)
  --workdir W            run directory, e.g. gs://b/run   (WORKDIR, default gs://CHANGE-ME/grpo_jax/run)
  --remote-dir D         checkout path on the workers     (REMOTE_DIR, default grpo_jax)
  --python-version V     Python of the workers' venv      (PYTHON_VERSION, default 3.11)
  --spot                 create a Spot TPU                (SPOT=1)
  --dry-run              print every command, run nothing (DRY_RUN=1)
  -h, --help             this help
EOF
}

PROJECT="${PROJECT:-}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-8}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
TPU_NAME="${TPU_NAME:-grpo-jax}"
CONFIG="${CONFIG:-configs/default.py}"
WORKDIR="${WORKDIR:-gs://CHANGE-ME/grpo_jax/run}"
REMOTE_DIR="${REMOTE_DIR:-grpo_jax}"
PYTHON_VERSION="${PYTHON_VERSION:-3.11}"
SPOT="${SPOT:-0}"
DRY_RUN="${DRY_RUN:-0}"

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STEPS=()
EXTRA_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --project) PROJECT="$2"; shift 2 ;;
    --zone) ZONE="$2"; shift 2 ;;
    --accelerator-type) ACCELERATOR_TYPE="$2"; shift 2 ;;
    --runtime-version) RUNTIME_VERSION="$2"; shift 2 ;;
    --tpu-name) TPU_NAME="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --remote-dir) REMOTE_DIR="$2"; shift 2 ;;
    --python-version) PYTHON_VERSION="$2"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; EXTRA_ARGS=("$@"); break ;;
    create | copy | install | train | status | stop | delete) STEPS+=("$1"); shift ;;
    all) STEPS+=(create copy install train); shift ;;
    *) echo "tpu_pod.sh: unknown step or option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ ${#STEPS[@]} -eq 0 ]]; then
  echo "tpu_pod.sh: no step given (create, copy, install, train, ...; see --help)" >&2
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

GCLOUD_TPU=(gcloud compute tpus tpu-vm)
LOCATION=(--zone="$ZONE")
if [[ -n "$PROJECT" ]]; then
  LOCATION+=(--project="$PROJECT")
fi

# Runs a shell command on every worker of the slice at once.
on_all_workers() {
  run "${GCLOUD_TPU[@]}" ssh "$TPU_NAME" "${LOCATION[@]}" --worker=all --command="$1"
}

step_create() {
  # A dry run cannot know whether the TPU exists, so it shows both commands.
  if [[ "$DRY_RUN" != 1 ]] && "${GCLOUD_TPU[@]}" describe "$TPU_NAME" "${LOCATION[@]}" \
    --format='value(state)' >/dev/null 2>&1; then
    echo "TPU VM $TPU_NAME exists in $ZONE: reusing it"
    return
  fi
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "# if 'gcloud compute tpus tpu-vm describe $TPU_NAME' fails (no such TPU VM):"
  fi
  local create=("${GCLOUD_TPU[@]}" create "$TPU_NAME" "${LOCATION[@]}"
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION")
  if [[ "$SPOT" == 1 ]]; then
    create+=(--spot)
  fi
  run "${create[@]}"
}

step_copy() {
  local archive
  archive="${TMPDIR:-/tmp}/grpo_jax_$$.tar.gz"
  run git -C "$ROOT" archive --format=tar.gz -o "$archive" HEAD
  run "${GCLOUD_TPU[@]}" scp "$archive" "$TPU_NAME:grpo_jax.tar.gz" "${LOCATION[@]}" --worker=all
  on_all_workers "rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR && tar xzf grpo_jax.tar.gz -C $REMOTE_DIR"
  run rm -f "$archive"
}

step_install() {
  # TPU VM images ship Python 3.10 and JAX needs >= 3.11: uv provides the interpreter.
  on_all_workers "cd $REMOTE_DIR && python3 -m pip install -q --user uv \
&& ~/.local/bin/uv venv -q --python $PYTHON_VERSION .venv \
&& ~/.local/bin/uv pip install -q --python .venv/bin/python -r requirements.txt -e . 'jax[tpu]'"
}

step_train() {
  local cmd=(.venv/bin/python -m grpo_jax.main "--config=$CONFIG" "--workdir=$WORKDIR"
    "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}")
  on_all_workers "cd $REMOTE_DIR && $(quote "${cmd[@]}")"
}

step_status() {
  run "${GCLOUD_TPU[@]}" describe "$TPU_NAME" "${LOCATION[@]}"
}

step_stop() {
  # SIGTERM: grpo_jax.main saves a checkpoint and exits; "train" resumes from it.
  on_all_workers "pkill -TERM -f 'python -m grpo_jax.main' || true"
}

step_delete() {
  run "${GCLOUD_TPU[@]}" delete "$TPU_NAME" "${LOCATION[@]}" --quiet
}

for step in "${STEPS[@]}"; do
  "step_$step"
done
