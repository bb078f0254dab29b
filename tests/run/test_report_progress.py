"""The run's console is never silent for long: PulsedProgress's pulses between lines, and the
line that says the first GRPO step compiles first (grpo_jax/run/report.py)."""

import io
import threading
import time
from types import SimpleNamespace

from helpers_config import Console

from grpo_jax.run.config import GRPOConfig, HealthConfig, TeacherConfig, TrainConfig
from grpo_jax.run.report import PULSE_S, PulsedProgress, Reporter

_SECTIONS = dict(teacher=TeacherConfig(), grpo=GRPOConfig())  # what Reporter reads besides


def _pulses():
    return [t for t in threading.enumerate() if t.name == "progress-pulse"]


def test_a_silence_of_pulse_s_seconds_prints_one_line_and_a_line_resets_it():
    out = io.StringIO()
    p = PulsedProgress(10, stream=out, pulse_s=12.0)
    p.close()  # the test ticks the clock itself
    p.message("warm start: compiling")
    t0 = time.monotonic()  # at or after the line
    p.tick(t0 + 5.0)
    p.tick(t0 + 11.5)
    assert out.getvalue() == "warm start: compiling\n"
    p.tick(t0 + 12.0)
    p.tick(t0 + 13.0)  # one pulse per pulse_s of silence
    p.tick(t0 + 24.2)
    assert out.getvalue().splitlines()[1:] == [
        "  ... still working (12 s since the last line)",
        "  ... still working (24 s since the last line)",
    ]
    p.update(1, {})
    t1 = time.monotonic()
    p.tick(t1 + 11.0)
    assert out.getvalue().splitlines()[-1].startswith("step 1/10")


def test_the_pulse_thread_ends_with_the_line_and_a_disabled_line_has_none():
    before = set(_pulses())
    PulsedProgress(10, stream=io.StringIO(), enabled=False)
    assert not set(_pulses()) - before
    p = PulsedProgress(10, stream=io.StringIO())
    (thread,) = set(_pulses()) - before
    p.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert PULSE_S <= 15  # no phase of a run is silent for longer


def test_the_reporter_says_the_first_step_compiles_first():
    console = Console()
    said = console.said
    records = SimpleNamespace(progress=console)
    run = SimpleNamespace(train=TrainConfig(steps=5), health=HealthConfig(), **_SECTIONS)
    Reporter(run, records).begin(2)
    assert said == ["GRPO from step 3: compiling the sampler and the update first"]
    Reporter(run, records).begin(5)  # nothing left to run: nothing to say
    assert len(said) == 1


def test_a_loud_warning_shows_once_on_a_console_and_is_logged_where_there_is_none(caplog):
    from grpo_jax.run.writers import ProgressLine

    run = SimpleNamespace(train=TrainConfig(steps=0), health=HealthConfig(), **_SECTIONS)
    for enabled in (True, False):
        out = io.StringIO()
        records = SimpleNamespace(progress=ProgressLine(3, stream=out, enabled=enabled))
        caplog.clear()
        with caplog.at_level("WARNING", logger="grpo_jax.run.report"):
            Reporter(run, records).loud("step 4: the policy moved too far")
        bar = "!" * 78
        if enabled:  # the banner alone: no second copy through logging
            assert out.getvalue() == f"{bar}\nWARNING: step 4: the policy moved too far\n{bar}\n"
            assert not caplog.records
        else:  # another host: no console line, so the log has it
            assert out.getvalue() == ""
            assert [r.getMessage() for r in caplog.records] == ["step 4: the policy moved too far"]
