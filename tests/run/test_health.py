"""Training-health alarms: each rule on a synthetic history, quiet on a healthy run."""

import dataclasses
import json
import pathlib
import types

import numpy as np
import pytest

from grpo_jax.run.config import ConfigError, HealthConfig, parse_config
from grpo_jax.run.health import ALARMS, KEYS, LEARNED_KEYS, Alarm, diagnose, history_needed

DATA = pathlib.Path(__file__).parents[1] / "fixtures" / "default_run_metrics.jsonl"
CFG = HealthConfig()


def _healthy(n, **overrides):
    """n steady records (step 1..n); ``overrides`` maps a key to a function of the step."""
    out = []
    for s in range(1, n + 1):
        r = {
            "step": s,
            "train/entropy": 0.6,
            "rollout/length_mean": 100.0,
            "rollout/truncated_frac": 0.01,
            "train/clip_frac_low": 0.01,
            "train/clip_frac_high": 0.01,
            "train/ratio_max": 1.5,
            "rollout/frac_zero_var_groups": 0.2,
            "rewards/mean": 0.5,
            "policy/abs_log_ratio_mean": 0.04,
        }
        for k, f in overrides.items():
            r[k] = f(s)
        out.append(r)
    return out


def _only(alarms, name):
    assert [a.name for a in alarms] == [name], alarms
    assert alarms[0].name in ALARMS
    return alarms[0]


def test_steady_history_is_quiet_at_every_length():
    h = _healthy(120, **{"train/kl": lambda s: 0.01})
    for i in range(len(h) + 1):
        assert diagnose(h[:i], CFG) == []


def test_missing_and_odd_values_never_raise():
    assert diagnose([], CFG) == []
    assert diagnose([{}], CFG) == []
    odd = [{"step": s, "train/entropy": float("nan"), "rewards/mean": None} for s in range(60)]
    odd += [{"eval/pass_at_1": 0.1}, {"eval/pass_at_1": "x", "step": 3}]
    assert diagnose(odd, CFG) == []


def test_entropy_collapse_relative_to_early_level():
    h = _healthy(30, **{"train/entropy": lambda s: 0.6 if s <= 20 else 0.1})
    a = _only(diagnose(h, CFG), "entropy_collapse")
    assert a.step == 30 and "0.1" in a.message and "0.6" in a.message and "0.2" in a.message


def test_entropy_collapse_below_the_floor():
    h = _healthy(5, **{"train/entropy": lambda s: 0.005})
    a = _only(diagnose(h, CFG), "entropy_collapse")
    assert "0.005" in a.message and "entropy_floor 0.01" in a.message


def test_length_blowup_and_collapse():
    h = _healthy(40, **{"rollout/length_mean": lambda s: 100.0 if s <= 30 else 300.0})
    a = _only(diagnose(h, CFG), "length_blowup")
    assert "300" in a.message and "100" in a.message and "3x" in a.message
    h = _healthy(40, **{"rollout/length_mean": lambda s: 100.0 if s <= 30 else 20.0})
    a = _only(diagnose(h, CFG), "length_collapse")
    assert "20" in a.message and "0.2x" in a.message


def test_truncation_rate():
    h = _healthy(10, **{"rollout/truncated_frac": lambda s: 0.5 if s > 5 else 0.0})
    a = _only(diagnose(h, CFG), "truncation")
    assert "0.5" in a.message and "0.25" in a.message


def test_clip_fraction_spike():
    h = _healthy(3, **{"train/clip_frac_high": lambda s: 0.3 if s == 3 else 0.01})
    a = _only(diagnose(h, CFG), "clip_frac_spike")
    assert "0.31" in a.message and "0.2" in a.message


def test_ratio_spike():
    h = _healthy(3, **{"train/ratio_max": lambda s: 42.0 if s == 3 else 1.2})
    a = _only(diagnose(h, CFG), "ratio_spike")
    assert "42" in a.message and "10" in a.message


