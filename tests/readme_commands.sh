#!/usr/bin/env bash
# The README's commands that need no checkpoint and no network, run in a virtualenv made from
# requirements.txt alone (no test extras), as a new user's machine has it. CI runs this.
# Usage: bash tests/readme_commands.sh   (RUNTIME_VENV=<dir> picks the venv; default .venv-runtime)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${RUNTIME_VENV:-.venv-runtime}
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -r requirements.txt -e .
fi
py=$venv/bin/python
if "$py" -c "import pytest" 2>/dev/null; then
  echo "readme_commands: $venv has the test extras; it must hold requirements.txt alone" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GRPO_JAX_RUNLOCAL_DIR=$work/assets
run() {
  echo "+ $*"
  "$@" >"$work/log" 2>&1 || { tail -40 "$work/log"; echo "readme_commands: failed: $*" >&2; exit 1; }
  tail -3 "$work/log"
}
# The main job: the first command of the README.
run "$py" -m grpo_jax.main --config=configs/default.py --workdir="$work/default"
# The GSM8K recipe end to end on CPU ("In a few commands", step 2), every model family.
for model in qwen2.5-0.5b qwen3-0.6b llama3.2-1b gemma3-1b; do
  run "$py" -m grpo_jax.main --config="configs/gsm8k.py:model=$model,runlocal" \
    --workdir="$work/gsm8k_$model"
done
echo "readme_commands: all passed"
