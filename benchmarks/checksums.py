"""What the checksums of saved state cost (grpo_jax.core.integrity), beside the save and restore.

    .venv/bin/python benchmarks/checksums.py [--state default|qwen2.5-0.5b] [--rounds 3]

``default``: the parameters and AdamW state of configs/default.py's model. ``qwen2.5-0.5b``:
float32 parameters of Qwen2.5-0.5B's shapes (494M: 24 layers, hidden 896, MLP 4864,
vocabulary 151,936, tied embeddings) and, with ``--adam``, the two AdamW moments of
the same shapes (3 x 1.98 GB: mind the host's memory). For each round it times the
value digests (``tree_digests``: the jitted reduction and the copy of its sums; the
first round compiles it), the Checkpointer's save of that state with its checksums,
waited for, and its restore, which verifies them, and prints medians and the digests'
throughput; then sha256 of a file as large as the parameters (the reward model's
SHA256SUMS). The figures are the machine's: rerun them on the one you train on.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from grpo_jax.core import integrity  # noqa: E402
from grpo_jax.run.checkpoints import Checkpointer  # noqa: E402

QWEN_05B = dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, mlp=4864)


def qwen_params(key) -> dict:
    c = QWEN_05B
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    layer = {
        "q": (c["hidden"], q),
        "q_bias": (q,),
        "k": (c["hidden"], kv),
        "k_bias": (kv,),
        "v": (c["hidden"], kv),
        "v_bias": (kv,),
        "o": (q, c["hidden"]),
        "gate": (c["hidden"], c["mlp"]),
        "up": (c["hidden"], c["mlp"]),
        "down": (c["mlp"], c["hidden"]),
        "attn_norm": (c["hidden"],),
        "mlp_norm": (c["hidden"],),
    }
    params = {"embed": (c["vocab"], c["hidden"]), "final_norm": (c["hidden"],)}
    params["layers"] = {str(i): dict(layer) for i in range(c["layers"])}
    shapes, tree = jax.tree.flatten(params, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(shapes))
    arrays = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]
    return jax.tree.unflatten(tree, arrays)


def default_state(workdir: pathlib.Path):
    from configs.default import get_config
    from grpo_jax.run import builders as run_lib
    from grpo_jax.run.config import parse_config

    run = parse_config(get_config())
    tok = run_lib.build_tokenizer(run, workdir)
    _, params = run_lib.build_model(run, tok, run_lib.build_mesh(run))
    return params, optax.adamw(1e-4).init(params)


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", choices=("default", "qwen2.5-0.5b"), default="default")
    ap.add_argument("--adam", action="store_true", help="qwen2.5-0.5b: the AdamW moments too")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="checksums_"))
    if args.state == "default":
        params, opt_state = default_state(tmp / "wd")
    else:
        params = qwen_params(jax.random.key(0))
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        opt_state = {"count": jnp.zeros((), jnp.int32)}  # Orbax saves no empty item
        if args.adam:
            opt_state.update(mu=zeros(), nu=zeros())
    jax.block_until_ready((params, opt_state))
    size = nbytes((params, opt_state))
    print(
        f"{args.state}: {len(jax.tree.leaves((params, opt_state)))} arrays, {size / 1e9:.3f} GB,"
        f" {jax.devices()[0].platform}, {os.cpu_count()} CPUs"
    )
    rows = {"digests": [], "save": [], "restore": []}
    for r in range(args.rounds):
        d = timed(lambda: (integrity.tree_digests(params), integrity.tree_digests(opt_state)))
        ck = Checkpointer(tmp / f"ck{r}", keep=1, async_save=False)
        save = timed(lambda: ck.save(1, params=params, opt_state=opt_state, meta={}))
        restore = timed(lambda: ck.restore(1, params_like=params, opt_state_like=opt_state))
        ck.close()
        print(f"round {r}: digests {d:.3f} s, save {save:.3f} s, restore {restore:.3f} s")
        for k, v in zip(rows, (d, save, restore), strict=True):
            rows[k].append(v)
    steady = rows["digests"][1:] or rows["digests"]
    print(
        "median: "
        + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in rows.items())
        + f"; digests after the first round {statistics.median(steady):.3f} s "
        f"({size / 1e9 / statistics.median(steady):.2f} GB/s, each of save and restore)"
    )
    blob = tmp / "blob"
    with open(blob, "wb") as f:
        for leaf in jax.tree.leaves(params):
            f.write(np.asarray(leaf).tobytes())
    t = timed(lambda: integrity.file_digest(blob))
    print(f"sha256 of a {blob.stat().st_size / 1e9:.3f} GB file: {t:.3f} s")


if __name__ == "__main__":
    main()