def test_kl_spike_only_with_a_kl_penalty():
    h = _healthy(25, **{"train/kl": lambda s: 0.2 if s == 25 else 0.01})
    a = _only(diagnose(h, CFG), "kl_spike")
    assert "0.2" in a.message and "0.01" in a.message
    # beta = 0: train/kl is 0 or absent, whatever came before.
    h[-1]["train/kl"] = 0.0
    assert diagnose(h, CFG) == []
    del h[-1]["train/kl"]
    assert diagnose(h, CFG) == []


def test_zero_variance_groups_for_many_steps():
    h = _healthy(30, **{"rollout/frac_zero_var_groups": lambda s: 0.95 if s > 10 else 0.2})
    a = _only(diagnose(h, CFG), "zero_var_groups")
    assert "0.95" in a.message and "20 steps" in a.message
    h[15]["rollout/frac_zero_var_groups"] = 0.5  # one step with signal breaks the run
    assert diagnose(h, CFG) == []


def test_reward_rising_while_held_out_pass_falls():
    h = _healthy(100, **{"rewards/mean": lambda s: 0.3 if s <= 50 else 0.8})
    h[49]["eval/pass_at_1"] = 0.6
    h[99]["eval/pass_at_1"] = 0.4
    a = _only(diagnose(h, CFG), "reward_vs_eval")
    assert "0.3 -> 0.8" in a.message and "0.6 -> 0.4" in a.message and "50 -> 100" in a.message
    h[99]["eval/pass_at_1"] = 0.7  # both rose: healthy
    assert diagnose(h, CFG) == []


@pytest.mark.parametrize(
    "key,name",
    [
        ("policy/abs_log_ratio_mean", "logp_mismatch_policy"),
        ("behavior/abs_log_diff_mean", "logp_mismatch_behavior"),
    ],
)
def test_log_prob_mismatch_growing(key, name):
    h = _healthy(60, **{key: lambda s: 0.04 if s <= 50 else 0.3})
    a = _only(diagnose(h, CFG), name)
    assert key in a.message and "0.3" in a.message and "0.04" in a.message


