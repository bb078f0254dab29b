#!/usr/bin/env bash
# The test command: makes .venv with the runtime and test requirements when it is missing,
# lints, then runs the suite. Usage: bash tests/run.sh [pytest args...]
# The fast tier (tests not marked slow): bash tests/run.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
  # torch first and pinned: the CPU build, never a CUDA one (test-only dependency).
  .venv/bin/pip install -q -r requirements-test.txt
  # The tpu extra: libtpu, for the slow tier's compiles for a TPU topology
  # (tests/aot/test_aot_tpu.py); the tests stay on the CPU (JAX_PLATFORMS=cpu, conftest.py).
  .venv/bin/pip install -q -r requirements.txt -e '.[tpu]'
  # verl for tests/objective/test_peer_verl.py, without its declared dependencies (requirements-test.txt).
  .venv/bin/pip install -q --no-deps verl==0.9.1
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The layer contract of pyproject.toml ([tool.importlinter]): an upward import fails here,
# one inside a function or under TYPE_CHECKING included.
.venv/bin/lint-imports --no-logo --no-cache
# Test files in parallel, one worker per core (GRPO_JAX_TEST_WORKERS, default 2; 0 runs
# them in this process). A file's tests stay on one worker (--dist loadfile), so its
# module fixtures and compiled programs are shared as before.
# The log ends with the 25 slowest tests, then one line per failed test and why (-ra, in
# pyproject.toml), then the totals.
workers=${GRPO_JAX_TEST_WORKERS:-2}
if [[ $workers == 0 ]]; then
  exec .venv/bin/python -m pytest -q --durations=25 "$@"
fi
# The tests that load libtpu into their own process (compiles for a TPU topology) run after
# the others, in a process of their own: libtpu carries its own XLA, and the workers beside
# it crashed in XLA:CPU's native code (a segfault compiling, an abort reading the compilation
# cache). Only when no test file is named: a named file runs where it is named.
tpu_tests=tests/aot/test_aot_tpu.py
named=0
for arg in "$@"; do
  [[ $arg != -* && -e ${arg%%::*} ]] && named=1
done
if [[ $named == 1 ]]; then
  exec .venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadfile "$@"
fi
status=0
.venv/bin/python -m pytest -q --durations=25 -n "$workers" --dist loadfile \
  --ignore="$tpu_tests" "$@" || status=$?
rc=0
.venv/bin/python -m pytest -q "$@" "$tpu_tests" || rc=$?
# 5: none of them selected (the fast tier's -m "not slow": they are all slow).
if [[ $rc != 0 && $rc != 5 ]]; then status=$rc; fi
exit "$status"
