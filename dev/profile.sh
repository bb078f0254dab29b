#!/usr/bin/env bash
# Where the suite's time goes: runs the tests (arguments go to pytest, e.g. -m "not slow")
# with dev/profile_plugin.py, then prints time and XLA compilations by file and kind, and
# the slowest tests. The raw lines stay in $GRPO_JAX_PROFILE_OUT (default /tmp/grpo_jax_profile).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GRPO_JAX_PROFILE_OUT:-/tmp/grpo_jax_profile}
rm -f "$out".jsonl*
start=$(date +%s)
GRPO_JAX_PROFILE_OUT=$out.jsonl PYTHONPATH=dev:tests${PYTHONPATH:+:$PYTHONPATH} bash tests/run.sh -p profile_plugin "$@"
status=$?
echo "wall: $(($(date +%s) - start)) s, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python dev/profile_report.py "$out".jsonl*
exit $status
