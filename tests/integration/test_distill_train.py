"""Whole runs with a teacher (on-policy distillation): its tokenizer checked at start-up,
its metrics written, and a killed run resumed exactly, with a checkpoint as teacher and
with the reference."""

import io

import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_hf import make_tiny_hf_checkpoint
from helpers_resume import train_killed_at, without_timings

from grpo_jax.core.errors import ConfigError
from grpo_jax.models.builtin_tokenizer import build_tokenizer
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

pytestmark = pytest.mark.slow  # whole runs


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny Llama checkpoint with the project's built-in tokenizer: the smoke run's."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("teacher"), "llama", seed=3)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, teacher_dir):
    other = make_tiny_hf_checkpoint(tmp_path / "other", "llama", tokenizer=False)
    tok = build_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(other))
    cfg = smoke_config(**{**SHORT_RUN, "teacher.path": str(other)})
    with pytest.raises(ConfigError) as e:
        train(cfg, tmp_path / "run", stream=io.StringIO())
    line = str(e.value)
    assert "\n" not in line
    assert f"'teacher.path' = {str(other)!r}" in line and "'builtin'" in line
    assert "101 tokens" in line and "100 tokens" in line
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


@pytest.mark.parametrize("which", ["checkpoint", "reference"])
def test_kill_and_resume_with_a_teacher_is_exact(tmp_path, teacher_dir, which):
    """Killed after step 3 (checkpoint at 2), resumed: the records equal the whole run's.
    "reference" with beta = 0: the resumed run remakes the base policy as the teacher."""
    path = str(teacher_dir) if which == "checkpoint" else "reference"
    cfg = smoke_config(**{**SHORT_RUN, "teacher.path": path, "teacher.weight": 0.5})
    out = io.StringIO()
    train(cfg, tmp_path / "whole", stream=out)
    assert "teacher parameters" in out.getvalue()  # the memory plan counts them
    train_killed_at(cfg, tmp_path / "killed", 3, stream=io.StringIO())
    train(cfg, tmp_path / "killed", stream=io.StringIO())
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    steps = [r for r in whole if "train/loss" in r]
    assert len(steps) == 4 and all(r["teacher/adv_share"] >= 0 for r in steps)
    if which == "reference":  # the base policy scores itself on step 1's on-policy samples
        assert abs(steps[0]["teacher/kl"]) < 1e-5
    else:
        assert all(r["teacher/kl"] > 0 and r["teacher/adv_share"] > 0 for r in steps)
    assert without_timings(resumed) == without_timings(whole)