def test_alarm_is_frozen_and_history_needed_covers_the_windows():
    a = Alarm("ratio_spike", 3, "m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step = 4
    assert history_needed(CFG) > CFG.mismatch_window + CFG.mismatch_baseline


def test_config_section_is_validated():
    from configs.default import get_config

    c = get_config("smoke").to_dict()
    run = parse_config(c)
    assert run.health == HealthConfig()
    c["health"]["zero_var_steps"] = 0
    with pytest.raises(ConfigError, match="health.zero_var_steps"):
        parse_config(c)
    c["health"]["zero_var_steps"] = 20
    c["health"]["stop_on_alarm"] = "yes"
    with pytest.raises(ConfigError, match="health.stop_on_alarm"):
        parse_config(c)
    del c["health"]["stop_on_alarm"]
    c["health"]["entropy_flor"] = 0.1
    with pytest.raises(ConfigError, match="health.entropy_flor"):
        parse_config(c)


def test_healthy_default_run_is_quiet_on_every_prefix():
    """200 GRPO steps of the CPU default config (a healthy run), reduced to the keys read."""
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(records) > 150
    for i in range(1, len(records) + 1):
        assert diagnose(records[:i], CFG) == [], records[i - 1]["step"]


@pytest.mark.slow
def test_alarm_stops_a_run_with_a_checkpoint(tmp_path):
    """An entropy floor above the real entropy fires at step 1; the run stops there with the
    checkpoint of step 1 (it used to be step 2's, one update past the alarm), says what
    fired, and a rerun refuses to train past it until told to."""
    import io

    from configs.default import get_config
    from grpo_jax.core.errors import AlarmStop
    from grpo_jax.run.checkpoints import Checkpointer
    from grpo_jax.run.train import train
    from grpo_jax.run.writers import read_metrics

    c = get_config("smoke")
    c.warm_start.enabled = False
    c.eval.num_samples = 0
    c.eval.every = 0
    c.train.steps = 6
    c.checkpoint.every = 0
    c.health.stop_on_alarm = True
    c.health.entropy_window = 1
    c.health.entropy_floor = 100.0
    stream = io.StringIO()
    with pytest.raises(AlarmStop) as e:
        train(c, tmp_path, stream=stream)
    stop = str(e.value)
    assert "\n" not in stop and "preempted" not in stream.getvalue()
    assert stop.startswith("health alarm entropy_collapse at step 1: train/entropy ")
    assert "< health.entropy_floor 100.0 (health.stop_on_alarm)" in stop
    assert "checkpoint of step 1" in stop  # the alarm's own step (it was the step after)
    assert "--config.health.resume_after_stop=True" in stop
    # The loud line on the progress output: the bar, the rule, the step's numbers.
    shown = stream.getvalue()
    assert "!" * 78 + "\nWARNING: health alarm entropy_collapse: step 1: train/entropy " in shown
    assert "< health.entropy_floor 100.0 (health.stop_on_alarm: saving a checkpoint" in shown
    ck = Checkpointer(tmp_path / "checkpoints")
    try:
        assert ck.all_steps() == [1]
    finally:
        ck.close()
    records = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert records[1]["alarms/entropy_collapse"] == 1.0
    # Every key the rules read is written by a real step (the KL only with beta > 0,
    # the held-out pass@1 only on evaluation steps, a learned reward only with a reward
    # model or judge), so no rule watches a missing key.
    unwritten = set(KEYS) - set(records[1]) - {"train/kl", "eval/pass_at_1", *LEARNED_KEYS}
    assert not unwritten, unwritten
    assert max(records) == 1  # no step trained past the alarm
    text = (tmp_path / "samples" / "alarm_entropy_collapse_step_0000001.txt").read_text()
    assert "entropy_floor 100.0" in text and "[completion]" in text

    # The same command again: one line, nothing trained or written.
    written = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(AlarmStop) as e:
        train(c, tmp_path, stream=io.StringIO())
    again = str(e.value)
    assert "\n" not in again and "entropy_collapse" in again and "step 1" in again
    assert "--config.health.resume_after_stop=True" in again
    assert (tmp_path / "metrics.jsonl").read_text() == written

    # The override continues from step 1; the alarm, still active, is not raised again.
    c.health.resume_after_stop = True
    c.train.steps = 4
    out = io.StringIO()
    assert train(c, tmp_path, stream=out)["steps"] == 4
    assert "resuming past the stop by health alarm entropy_collapse" in out.getvalue()
    assert "resuming from the checkpoint at step 1" in out.getvalue()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in records if any(k.startswith("alarms/") for k in r)] == [1]


@pytest.mark.slow
def test_the_command_exits_4_on_an_alarm_stop_and_on_its_rerun(tmp_path):
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "grpo_jax.main",
        "--config=configs/default.py:smoke",
        f"--workdir={tmp_path}",
        "--config.warm_start.enabled=False",
        "--config.eval.at_start=False",
        "--config.eval.every=0",
        "--config.health.stop_on_alarm=True",
        "--config.health.entropy_window=1",
        "--config.health.entropy_floor=100",
    ]
    for first_words in ("stopped: health alarm entropy_collapse", "stopped: the run in"):
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
        assert p.returncode == 4, p.stderr[-2000:]
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith(first_words), p.stderr[-2000:]
        assert "--config.health.resume_after_stop=True" in last


def _reporter(health_state=None, **health):
    from types import SimpleNamespace

    from grpo_jax.run.config import GRPOConfig, TeacherConfig, TrainConfig
    from grpo_jax.run.report import Reporter

    run = SimpleNamespace(
        train=TrainConfig(), health=HealthConfig(**health), teacher=TeacherConfig(),
        grpo=GRPOConfig(),
    )  # fmt: skip
    rep = Reporter(run, SimpleNamespace())
    if health_state is not None:
        rep.alarms.load_state_dict(health_state)
    return rep


def test_reporter_fires_an_alarm_when_it_starts_and_after_a_quiet_spell():
    rep = _reporter(rearm_steps=2)
    ratio = {1: 50, 2: 50, 3: 50, 6: 50, 7: 50, 11: 50}  # quiet 4-5 (2 steps), 8-10 (3)
    fired = {
        s: [a.name for a in rep.alarms.check(s, {"train/ratio_max": ratio.get(s, 1.0)})]
        for s in range(1, 12)
    }
    assert [s for s, names in fired.items() if names] == [1, 11]
    assert fired[11] == ["ratio_spike"]


