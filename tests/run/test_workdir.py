"""One run per workdir, and fresh starts whose logs never mix with an earlier attempt's."""

import io
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from configs.default import get_config
from grpo_jax.run.workdir import WorkdirBusyError, WorkdirLock, set_aside

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Stop(Exception):
    pass


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_set_aside_keeps_every_earlier_file(tmp_path):
    p = tmp_path / "metrics.jsonl"
    assert set_aside(p) is None  # nothing there
    p.write_text("")
    assert set_aside(p) is None and p.exists()  # empty: nothing to keep
    p.write_text("a\n")
    assert set_aside(p) == tmp_path / "metrics.jsonl.old-1" and not p.exists()
    p.write_text("b\n")
    assert set_aside(p) == tmp_path / "metrics.jsonl.old-2"
    assert (tmp_path / "metrics.jsonl.old-1").read_text() == "a\n"


def test_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    lock = WorkdirLock(tmp_path)
    with pytest.raises(WorkdirBusyError, match=f"in use by another run \\(pid {os.getpid()} "):
        WorkdirLock(tmp_path)
    lock.release()
    WorkdirLock(tmp_path).release()  # free again once released


def test_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
    """The lock on the directory holds while the file is gone (both runs used to go on,
    and then both failed their saves)."""
    lock = WorkdirLock(tmp_path)
    (tmp_path / ".lock").unlink()
    with pytest.raises(WorkdirBusyError, match=r"in use by another run \(its .lock file was del"):
        WorkdirLock(tmp_path)
    lock.release()
    WorkdirLock(tmp_path).release()


def test_a_workdir_that_cannot_be_written_is_one_line_and_a_user_error(tmp_path, monkeypatch):
    """A read-only workdir was a traceback (OSError: [Errno 30] on .lock) and exit status 1."""
    import errno
    import io

    from grpo_jax import cli
    from grpo_jax.run import workdir

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(workdir.os, "open", read_only)
    with pytest.raises(cli.user_errors()) as e:
        WorkdirLock(tmp_path)
    err = io.StringIO()
    assert cli.report_error(e.value, stream=err) == 2
    assert err.getvalue() == (
        f"error: workdir {tmp_path} cannot be written (Read-only file system: "
        f"{tmp_path / '.lock'}); choose another --workdir, or make this one writable\n"
    )


def test_a_killed_run_leaves_no_stuck_lock(tmp_path):
    code = (
        "import sys, time; from grpo_jax.run.workdir import WorkdirLock; "
        f"WorkdirLock({str(tmp_path)!r}); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"locked"
        with pytest.raises(WorkdirBusyError, match=f"pid {proc.pid} "):
            WorkdirLock(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    WorkdirLock(tmp_path).release()


def _compiles_logged(cache: pathlib.Path, code: list[str], cwd):
    """Runs ``python <code>`` with JAX's persistent compilation cache in ``cache``, every
    program written there: (the finished process, the entries it left)."""
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    # A hang guard only: the refusal comes before any model is built or compiled.
    proc = subprocess.run(
        [sys.executable, *code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    return proc, sorted(cache.iterdir()) if cache.exists() else []


@pytest.mark.slow
def test_second_run_on_a_busy_workdir_refuses_at_once(tmp_path):
    """The refusal comes before any work: one line naming the holder, nothing written to
    the workdir (no config, tokenizer, checkpoints or records) and nothing compiled."""
    workdir, cache = tmp_path / "run", tmp_path / "jax_cache"
    lock = WorkdirLock(workdir)  # a run in progress
    try:
        cmd = ["-m", "grpo_jax.main", "--config=configs/default.py:smoke", f"--workdir={workdir}"]
        proc, compiled = _compiles_logged(cache, cmd, ROOT)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"is in use by another run (pid {os.getpid()} " in proc.stderr
    assert sorted(p.name for p in workdir.iterdir()) == [".lock"]  # the holder's own file
    assert compiled == []
    # The probe sees a compilation where there is one.
    _, compiled = _compiles_logged(cache, ["-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"], ROOT)
    assert compiled


@pytest.mark.slow
def test_a_fresh_start_sets_the_earlier_attempts_records_aside(tmp_path):
    """Killed before its first checkpoint, the rerun starts afresh: no step is logged twice."""
    from grpo_jax.run.train import train

    c = get_config("smoke")
    c.warm_start.enabled = False
    c.eval.every = 0
    c.eval.num_samples = 0
    c.train.steps = 3
    c.checkpoint.every = 50

    def stop_at_2(step):
        if step == 2:
            raise _Stop

    with pytest.raises(_Stop):
        train(c, tmp_path, step_callback=stop_at_2, stream=io.StringIO())
    assert not (tmp_path / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (tmp_path / "checkpoints").iterdir()
    )
    first = _steps(tmp_path / "metrics.jsonl")
    out = io.StringIO()
    train(c, tmp_path, stream=out)
    steps = _steps(tmp_path / "metrics.jsonl")
    assert len(steps) == len(set(steps)) and sorted(steps) == [0, 1, 2, 3]
    assert _steps(tmp_path / "metrics.jsonl.old-1") == first
    assert "records are kept as" in out.getvalue()
    # Deleting the checkpoints starts afresh too: the finished run's records go aside.
    import shutil

    shutil.rmtree(tmp_path / "checkpoints")
    train(c, tmp_path, stream=io.StringIO())
    assert sorted(_steps(tmp_path / "metrics.jsonl")) == [0, 1, 2, 3]
    assert sorted(_steps(tmp_path / "metrics.jsonl.old-2")) == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_warm_start_trained_anew_begins_its_log_anew(tmp_path):
    from grpo_jax.run.train import train

    log = tmp_path / "warm_start" / "metrics.jsonl"
    log.parent.mkdir()
    log.write_text('{"step": 2, "sft/loss": 9.0}\n')  # an interrupted earlier warm start
    c = get_config("smoke")
    c.train.steps = 0
    c.eval.at_start = False
    c.warm_start.min_steps = c.warm_start.max_steps = 4
    c.warm_start.eval_every = 2
    train(c, tmp_path, stream=io.StringIO())
    assert _steps(log) == [2, 4]  # this warm start's validations only
    assert _steps(log.with_name("metrics.jsonl.old-1")) == [2]
