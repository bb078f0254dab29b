"""A run that samples with a bfloat16 copy of its float32 policy (sampling.param_dtype).

pi_old is rescored with the trained parameters (grpo.old_logps = "recompute") and
truncated importance weights correct for what the copy drew: the first ratio is 1,
and the behaviour metrics see the copy's mismatch, which a float32 sampler does
not have.
"""

import io

import pytest
from helpers_config import SHORT_RUN, smoke_config

from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

pytestmark = pytest.mark.slow  # trains the smoke config end to end


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_a_run_samples_with_the_bfloat16_copy_and_corrects_for_it(tmp_path, engine):
    overrides = {
        **SHORT_RUN,
        "sampling.engine": engine,
        "train.steps": 2,
        "checkpoint.every": 0,
        "sampling.param_dtype": "bfloat16",
        "grpo.old_logps": "recompute",
        "grpo.behavior_correction": "tis",
    }
    out = io.StringIO()
    train(smoke_config(**overrides), tmp_path, stream=out)
    console = out.getvalue()
    assert "sampling copy" in console and "WARNING: sampling.param_dtype" not in console
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        # pi_old rescored in float32 from the parameters that made the copy: ratio 1.
        assert abs(r["train/ratio_max"] - 1.0) < 1e-4 and abs(r["train/ratio_min"] - 1.0) < 1e-4
        # The copy's log-probs are bfloat16's: |log pi_old - log q| is visibly above float32
        # rounding (a float32 sampler's is below 1e-5), and small.
        assert 1e-4 < r["behavior/abs_log_diff_mean"] < 0.1, r["behavior/abs_log_diff_mean"]
        assert r["rollout/length_mean"] > 0
