#!/usr/bin/env bash
# Start N grpo_jax processes on this machine that form one multi-process JAX run over
# loopback: each process gets K fake CPU devices, process 0 hosts the jax.distributed
# coordinator on 127.0.0.1:<free port>, and the global mesh spans all N*K devices.
# This is how multi-host code paths (host-sharded data, cross-process collectives,
# Orbax's multi-host checkpoints, primary-only logging) are tested without a pod.
#
#   launch/local_multiprocess.sh [options] N [grpo_jax.main args...]
#   launch/local_multiprocess.sh [options] N -- COMMAND [args...]
#
# Examples:
#   launch/local_multiprocess.sh 2 --config=configs/default.py:smoke --config.mesh.num_devices=0 \
#     --workdir=/tmp/grpo_2proc
#   launch/local_multiprocess.sh --devices-per-process 4 2 -- python my_script.py
#   launch/local_multiprocess.sh --dry-run 2 --config=configs/default.py --workdir=/tmp/w
#
# Every process sees GRPO_JAX_COORDINATOR, GRPO_JAX_NUM_PROCESSES and GRPO_JAX_PROCESS_ID,
# which grpo_jax.core.distributed.maybe_initialize() reads. The script waits for all
# processes and exits with the first failure's status, stopping the others.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/local_multiprocess.sh [options] N [grpo_jax.main args... | -- COMMAND...]

Starts N processes on this machine joined by jax.distributed over 127.0.0.1.

Options:
  --devices-per-process K  fake CPU devices per process (default: $DEVICES_PER_PROCESS or 2)
  --port P                 coordinator port (default: $PORT or a free port)
  --python PY              Python interpreter (default: $PYTHON or python3)
  --log-dir DIR            write process i's output to DIR/process_i.log
                           (default: all processes print to this terminal)
  --timeout S              stop every process after S seconds (default: none)
  --dry-run                print the commands, run nothing
  -h, --help               this help

Without "--", the arguments after N go to "PY -m grpo_jax.main"; after "--", the
command is run as given.
EOF
}

DEVICES_PER_PROCESS="${DEVICES_PER_PROCESS:-2}"
PORT="${PORT:-}"
PYTHON="${PYTHON:-python3}"
LOG_DIR=""
TIMEOUT=""
DRY_RUN=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices-per-process) DEVICES_PER_PROCESS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "local_multiprocess.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done

if [[ $# -lt 1 ]]; then
  echo "local_multiprocess.sh: missing N, the number of processes (see --help)" >&2
  exit 2
fi
NUM_PROCESSES="$1"
shift
for value in "$NUM_PROCESSES" "$DEVICES_PER_PROCESS"; do
  if ! [[ "$value" =~ ^[1-9][0-9]*$ ]]; then
    echo "local_multiprocess.sh: '$value' is not a positive integer (N and --devices-per-process)" >&2
    exit 2
  fi
done
if [[ -n "$TIMEOUT" && ! "$TIMEOUT" =~ ^[1-9][0-9]*$ ]]; then
  echo "local_multiprocess.sh: --timeout '$TIMEOUT' is not a positive number of seconds" >&2
  exit 2
fi

if [[ $# -gt 0 && "$1" == "--" ]]; then
  shift
  if [[ $# -eq 0 ]]; then
    echo "local_multiprocess.sh: nothing after '--' (give the command to run)" >&2
    exit 2
  fi
  COMMAND=("$@")
else
  COMMAND=("$PYTHON" -m grpo_jax.main "$@")
fi

port_in_use() {
  # A connection succeeds only when something already listens there.
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

if [[ -z "$PORT" ]]; then
  for _ in $(seq 100); do
    PORT=$((20000 + RANDOM % 40000))
    port_in_use "$PORT" || break
  done
fi
if ! [[ "$PORT" =~ ^[0-9]+$ ]]; then
  echo "local_multiprocess.sh: --port '$PORT' is not a port number" >&2
  exit 2
fi

XLA="${XLA_FLAGS:-}${XLA_FLAGS:+ }--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS}"
PREFIX=()
if [[ -n "$TIMEOUT" ]]; then
  PREFIX=(timeout --kill-after=10 "$TIMEOUT")
fi

# Each process leads its own process group (setsid), so that stopping it also stops
# whatever it started (reward workers, compilers).
SESSION=()
if command -v setsid >/dev/null; then
  SESSION=(setsid)
fi

pids=()
signal_all() {
  local pid
  for pid in "${pids[@]+"${pids[@]}"}"; do
    kill "-$1" -- "-$pid" 2>/dev/null || kill "-$1" "$pid" 2>/dev/null || true
  done
}
stop_all() {
  signal_all TERM
  local pid _
  for _ in $(seq 50); do  # up to 10 s to exit cleanly, then SIGKILL
    for pid in "${pids[@]+"${pids[@]}"}"; do
      if kill -0 "$pid" 2>/dev/null; then
        sleep 0.2
        continue 2
      fi
    done
    return 0
  done
  signal_all KILL
}
trap 'stop_all; exit 130' INT TERM

for ((i = 0; i < NUM_PROCESSES; i++)); do
  env_vars=(
    "GRPO_JAX_COORDINATOR=127.0.0.1:${PORT}"
    "GRPO_JAX_NUM_PROCESSES=${NUM_PROCESSES}"
    "GRPO_JAX_PROCESS_ID=${i}"
    "JAX_PLATFORMS=cpu"
    "XLA_FLAGS=${XLA}"
  )
  full=(env "${env_vars[@]}" "${PREFIX[@]+"${PREFIX[@]}"}" "${COMMAND[@]}")
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${full[@]}"
    if [[ -n "$LOG_DIR" ]]; then
      printf '> %q 2>&1 ' "$LOG_DIR/process_${i}.log"
    fi
    printf '&\n'
    continue
  fi
  if [[ -n "$LOG_DIR" ]]; then
    mkdir -p "$LOG_DIR"
    "${SESSION[@]+"${SESSION[@]}"}" "${full[@]}" >"$LOG_DIR/process_${i}.log" 2>&1 &
  else
    "${SESSION[@]+"${SESSION[@]}"}" "${full[@]}" &
  fi
  pids+=("$!")
done

if [[ "$DRY_RUN" == 1 ]]; then
  echo "wait  # for all ${NUM_PROCESSES} processes; the first failure stops the rest"
  exit 0
fi

# Poll rather than "wait -n": it works on every bash and tells which process ended.
status=0
remaining=("${pids[@]}")
while [[ ${#remaining[@]} -gt 0 && "$status" -eq 0 ]]; do
  still=()
  for pid in "${remaining[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      still+=("$pid")
      continue
    fi
    code=0
    wait "$pid" || code=$?
    if [[ "$code" -ne 0 ]]; then
      status="$code"
      echo "local_multiprocess.sh: process $pid exited with status $code; stopping the others" >&2
      stop_all
      break
    fi
  done
  remaining=("${still[@]+"${still[@]}"}")
  sleep 0.2
done
for pid in "${pids[@]}"; do
  wait "$pid" 2>/dev/null || true
done
exit "$status"
