"""Partial rollouts in a run (sampling.partial_rollouts): the staleness bound holds token by
token, carried rows reach the batches, and a run killed with rows in flight resumes to the
same parameters and metrics as an uninterrupted one."""

import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_resume import (
    _assert_same_params,
    _params_like,
    _restore,
    train_killed_at,
    without_timings,
)

from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

pytestmark = pytest.mark.slow  # three runs of the smoke config per case


def _config(k):
    return smoke_config(
        **SHORT_RUN,
        **{
            # Length-dependent rewards: groups have reward variance, so every update moves the
            # policy and each version differs from the one before (as rollout/test_staleness.py).
            "rewards": "overlong(max_len=16,buffer=15):1.0",
            "correct_reward": "overlong",
            "sampling.max_new_tokens": 16,
            "optim.warmup_steps": 0,
            "sampling.engine": "paged",
            "sampling.page_size": 4,
            "sampling.prefill_chunk": 8,
            "sampling.partial_rollouts": True,
            "train.max_staleness": k,
        },
    )


@pytest.mark.parametrize("k", [1, 2])
def test_kill_and_resume_with_rows_in_flight_equals_the_uninterrupted_run(tmp_path, k):
    cfg = _config(k)
    train(cfg, tmp_path / "whole")
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    steps = [r for r in whole if r["step"] >= 1]
    # Every token is at most k updates old when its step trains on it, and carried tokens
    # do reach the batches.
    assert all(0 <= r["partial/token_staleness_max"] <= k for r in steps)
    assert max(r["partial/token_staleness_max"] for r in steps) >= 1
    assert sum(r["partial/carried_rows"] for r in steps) > 0
    assert steps[0]["partial/carried_rows"] == 0  # step 1's rows all start at step 1
    # The first update scores its own samples with the parameters that drew them.
    assert abs(steps[0]["train/ratio_max"] - 1.0) < 1e-4

    # Killed after step 3: the checkpoint of step 2 holds the rows in flight.
    train_killed_at(cfg, tmp_path / "killed", 3)
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    assert ck.all_steps() == [2]
    groups = ck.restore_meta(2)["inflight"]["partial"]["groups"]
    ck.close()
    assert len(groups) == k * 4  # the next k steps' groups (B = 4)
    assert steps[1]["partial/inflight_rows"] > 0  # some were mid-completion at the save
    train(cfg, tmp_path / "killed")

    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    like = _params_like(cfg, tmp_path / "whole")
    _assert_same_params(*(_restore(tmp_path / w, like) for w in ("whole", "killed")))
