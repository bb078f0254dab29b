"""A run on the paged engine (sampling.engine = "paged"): the trainer takes its rollouts as
the static sampler's, and the first update's ratio is 1 up to float32 rounding."""

import pytest
from helpers_config import SHORT_RUN, smoke_config

from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

pytestmark = pytest.mark.slow  # trains the smoke config end to end


def test_a_run_on_the_paged_engine_trains_on_its_own_log_probs(tmp_path):
    overrides = {
        **SHORT_RUN,
        "train.steps": 2,
        "checkpoint.every": 0,
        "sampling.engine": "paged",
        "sampling.page_size": 4,
        "sampling.slots": 3,  # fewer slots than rows: the queue refills them
    }
    train(smoke_config(**overrides), tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: the evaluation before training
    first = records[1]
    # The first pass of the first update scores the engine's own samples with the same
    # parameters: every token's ratio is exp(0) up to the rounding of the two computations.
    assert abs(first["train/ratio_max"] - 1.0) < 1e-4 and abs(first["train/ratio_min"] - 1.0) < 1e-4
    assert first["rollout/length_mean"] > 0
    # The engine's statistics reach the run's metrics.
    assert 0.0 < first["engine/slot_occupancy"] <= 1.0
    assert first["engine/peak_pages"] >= 1
