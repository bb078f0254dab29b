"""The first training step and the whole smoke run of two checkouts, side by side.

    .venv/bin/python benchmarks/first_step.py /tmp/before . [--rounds 3] [--steps 2]

Runs ``python -m grpo_jax.main --config=configs/default.py:smoke --workdir=<fresh>
--config.train.steps=<steps>`` from each checkout's directory (so each imports its own
grpo_jax), alternating A, B, A, B, ... so that a shared machine's load falls on both
alike, and prints per run and as medians: the first step's ``perf/step_s`` (its
compilation included) and ``perf/time_train_s`` from metrics.jsonl, the second step's,
the run's ``wall_seconds`` from summary.json and the process's wall time, with the load
average before each run. Every run starts from an empty workdir and no persistent
compilation cache (``train.compilation_cache_dir`` is empty by default).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

KEYS = ("step1_s", "step1_train_s", "step2_s", "run_wall_s", "process_s")


def one_run(checkout: pathlib.Path, workdir: pathlib.Path, steps: int) -> dict:
    load = pathlib.Path("/proc/loadavg").read_text().split()[0]
    cmd = [sys.executable, "-m", "grpo_jax.main", "--config=configs/default.py:smoke"]
    cmd += [f"--workdir={workdir}", f"--config.train.steps={steps}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=checkout, check=True, capture_output=True)
    process_s = time.perf_counter() - t0
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    rows = [m for m in map(json.loads, lines) if "perf/step_s" in m]
    summary = json.loads((workdir / "summary.json").read_text())
    return {
        "step1_s": rows[0]["perf/step_s"],
        "step1_train_s": rows[0]["perf/time_train_s"],
        "step2_s": rows[1]["perf/step_s"] if len(rows) > 1 else float("nan"),
        "run_wall_s": summary["wall_seconds"],
        "process_s": process_s,
        "load1": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="the first checkout (e.g. a worktree of the older commit)")
    ap.add_argument("b", help="the second checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    trees = {"a": pathlib.Path(args.a).resolve(), "b": pathlib.Path(args.b).resolve()}
    results = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="first-step-") as scratch:
        for r in range(args.rounds):
            for name, checkout in trees.items():
                res = one_run(checkout, pathlib.Path(scratch) / f"{name}{r}", args.steps)
                results[name].append(res)
                figures = " ".join(f"{k} {res[k]:.2f}" for k in KEYS)
                print(f"{name} ({checkout}) run {r}: {figures} (load {res['load1']})", flush=True)
    for name, checkout in trees.items():
        med = " ".join(f"{k} {statistics.median(x[k] for x in results[name]):.2f}" for k in KEYS)
        print(f"median {name} ({checkout}): {med}")


if __name__ == "__main__":
    main()