def test_reporter_history_keeps_the_early_entropy_level():
    rep = _reporter()
    fired = []
    for s in range(1, 301):  # entropy decays to a tenth of its start, far past the window
        fired += rep.alarms.check(s, {"train/entropy": 0.6 * (1 - 0.9 * s / 300)})
    assert [a.name for a in fired] == ["entropy_collapse"]
    assert len(rep.alarms._recent) < 100


def test_reporter_alarm_state_survives_a_checkpoint():
    """A reporter whose alarms load another's ``state_dict()`` (JSON, as a checkpoint holds it)
    fires what the uninterrupted one fires: the windows, the early entropy level and the
    rearm rule carry over."""

    def record(s):
        return {
            "train/entropy": 1.0 if s <= 4 else 0.3 if s <= 8 else 0.15,
            "rollout/truncated_frac": 0.5 if s >= 3 else float("nan") if s == 1 else 0.0,
            "train/ratio_max": 50.0 if s in (2, 3, 4, 7) else 1.0,
        }

    cfg = {"rearm_steps": 3, "truncation_window": 3}
    whole = _reporter(**cfg)
    fired = {s: [a.name for a in whole.alarms.check(s, record(s))] for s in range(1, 15)}
    assert {s: n for s, n in fired.items() if n} == {
        2: ["ratio_spike"],
        4: ["truncation"],
        13: ["entropy_collapse"],
    }
    first = _reporter(**cfg)
    for s in range(1, 5):
        first.alarms.check(s, record(s))
    state = json.loads(json.dumps(first.alarms.state_dict(), allow_nan=False))
    resumed = _reporter(state, **cfg)
    assert {s: [a.name for a in resumed.alarms.check(s, record(s))] for s in range(5, 15)} == {
        s: fired[s] for s in range(5, 15)
    }


@pytest.mark.slow
def test_the_smoke_config_runs_clean(tmp_path, caplog):
    """configs/default.py:smoke as shipped, run past the alarms' shortest windows: its warm
    start does what it sets out to do and no alarm or warning is raised."""
    import io
    import logging

    from configs.default import get_config
    from grpo_jax.run.train import train

    c = get_config("smoke")
    c.train.steps = 6  # > health.truncation_window and entropy_window
    stream = io.StringIO()
    with caplog.at_level(logging.WARNING):
        summary = train(c, tmp_path, stream=stream)
    assert summary["warm_start"]["reached_target"]
    assert "WARNING" not in stream.getvalue(), stream.getvalue()
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("grpo_jax")]


def _hacking_history(n, learned, check, key="rewards/reward_model/mean"):
    return _healthy(n, **{key: learned, "rollout/pass_rate": check})


def test_reward_hacking_fires_when_the_learned_reward_rises_and_the_check_does_not():
    assert CFG.hack_window == 40  # the halves below are 20 steps each
    rising = lambda s: 0.01 * s  # +0.2 between the window's halves
    # The check falls: fires, naming both numbers.
    alarm = _only(
        diagnose(_hacking_history(80, rising, lambda s: 0.6 - 0.0025 * s), CFG), "reward_hacking"
    )
    assert "rewards/reward_model/mean rose by 0.2" in alarm.message
    assert "rollout/pass_rate changed by -0.05" in alarm.message
    # The check stays flat: fires too; the judge's reward is watched as well.
    flat = lambda s: 0.5
    assert _only(diagnose(_hacking_history(80, rising, flat), CFG), "reward_hacking")
    judged = _hacking_history(80, rising, flat, key="rewards/judge/mean")
    assert "rewards/judge/mean" in _only(diagnose(judged, CFG), "reward_hacking").message


