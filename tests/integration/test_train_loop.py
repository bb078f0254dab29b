"""The GRPO loop end to end on the smoke config: logs, exact resume, SIGTERM, non-finite stop.

Every test trains the smoke variant of configs/default.py (a 1-layer model,
a few steps) on one CPU device. Compiled programs are shared between the runs
of this module through JAX's persistent compilation cache.
"""

import contextlib
import io
import json
import os
import signal

import jax
import numpy as np
import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_resume import train_killed_at, without_timings

from grpo_jax.core.errors import NonFiniteError
from grpo_jax.objective import losses
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

pytestmark = pytest.mark.slow  # every test trains the smoke config end to end

REQUIRED_KEYS = [
    "rewards/mean",
    "rewards/std",
    "rewards/exact_match/mean",
    "rewards/exact_match/std",
    "rewards/exact_match/errors",
    "rewards/format/mean",
    "rewards/format/std",
    "rollout/pass_rate",
    "rollout/length_mean",
    "rollout/length_max",
    "rollout/truncated_frac",
    "rollout/invalid_format_frac",
    "rollout/duplicate_frac",
    "rollout/group_reward_var",
    "rollout/frac_zero_var_groups",
    "train/kl",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/ratio_mean",
    "train/ratio_min",
    "train/ratio_max",
    "train/entropy",
    "train/grad_norm",
    "train/lr",
    "train/loss",
    "train/skipped_updates",
    "perf/sample_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/time_sample_s",
    "perf/time_reward_s",
    "perf/time_train_s",
    "perf/step_s",
    "policy/kl_old_new",
]


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    old = {
        k: getattr(jax.config, k)
        for k in (
            "jax_compilation_cache_dir",
            "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes",
        )
    }
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for k, v in old.items():
        jax.config.update(k, v)


def _final_params(workdir, like):
    ck = Checkpointer(workdir / "checkpoints")
    try:
        return ck.restore_params(params_like=like), ck.latest_step()
    finally:
        ck.close()


def _like_params(tokenizer):
    from grpo_jax.run import builders
    from grpo_jax.run import config as config_lib

    run = config_lib.parse_config(smoke_config(**SHORT_RUN))
    return builders.build_model(run, tokenizer, builders.build_mesh(run))[1]


