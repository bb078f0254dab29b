"""What one call of the code sandbox costs: the kernel's sandbox beside the hooks' sandbox.

    .venv/bin/python benchmarks/sandbox_calls.py [--calls 20] [--code "print(1)"]

``grpo_jax.tools.sandbox.run_python`` starts a fresh Python process per call. With
``sandbox="kernel"`` bubblewrap gives it new namespaces and a seccomp filter; with
``sandbox="hooks"`` (no bubblewrap) the process guards itself with audit hooks. The two are
called in turn, call after call, so that the machine's load falls on both alike; the
script prints each one's median, lowest and highest wall time per call and their ratio.
Calls whose output is not the expected one stop the script.
"""

from __future__ import annotations

import argparse
import statistics
import time

from grpo_jax.tools import bubblewrap
from grpo_jax.tools.sandbox import run_python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--code", default="print(1)")
    ap.add_argument("--expect", default="1", help="the stdout each call must print")
    args = ap.parse_args()
    modes = ("kernel", "hooks") if bubblewrap.problem() is None else ("hooks",)
    times = {mode: [] for mode in modes}
    for _ in range(args.calls):
        for mode in modes:
            t = time.perf_counter()
            result = run_python(args.code, sandbox=mode)
            times[mode].append(time.perf_counter() - t)
            if result.stdout.strip() != args.expect:
                raise SystemExit(f"sandbox={mode}: got {result!r}")
    for mode, ts in times.items():
        print(
            f"sandbox={mode:<7} {args.calls} calls: median {statistics.median(ts) * 1e3:.0f} ms, "
            f"lowest {min(ts) * 1e3:.0f} ms, highest {max(ts) * 1e3:.0f} ms"
        )
    if len(modes) == 2:
        ratio = statistics.median(times["kernel"]) / statistics.median(times["hooks"])
        print(f"kernel / hooks, medians: {ratio:.2f}x")
    else:
        print(f"the kernel's sandbox was not measured: {bubblewrap.problem()}")


if __name__ == "__main__":
    main()
