"""This core's single-matmul throughput, for ``grpo_step.py``'s fraction-of-limit figures.

Run by the driver with the project's ``.venv/bin/python`` (jax and torch) as

    python benchmarks/_matmul_peak.py SHAPES.json

where SHAPES.json is ``{"shapes": [[M, K, N], ...], "threads": n, "repeats": r}``.
Each [M, K] x [K, N] float32 matmul is timed alone, jitted by XLA and by
torch (``torch.set_num_threads(threads)``; XLA's thread pool comes from the
driver's XLA_FLAGS, as for the JAX sides), best of ``repeats`` after one
untimed call. Prints one line ``MATMUL_PEAK {json}``: GFLOP/s (2*M*K*N /
seconds / 1e9) per shape and framework.
"""

from __future__ import annotations

import json
import sys
import time

PREFIX = "MATMUL_PEAK "


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    rng = np.random.default_rng(0)
    out = []
    for m, k, n in spec["shapes"]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        flops = 2.0 * m * k * n
        mm, xa, xb = jax.jit(jnp.matmul), jnp.asarray(a), jnp.asarray(b)
        xla_s = best_seconds(lambda: mm(xa, xb).block_until_ready(), spec["repeats"])
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        with torch.no_grad():
            torch_s = best_seconds(lambda: torch.matmul(ta, tb), spec["repeats"])
        out.append(
            {
                "shape": [m, k, n],
                "xla_gflops": flops / xla_s / 1e9,
                "torch_gflops": flops / torch_s / 1e9,
            }
        )
    sys.stdout.write(
        PREFIX + json.dumps({"results": out, "torch_threads": torch.get_num_threads()}) + "\n"
    )


if __name__ == "__main__":
    main(sys.argv[1])