def test_end_to_end_smoke_run(tmp_path):
    wd = tmp_path / "run"
    summary = train(smoke_config(**{"grpo.beta": 0.04}), wd)
    on_disk = json.loads((wd / "summary.json").read_text())
    assert set(on_disk) >= {"before", "after", "wall_seconds"}
    assert on_disk["before"]["pass_at_1"] == summary["before"]["pass_at_1"]
    assert 0.0 <= on_disk["after"]["pass_at_1"] <= 1.0 and on_disk["wall_seconds"] > 0
    records = read_metrics(wd / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
    # Evaluations at the start (step 0), every 2 steps and at the end, with pass@k.
    for step in (0, 2, 3):
        assert {"eval/pass_at_1", "eval/pass_at_k", "eval/pass_at_2"} <= set(records[step])
    assert "eval/pass_at_1" not in records[1]
    assert list((wd / "tensorboard").glob("events.out.tfevents.*"))
    assert (wd / "samples" / "step_0000002.txt").read_text().count("[completion]") == 4
    assert (wd / "warm_start" / "info.json").exists()
    assert (wd / "tokenizer" / "tokenizer.json").exists()
    ck = Checkpointer(wd / "checkpoints")
    assert ck.all_steps() == [2, 3]
    meta = ck.restore_meta()
    ck.close()
    assert meta["counters"]["step"] == 3 and meta["data_iterator"]["position"] == 12
    # Running the same command again finds the run finished: nothing is retrained,
    # and the KL reference (the warm-started policy) comes from the workdir's cache.
    out = io.StringIO()
    again = train(smoke_config(**{"grpo.beta": 0.04}), wd, stream=out)
    assert "warm start: loaded from" in out.getvalue()
    assert "resuming from the checkpoint at step 3" in out.getvalue()
    assert again["after"]["pass_at_1"] == summary["after"]["pass_at_1"]
    assert again["steps"] == 3


def test_resume_after_kill_is_exact(tmp_path, builtin_tokenizer):
    cfg = smoke_config(**SHORT_RUN)
    train(cfg, tmp_path / "whole")

    # Between the checkpoints at 2 and 4: step 3 is lost.
    train_killed_at(cfg, tmp_path / "killed", 3)
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    assert ck.all_steps() == [2]
    ck.close()
    train(cfg, tmp_path / "killed")

    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    like = _like_params(builtin_tokenizer)
    a, sa = _final_params(tmp_path / "whole", like)
    b, sb = _final_params(tmp_path / "killed", like)
    assert sa == sb == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (
        json.loads((tmp_path / "killed" / "summary.json").read_text())["after"]
        == json.loads((tmp_path / "whole" / "summary.json").read_text())["after"]
    )


def test_sigterm_saves_and_returns(tmp_path):
    cfg = smoke_config(**{**SHORT_RUN, "checkpoint.every": 0})

    def term_at_1(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    out = train(cfg, tmp_path, step_callback=term_at_1)
    assert out == {"preempted": True, "step": 2}
    ck = Checkpointer(tmp_path / "checkpoints")
    assert ck.all_steps() == [2]
    ck.close()
    assert not (tmp_path / "summary.json").exists()
    assert signal.getsignal(signal.SIGTERM) is not None  # The handler was restored.
    done = train(cfg, tmp_path)
    assert done["steps"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_nonfinite_updates_stop_the_run(tmp_path, monkeypatch):
    real = losses.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(losses, "grpo_loss", nan_loss)
    cfg = smoke_config(**{**SHORT_RUN, "train.max_nonfinite_in_row": 2, "eval.at_start": False})
    with pytest.raises(NonFiniteError, match=r"the last 2 updates had a non-finite loss"):
        train(cfg, tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["train/skipped_updates"] for r in records] == [1, 1]
    assert [r["train/updates"] for r in records] == [0, 0]
    assert not (tmp_path / "summary.json").exists()


def test_train_time_covers_the_update_on_every_step(tmp_path, monkeypatch):
    """perf/time_train_s spans the update on checkpoint, evaluation and last steps too:
    an update made to take at least 0.3 s is never recorded as shorter."""
    import time

    real = losses.grpo_loss

    def slow_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        jax.debug.callback(lambda x: time.sleep(0.3), loss)
        return loss, metrics

    monkeypatch.setattr(losses, "grpo_loss", slow_loss)
    cfg = smoke_config(**{**SHORT_RUN, "train.steps": 4, "checkpoint.every": 2, "eval.every": 3})
    train(cfg, tmp_path, stream=io.StringIO())
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "perf/time_train_s" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["perf/time_train_s"] >= 0.3, (r["step"], r["perf/time_train_s"])


def test_the_update_compiled_ahead_serves_every_step(tmp_path, monkeypatch):
    """The first step compiles the update in a thread from ``batch_spec``; that spec is the
    real batch's signature, so every step runs that executable and the jitted update itself
    never compiles. The run equals one whose update is the plain jitted function."""
    from grpo_jax.learner import ahead as ahead_lib
    from grpo_jax.run import train as train_lib

    made, calls = [], []
    real_init, real_call = ahead_lib.CompiledAhead.__init__, ahead_lib.CompiledAhead.__call__

    def init(self, jitted, *args):
        made.append((self, jitted))
        real_init(self, jitted, *args)

    def call(self, *args):
        calls.append(ahead_lib._signature(args) == self._signature)
        return real_call(self, *args)

    monkeypatch.setattr(ahead_lib.CompiledAhead, "__init__", init)
    monkeypatch.setattr(ahead_lib.CompiledAhead, "__call__", call)
    cfg = smoke_config(**{**SHORT_RUN, "train.steps": 3, "checkpoint.every": 0})
    train(cfg, tmp_path / "ahead", stream=io.StringIO())
    assert len(made) == 1 and calls == [True, True, True]
    assert made[0][1]._cache_size() == 0  # the jitted update was never compiled

    monkeypatch.setattr(  # the plain jitted update (a context manager's value, as the real)
        train_lib, "_update_compiled_ahead", lambda s, *a: contextlib.nullcontext(s.trainer.update)
    )
    train(cfg, tmp_path / "plain", stream=io.StringIO())
    ahead = read_metrics(tmp_path / "ahead" / "metrics.jsonl")
    plain = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert without_timings(ahead) == without_timings(plain)


def test_no_compilation_of_the_update_outlives_its_run(tmp_path, monkeypatch):
    """A run that ends before its first update (here its sampler raises) waits for the
    update it was compiling ahead: no thread of it is left tracing while the caller goes on
    (into the next run, or into undoing what the run's code was patched with)."""
    import threading

    from grpo_jax.rollout import rounds as rollout

    class Stop(Exception):
        pass

    def failing_finish(*args, **kwargs):
        raise Stop

    # The sampler's round raises once dispatched (the update compiling ahead by then).
    monkeypatch.setattr(rollout, "finish_round", failing_finish)
    with pytest.raises(Stop):
        train(smoke_config(**{**SHORT_RUN, "eval.at_start": False}), tmp_path, stream=io.StringIO())
    left = [t.name for t in threading.enumerate() if t.name.startswith("compile-update")]
    assert left == []
