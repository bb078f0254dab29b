"""Whole runs with learned rewards: a reward model and the reference policy as judge, both
weighted into the total, their metrics written, the judge holding the reference's arrays;
a killed run with the running normalisation resumes exactly."""

import json
import math

import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_hf import make_tiny_hf_classifier
from helpers_resume import train_killed_at, without_timings

from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics


@pytest.mark.slow
def test_run_with_a_reward_model_and_the_reference_as_judge(tmp_path):
    rm = make_tiny_hf_classifier(tmp_path / "rm", "qwen2")
    cfg = smoke_config(
        **{
            **SHORT_RUN,
            "train.steps": 2,
            "checkpoint.every": 0,
            "grpo.beta": 0.04,
            "reward_model.path": str(rm),
            "reward_model.weight": 0.5,
            "reward_model.normalize": "group",
            "reward_model.buckets": (128, 256, 512),
            "reward_model.batch_size": 8,
            "judge.path": "reference",
            "judge.weight": 0.25,
            "judge.buckets": (256, 512),
            "judge.batch_size": 8,
        }
    )
    summary = train(cfg, tmp_path / "wd")
    assert summary  # the run finished and wrote its summary
    records = [json.loads(line) for line in (tmp_path / "wd" / "metrics.jsonl").open()]
    steps = [r for r in records if "rewards/reward_model/mean" in r]
    assert len(steps) == 2
    for r in steps:
        for key in ("rewards/reward_model/mean", "rewards/judge/mean", "rewards/judge/std"):
            assert math.isfinite(r[key]), (key, r)
        assert r["rewards/reward_model/errors"] == 0 and r["rewards/judge/errors"] == 0
        assert 1.0 <= r["rewards/judge/mean"] <= 5.0  # an expected score over "1".."5"
        assert abs(r["rewards/reward_model/mean"]) < 1e-5  # group-standardised: mean 0


@pytest.mark.slow
def test_a_killed_run_with_the_running_normalisation_resumes_exactly(tmp_path):
    """The moments are in the checkpoint: steps 3 and 4 of the resumed run standardise the
    reward model's scores by the moments of steps 1-2 as the uninterrupted run does (a
    resume that started them afresh would standardise step 3 by its own batch alone)."""
    rm = make_tiny_hf_classifier(tmp_path / "rm", "qwen2")
    cfg = smoke_config(
        **{
            **SHORT_RUN,
            "reward_model.path": str(rm),
            "reward_model.weight": 0.5,
            "reward_model.normalize": "running",
            "reward_model.buckets": (128, 256, 512),
            "reward_model.batch_size": 8,
        }
    )
    train(cfg, tmp_path / "whole")

    # Between the checkpoints at 2 and 4: step 3 is redone.
    train_killed_at(cfg, tmp_path / "killed", 3)
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    assert ck.all_steps() == [2]
    assert ck.restore_meta(2)["reward_moments"]["reward_model"]["count"] == 2 * 16
    ck.close()
    train(cfg, tmp_path / "killed")

    whole = without_timings(read_metrics(tmp_path / "whole" / "metrics.jsonl"))
    resumed = without_timings(read_metrics(tmp_path / "killed" / "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    assert [r.get("rewards/reward_model/mean") for r in resumed] == [
        r.get("rewards/reward_model/mean") for r in whole
    ]
    assert resumed == whole
