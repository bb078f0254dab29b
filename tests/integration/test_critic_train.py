"""PPO with a learned critic end to end: warm-up, then a killed run resumes exactly, value head
and its optimizer moments included."""

import importlib.util
import math
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers_config import SHORT_RUN, apply_overrides, smoke_config
from helpers_resume import resumes_exactly

from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

pytestmark = pytest.mark.slow  # trains the smoke config three times
ROOT = pathlib.Path(__file__).resolve().parents[2]

CRITIC_RUN = {
    **SHORT_RUN,
    "optim.learning_rate": 1e-2,
    # Half of the untrained model's completions hold a digit below 5: rewards vary.
    "rewards": "exact_match(tag=None):1.0,format(pattern='.*[0-4].*'):0.5",
    "grpo.advantage_estimator": "gae",
    "grpo.gae_lambda": 0.95,
    "grpo.critic_warmup_steps": 1,
}


def _saved_opt_state(workdir, step=4):
    """The checkpoint's optimizer item as written (the policy's moments and the head)."""
    with ocp.StandardCheckpointer() as ck:
        return ck.restore((workdir / "checkpoints" / str(step) / "opt_state").absolute())


def test_a_killed_critic_run_resumes_exactly(tmp_path):
    whole = resumes_exactly(smoke_config(**CRITIC_RUN), tmp_path)
    assert [r["critic/warmup"] for r in whole[1:]] == [1.0, 0.0, 0.0, 0.0]
    assert whole[1]["critic/value_mean"] == 0.0 and whole[-1]["critic/value_mean"] != 0.0

    saved = [_saved_opt_state(tmp_path / wd) for wd in ("whole", "killed")]
    assert set(saved[0]) == {"optimizer", "critic"}
    assert np.any(np.asarray(saved[0]["critic"]["w"]) != 0)
    for a, b in zip(jax.tree.leaves(saved[0]), jax.tree.leaves(saved[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_multiturn_run_trains_its_critic_on_the_models_tokens(tmp_path):
    """configs/multiturn.py with a critic: transcripts whose environment tokens are masked
    out train end to end, and the head moves off zero."""
    spec = importlib.util.spec_from_file_location("mt_cfg", ROOT / "configs" / "multiturn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = {"train.steps": 3, "eval.every": 0, "eval.num_samples": 0, "checkpoint.every": 0}
    run.update({"grpo.advantage_estimator": "gae", "optim.learning_rate": 1e-2})
    train(apply_overrides(mod.get_config("runlocal"), run), tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert all(r["env/turns_mean"] > 1 for r in records)  # transcripts with gaps
    for r in records:
        assert math.isfinite(r["train/value_loss"]) and math.isfinite(r["train/loss"])
    assert records[0]["critic/value_mean"] == 0.0 and records[-1]["critic/value_mean"] != 0.0


def test_a_lora_run_trains_its_adapters_and_its_critic(tmp_path):
    """With LoRA the optimizer follows the adapters and the head; the base stays frozen."""
    lora = {"model.lora.rank": 2, "model.lora.alpha": 4.0, "train.steps": 3}
    train(smoke_config(**{**CRITIC_RUN, **lora, "checkpoint.every": 0}), tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert records[0]["critic/warmup"] == 1.0 and records[-1]["critic/value_mean"] != 0.0
    assert all(r["train/grad_norm"] > 0 and math.isfinite(r["train/value_loss"]) for r in records)
    saved = _saved_opt_state(tmp_path, step=3)
    assert np.any(np.asarray(saved["critic"]["w"]) != 0)
