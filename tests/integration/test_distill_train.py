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


def test_a_full_kl_teacher_whose_vocabulary_is_smaller_is_refused_in_one_line(tmp_path):
    small = make_tiny_hf_checkpoint(tmp_path / "small", "llama", vocab_size=50)
    cfg = smoke_config(**{**SHORT_RUN, "teacher.path": str(small), "teacher.kl": "full"})
    with pytest.raises(ConfigError) as e:
        train(cfg, tmp_path / "run", stream=io.StringIO())
    assert "\n" not in str(e.value) and "50 rows, fewer than the student's 100" in str(e.value)


@pytest.mark.parametrize("which", ["checkpoint", "reference", "full"])
def test_kill_and_resume_with_a_teacher_is_exact(tmp_path, teacher_dir, which):
    """Killed after step 3 (checkpoint at 2), resumed: the records equal the whole run's.
    "reference" with beta = 0: the resumed run remakes the base policy as the teacher;
    "full": the checkpoint's full-vocabulary KL."""
    path = "reference" if which == "reference" else str(teacher_dir)
    kl = "full" if which == "full" else "sampled"
    cfg = smoke_config(
        **{**SHORT_RUN, "teacher.path": path, "teacher.weight": 0.5, "teacher.kl": kl}
    )
    out = io.StringIO()
    train(cfg, tmp_path / "whole", stream=out)
    assert "teacher parameters" in out.getvalue()  # the memory plan counts them
    train_killed_at(cfg, tmp_path / "killed", 3, stream=io.StringIO())
    train(cfg, tmp_path / "killed", stream=io.StringIO())
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    steps = [r for r in whole if "train/loss" in r]
    assert len(steps) == 4
    if which == "full":
        assert all(r["teacher/kl"] > 0 and "teacher/adv_share" not in r for r in steps)
    elif which == "reference":  # the base policy scores itself on step 1's on-policy samples
        assert abs(steps[0]["teacher/kl"]) < 1e-5 and steps[0]["teacher/adv_share"] >= 0
    else:
        assert all(r["teacher/kl"] > 0 and r["teacher/adv_share"] > 0 for r in steps)
    assert without_timings(resumed) == without_timings(whole)


def test_a_packed_step_scores_the_teacher_as_the_padded_one(tmp_path, teacher_dir):
    """train.packing = "on": the teacher's log-probs come from packed rows, and the step's
    teacher metrics and loss are the padded step's."""
    run = {**SHORT_RUN, "train.steps": 1, "checkpoint.every": 0, "teacher.path": str(teacher_dir)}
    rows = {}
    for packing in ("off", "on"):
        train(smoke_config(**run, **{"train.packing": packing}), tmp_path / packing)
        (rows[packing],) = [
            r for r in read_metrics(tmp_path / packing / "metrics.jsonl") if "train/loss" in r
        ]
    for key in ("teacher/kl", "teacher/adv_share", "train/loss"):
        assert rows["on"][key] == pytest.approx(rows["off"][key], rel=1e-5), key
