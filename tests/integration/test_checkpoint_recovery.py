"""Resuming when the newest checkpoint is damaged: fall back to the newest one that restores."""

import io
import json
import pathlib
import subprocess
import sys

import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_resume import flip_bytes, without_timings

from grpo_jax.core.errors import CheckpointError

pytestmark = pytest.mark.slow  # trains the smoke config twice
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(steps):
    return smoke_config(**{**SHORT_RUN, "train.steps": steps, "checkpoint.keep": 3})


def _damage(step_dir):
    """Deletes the data files of a step's parameters (a disk error or a partial copy)."""
    data = [p for p in (step_dir / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for p in data:
        p.unlink()


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(tmp_path):
    from grpo_jax.run.train import train

    train(_config(4), tmp_path, stream=io.StringIO())
    _damage(tmp_path / "checkpoints" / "4")
    out = io.StringIO()
    summary = train(_config(6), tmp_path, stream=out)
    text = out.getvalue()
    assert "checkpoint step 4" in text and "could not be restored" in text
    assert "resuming from the checkpoint at step 2" in text
    assert summary["steps"] == 6
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == sorted(steps) and steps.count(4) == 1 and steps[-1] == 6


def test_steps_with_flipped_bytes_are_set_aside_and_the_run_resumes_from_the_one_before(
    tmp_path,
):
    """Bit rot in the parameters of step 6 (found by their checksums) and in the batch in
    flight saved with step 4 (train.max_staleness = 1; found before the run settles on
    the step): both set aside, one line each; the run goes on from step 2."""
    from grpo_jax.run.train import train

    c = _config(6)
    c.train.max_staleness = 1
    train(c, tmp_path, stream=io.StringIO())
    flip_bytes(tmp_path / "checkpoints" / "6", "params")
    flip_bytes(tmp_path / "checkpoints" / "4", "inflight", every=True)
    # Resumed in a process of its own, as a run after bit rot is: in this process
    # TensorStore's cache may still hold the small item's b-tree nodes as they were written.
    overrides = {**SHORT_RUN, "train.steps": 8, "checkpoint.keep": 3, "train.max_staleness": 1}
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    run = subprocess.run(
        [sys.executable, "-m", "grpo_jax.main", "--config=configs/default.py:smoke",
         f"--workdir={tmp_path}", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 8
    ck, aside = tmp_path / "checkpoints", tmp_path / "checkpoints.unrestorable"
    lines = run.stdout.splitlines()
    said = [line for line in lines if "could not be restored" in line]
    assert len(said) == 2, said
    assert said[0].startswith(f"checkpoint step 6 in {ck} could not be restored (params[")
    assert said[1].startswith(f"checkpoint step 4 in {ck} could not be restored (")
    assert "differs from the checksum saved with it (damaged on disk)" in said[0]
    for line in said:
        assert line.endswith(f"; set aside in {aside}, resuming from step 2"), line
    assert f"resuming from the checkpoint at step 2 in {ck}" in lines
    assert sorted(p.name for p in aside.iterdir()) == ["4", "6"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == sorted(steps) and steps.count(4) == 1 and steps[-1] == 8


def test_no_checkpoint_that_restores_is_a_clear_error(tmp_path):
    from grpo_jax.run.train import train

    train(_config(2), tmp_path, stream=io.StringIO())
    _damage(tmp_path / "checkpoints" / "2")
    with pytest.raises(CheckpointError, match="no checkpoint in .* could be restored: step 2"):
        train(_config(4), tmp_path, stream=io.StringIO())


def test_resume_refuses_a_config_that_changes_the_run(tmp_path):
    from grpo_jax.run.config import ConfigError
    from grpo_jax.run.train import train

    train(_config(2), tmp_path, stream=io.StringIO())
    saved = (tmp_path / "config.json").read_text()
    changed = _config(4)
    changed.grpo.G = 8
    changed.optim.learning_rate = 1e-3
    with pytest.raises(ConfigError, match=r"grpo\.G: 4 -> 8; optim\.learning_rate: 0\.0002 -> "):
        train(changed, tmp_path, stream=io.StringIO())
    assert (tmp_path / "config.json").read_text() == saved  # the run's record is kept
    # Running longer, evaluating or checkpointing differently continues the run.
    longer = _config(4)
    longer.eval.num_problems = 8
    out = io.StringIO()
    assert train(longer, tmp_path, stream=out)["steps"] == 4
    assert "resuming from the checkpoint at step 2" in out.getvalue()


def test_after_a_blow_up_the_advice_to_resume_works(tmp_path):
    """lr 1e30 after a warmup step: the stop names the last healthy checkpoint, and the
    rerun it advises (that step, a lower learning rate) trains on."""
    from grpo_jax.core.errors import NonFiniteError
    from grpo_jax.run.train import train

    c = _config(6)
    c.rewards = "overlong(max_len=16,buffer=15):1.0"  # variance on an untrained model
    c.correct_reward = "overlong"
    c.sampling.max_new_tokens = 16
    c.checkpoint.every = 1
    c.checkpoint.keep = 10
    c.optim.learning_rate = 1e30
    c.optim.warmup_steps = 3  # update 0 has lr 0: step 1 is healthy, step 2 blows up
    c.train.max_nonfinite_in_row = 2
    with pytest.raises(NonFiniteError) as e:
        train(c, tmp_path, stream=io.StringIO())
    message = str(e.value)
    assert "steps after 1 were unhealthy" in message
    assert "--config.checkpoint.resume_from=1 --config.checkpoint.allow_changed_config=True" in (
        message
    )
    c.optim.learning_rate = 1e-4
    c.optim.warmup_steps = 0
    c.checkpoint.resume_from = 1
    c.checkpoint.allow_changed_config = True
    out = io.StringIO()
    summary = train(c, tmp_path, stream=out)
    assert summary["steps"] == 6
    assert "resuming with a changed config: optim.learning_rate: 1e+30 -> 0.0001" in (
        out.getvalue()
    )
    assert (tmp_path / "checkpoints.after-1").is_dir()  # the blown-up steps, kept aside
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert all(r["train/skipped_updates"] == 0 for r in records if r["step"] > 1)


def test_a_save_that_fails_is_one_clear_error_and_frees_the_workdir(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from grpo_jax.run.train import train
    from grpo_jax.run.workdir import WorkdirLock

    real = ocp.CheckpointManager.save

    def full_disk(self, step, *args, **kwargs):
        if step >= 2:
            raise ValueError(
                'RESOURCE_EXHAUSTED: Error writing "x": Failed to write 596 bytes to file 28: '
                "No space left on device [os_error_code='28']"
            )
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(CheckpointError) as e:
        train(_config(4), tmp_path, stream=io.StringIO())
    message = str(e.value)
    assert "saving the checkpoint of step 2" in message and "no space left on device" in message
    assert "no earlier one" in message  # checkpoint.every = 2: step 2 is the first
    assert "rerun the same command to resume" in message
    WorkdirLock(tmp_path).release()  # the failed run let go of the workdir


def test_a_save_that_fails_in_orbaxs_threads_is_one_line_and_loses_nothing(tmp_path):
    """A file size limit makes the writes of step 3's save fail in TensorStore's threads
    (EFBIG, as a full disk gives ENOSPC): the command used to print hundreds of lines with
    Orbax's tracebacks, and named the step after the one that failed. Now one line on
    stderr, exit status 2; the rerun resumes from step 2 and finishes."""
    import pathlib
    import subprocess
    import sys

    from grpo_jax.run.train import train

    c = _config(8)
    c.checkpoint.every = 1
    c.checkpoint.keep = 10
    c.train.steps = 2
    train(c, tmp_path, stream=io.StringIO())
    limited = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (12000, 12000)); "
        "sys.argv[0] = 'grpo_jax.main'; runpy.run_module('grpo_jax.main', run_name='__main__')"
    )
    flags = ["warm_start.enabled=False", "eval.num_samples=0", "eval.every=0"]
    flags += ["train.steps=8", "checkpoint.every=1", "checkpoint.keep=10"]
    done = subprocess.run(
        [sys.executable, "-c", limited, "--config=configs/default.py:smoke"]
        + [f"--workdir={tmp_path}"]
        + [f"--config.{f}" for f in flags],
        cwd=pathlib.Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    ck = tmp_path / "checkpoints"
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: saving the checkpoint of step 3 in {ck} failed: "), line
    assert line.endswith(
        "; the checkpoint of step 2 is intact. Fix the cause, then rerun the same command to resume"
    ), line
    c.train.steps = 8
    out = io.StringIO()
    assert train(c, tmp_path, stream=out)["steps"] == 8
    assert f"resuming from the checkpoint at step 2 in {ck}" in out.getvalue()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [0, *range(1, 9)]


def test_a_full_disk_under_the_metrics_is_one_user_error_and_the_rerun_resumes(
    tmp_path, monkeypatch
):
    """metrics.jsonl's write fails, and so does closing the writers after it: the first
    error is the one reported (the close used to replace it with a traceback)."""
    import errno

    from grpo_jax.core.errors import WorkdirWriteError
    from grpo_jax.run.train import train
    from grpo_jax.run.writers import MetricsWriter

    write, close = MetricsWriter.write, MetricsWriter.close

    def full_at_3(self, step, metrics):
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write(self, step, metrics)

    def full_close(self):
        close(self)
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(MetricsWriter, "write", full_at_3)
        m.setattr(MetricsWriter, "close", full_close)
        with pytest.raises(WorkdirWriteError) as e:
            train(_config(4), tmp_path, stream=io.StringIO())
    assert str(e.value) == (
        f"writing {tmp_path / 'metrics.jsonl'} failed: No space left on device; free disk "
        "space, then rerun the same command: it resumes from the newest checkpoint"
    )
    out = io.StringIO()
    assert train(_config(4), tmp_path, stream=out)["steps"] == 4
    assert "resuming from the checkpoint at step 2" in out.getvalue()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [0, 1, 2, 3, 4]


def test_a_kill_during_a_save_at_k1_resumes_with_the_alarms_of_the_whole_run(tmp_path, monkeypatch):
    """The alarms' state is in the checkpoint: after a kill while saving step 4 the rerun
    (from step 2) raises no alarm again that is still active (entropy, fired at step 1) and
    the one whose window spans the resume (truncation, steps 1-3) at the same step."""
    from grpo_jax.run.checkpoints import Checkpointer
    from grpo_jax.run.train import train
    from grpo_jax.run.writers import read_metrics

    c = _config(4)
    c.train.max_staleness = 1
    c.health.entropy_window = 1
    c.health.entropy_floor = 100.0  # fires at step 1 and stays active
    c.health.truncation_window = 3  # the untrained model's completions are mostly truncated
    train(c, tmp_path / "whole", stream=io.StringIO())

    class Kill(Exception):
        pass

    save = Checkpointer.save

    def killed_at_4(self, step, **kwargs):
        if step == 4:
            raise Kill
        return save(self, step, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "save", killed_at_4)
        with pytest.raises(Kill):
            train(c, tmp_path / "killed", stream=io.StringIO())
    train(c, tmp_path / "killed", stream=io.StringIO())

    whole = without_timings(read_metrics(tmp_path / "whole" / "metrics.jsonl"))
    resumed = without_timings(read_metrics(tmp_path / "killed" / "metrics.jsonl"))
    alarms = {r["step"]: sorted(k for k in r if k.startswith("alarms/")) for r in whole}
    assert {s: a for s, a in alarms.items() if a} == {
        1: ["alarms/entropy_collapse"],
        3: ["alarms/truncation"],
    }
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed == whole


def test_a_damaged_warm_start_cache_is_set_aside_and_trained_again(tmp_path):
    """A truncated file of the cache (Orbax cannot read it), then flipped bytes (only the
    checksums see them): each is one line, the cache is kept aside and the warm start
    trains again, as a first run would."""
    import shutil

    from grpo_jax.run.train import train

    c = _config(0)
    c.eval.at_start = False
    c.warm_start.enabled = True
    c.warm_start.min_steps = c.warm_start.max_steps = 2
    c.warm_start.eval_every = 2
    train(c, tmp_path, stream=io.StringIO())
    cache = tmp_path / "warm_start"
    for k, damage in enumerate(("truncate", "flip")):
        shutil.rmtree(tmp_path / "checkpoints")  # a fresh start, which reads the cache
        if damage == "flip":
            flip_bytes(cache, "params")
        else:
            data = max((cache / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        out = io.StringIO()
        summary = train(c, tmp_path, stream=out)
        said = [line for line in out.getvalue().splitlines() if "warm start cache" in line]
        aside = cache.with_name("warm_start.unrestorable" + (f".{k}" if k else ""))
        assert len(said) == 1 and said[0].startswith(f"the warm start cache in {cache}"), said
        assert said[0].endswith(f"; set aside in {aside}, training the warm start again")
        why = "differs from the checksum saved with it" if k else "could not be restored (Value"
        assert why in said[0], said[0]
        assert (aside / "params").is_dir() and (aside / "info.json").is_file()
        assert "warm start step 2:" in out.getvalue() and summary["warm_start"]["steps"] == 2
        assert (cache / "info.json").is_file()  # cached anew


def _as_written_before_the_run_state(step_dir) -> dict:
    """Rewrites a checkpoint's meta in the layout grpo_jax wrote before each part of the
    run's state saved itself under its own name: the reporter's and the schedule's
    counters as top-level keys, the checksum of the meta recomputed. Returns them."""
    from grpo_jax.core import integrity

    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    record = meta.pop("integrity")
    report, schedule = meta.pop("report"), meta.pop("schedule")
    earlier = {
        "no_signal_run": report["no_signal_run"],
        "sampled_tokens": schedule["sampled_tokens"],
        "wall_seconds": schedule["wall_seconds"],
    }
    meta.update(earlier)
    record["meta"] = integrity.json_digest(meta)
    path.write_text(json.dumps({**meta, "integrity": record}))
    return earlier


def test_a_checkpoint_in_the_earlier_layout_resumes_exactly(tmp_path):
    """A checkpoint saved before the run's state was one mechanism resumes as it would
    have: the completion tokens sampled (each record's running total) and the wall time
    carry on from its top-level keys."""
    from helpers_resume import train_killed_at

    from grpo_jax.run.train import train
    from grpo_jax.run.writers import read_metrics

    c = _config(4)
    train(c, tmp_path / "whole", stream=io.StringIO())
    train_killed_at(c, tmp_path / "killed", 3, stream=io.StringIO())
    earlier = _as_written_before_the_run_state(tmp_path / "killed" / "checkpoints" / "2")
    assert earlier["sampled_tokens"] > 0 and earlier["wall_seconds"] > 0
    out = io.StringIO()
    summary = train(c, tmp_path / "killed", stream=out)
    assert "resuming from the checkpoint at step 2" in out.getvalue()
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    assert summary["wall_seconds"] > earlier["wall_seconds"]