def test_reward_hacking_quiet_when_the_check_rises_too_or_the_reward_is_flat():
    rising = lambda s: 0.01 * s
    assert diagnose(_hacking_history(80, rising, lambda s: 0.2 + 0.005 * s), CFG) == []
    assert diagnose(_hacking_history(80, lambda s: 1.0, lambda s: 0.6 - 0.0025 * s), CFG) == []
    # Fewer records than the window, or no learned reward at all: quiet.
    assert diagnose(_hacking_history(CFG.hack_window - 1, rising, lambda s: 0.5), CFG) == []
    assert diagnose(_healthy(80, **{"rollout/pass_rate": lambda s: 0.5}), CFG) == []
    # A second reward as the check (health.hack_check).
    cfg = HealthConfig(hack_check="rewards/exact_match/mean")
    h = _healthy(
        80, **{"rewards/reward_model/mean": rising, "rewards/exact_match/mean": lambda s: 0.4}
    )
    assert _only(diagnose(h, cfg), "reward_hacking")


def test_reward_hacking_needs_a_rise_beyond_the_learned_rewards_own_noise():
    """A rise of 0.11 (above hack_rise_min) made of step-to-step noise of sd 0.15 is no alarm;
    the same noise around a rise of 0.6 is. The z-test is what tells them apart: with
    hack_rise_z = 0 the noisy one fires too (the false alarms of docs/learned_rewards.md's
    weight sweep, replayed there)."""
    cfg = HealthConfig(hack_window=20)  # the window of the weight sweep's runs
    noise = np.random.default_rng(0).normal(0.0, 0.15, 20)
    # Each half of the 20-step window centred, so the halves' means are exactly 0.11 apart.
    base = np.concatenate([noise[:10] - noise[:10].mean(), noise[10:] - noise[10:].mean()])
    noisy = lambda s: -8.5 + base[s - 1] + (0.11 if s > 10 else 0.0)
    flat = lambda s: 0.4
    h = _hacking_history(20, noisy, flat)
    assert diagnose(h, cfg) == []
    assert _only(diagnose(h, HealthConfig(hack_window=20, hack_rise_z=0.0)), "reward_hacking")
    climbing = lambda s: -8.5 + base[s - 1] + 0.06 * s
    alarm = _only(diagnose(_hacking_history(20, climbing, flat), cfg), "reward_hacking")
    assert "standard errors > health.hack_rise_z 3.0" in alarm.message


@pytest.mark.parametrize("window", [2, 3])
def test_a_hack_window_too_short_for_two_halves_is_refused(window):
    with pytest.raises(ConfigError, match=f"'health.hack_window' = {window} must be >= 4: each"):
        HealthConfig(hack_window=window)
    assert HealthConfig(hack_window=4).hack_window == 4
    # Four steps: halves of two, each with a spread; the alarm can fire.
    h = _hacking_history(4, lambda s: 0.1 * s + 0.01 * (s % 2), lambda s: 0.5)
    assert _only(diagnose(h, HealthConfig(hack_window=4, hack_rise_z=0.0)), "reward_hacking")


@pytest.mark.parametrize("key", ["length_baseline", "kl_window", "mismatch_baseline"])
def test_an_empty_baseline_is_refused(key):
    with pytest.raises(ConfigError, match=f"'health.{key}' = 0 must be >= 1"):
        HealthConfig(**{key: 0})


def test_diagnose_never_raises_even_on_windows_it_would_refuse():
    """Windows that HealthConfig refuses (too short to have a spread or a baseline) still
    leave diagnose quiet rather than raising: the module's promise holds for any settings."""
    fields = {f.name: getattr(CFG, f.name) for f in dataclasses.fields(HealthConfig)}
    rising = lambda s: 0.01 * s + 0.001 * (s % 3)
    h = _healthy(
        60,
        **{
            "rewards/reward_model/mean": rising,
            "rollout/pass_rate": lambda s: 0.5,
            "train/kl": lambda s: 0.01,
            "behavior/abs_log_diff_mean": lambda s: 0.1,
        },
    )
    for bad in (
        {"hack_window": 2},
        {"hack_window": 3},
        {"hack_window": 1},
        {"length_baseline": 0},
        {"kl_window": 0},
        {"mismatch_baseline": 0},
    ):
        cfg = types.SimpleNamespace(**{**fields, **bad})
        for i in range(len(h) + 1):
            diagnose(h[:i], cfg)
