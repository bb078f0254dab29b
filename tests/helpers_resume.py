"""Kill a training run after a step, damage what it saved, and compare the records of a
resumed run with an uninterrupted one: for the exact-resume tests."""

import jax
import numpy as np
import pytest

from grpo_jax.run import config as config_lib
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.train import TIMING_PREFIXES, train


class Killed(Exception):
    """Raised out of the training loop by :func:`train_killed_at`'s step callback."""


def train_killed_at(config, workdir, step: int, **train_kwargs) -> None:
    """Trains ``config`` in ``workdir`` and stops it with an exception right after step
    ``step``'s bookkeeping, as a crash would: no checkpoint of that step is written unless
    one was due. Rerunning ``train(config, workdir)`` then resumes."""

    def kill(done: int) -> None:
        if done == step:
            raise Killed

    with pytest.raises(Killed):
        train(config, workdir, step_callback=kill, **train_kwargs)


def resumes_exactly(config, root) -> list[dict]:
    """Trains ``config`` (5 records: steps 0-4, checkpoints at 2 and 4) whole in
    ``root/whole``, and in ``root/killed`` killed after step 3 and rerun; asserts the resumed
    run's records equal the whole run's but for wall-clock fields, and returns the whole
    run's records."""
    from grpo_jax.run.writers import read_metrics

    train(config, root / "whole")
    train_killed_at(config, root / "killed", 3)  # between the checkpoints at 2 and 4
    train(config, root / "killed")
    whole = read_metrics(root / "whole" / "metrics.jsonl")
    resumed = read_metrics(root / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    return whole


def without_timings(records: list[dict]) -> list[dict]:
    """metrics.jsonl records without their wall-clock fields (``TIMING_PREFIXES``): what
    a resumed run must reproduce exactly."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in records]


def flip_bytes(step_dir, item="params", n=64, every=False):
    """Flips ``n`` bytes in the middle of the largest data file of a step's item: bit rot
    that leaves every file in place, of its size. (Small arrays live in the item's d/
    b-tree nodes, which carry a CRC of their own; a process's copy of a node in
    ocdbt.process_0/ is not read, so of equal sizes the item's own is taken.) ``every``:
    in every data file of the item, for a small item whose largest file may be a copy
    that is not read (the sizes of its compressed files vary from run to run)."""
    files = [p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d"]
    largest = max(files, key=lambda p: (p.stat().st_size, p.parent.parent.name == item))
    for data in files if every else [largest]:
        b = bytearray(data.read_bytes())
        mid = len(b) // 2
        b[mid : mid + n] = bytes(x ^ 0xFF for x in b[mid : mid + n])
        data.write_bytes(bytes(b))


def _restore(workdir, like, step=4, latest=4):
    ck = Checkpointer(workdir / "checkpoints")
    try:
        assert ck.latest_step() == latest
        return ck.restore_params(step, params_like=like)
    finally:
        ck.close()


def _params_like(cfg, workdir):
    from grpo_jax.run import builders

    run = config_lib.parse_config(cfg)
    tok = builders.build_tokenizer(run, workdir)
    _, like = builders.build_model(run, tok, builders.build_mesh(run))
    return like


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
