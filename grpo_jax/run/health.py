"""Training-health alarms: what in a run's recent metrics says it is going wrong.

    alarms = diagnose(history, cfg)   # cfg: HealthConfig (the health section)

Each rule compares a few keys of the recent records with the thresholds and windows of
``HealthConfig``, whose defaults keep a healthy run quiet. The rules with their defaults are
README.md's "Health alarms"; how the reporter raises, re-arms and stops on them,
docs/architecture.md's "Reporter and Schedule".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from grpo_jax.core.checks import check_bool, check_range
from grpo_jax.core.errors import ConfigError

# Name of each rule's alarm, in the order diagnose checks them.
ALARMS = (
    "entropy_collapse",
    "length_blowup",
    "length_collapse",
    "truncation",
    "clip_frac_spike",
    "ratio_spike",
    "kl_spike",
    "zero_var_groups",
    "reward_vs_eval",
    "reward_hacking",
    "logp_mismatch_policy",
    "logp_mismatch_behavior",
)

# The metrics diagnose reads.
KEYS = (
    "step",
    "train/entropy",
    "rollout/length_mean",
    "rollout/truncated_frac",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/ratio_max",
    "train/kl",
    "rollout/frac_zero_var_groups",
    "rewards/mean",
    "eval/pass_at_1",
    "policy/abs_log_ratio_mean",
    "behavior/abs_log_diff_mean",
    "rewards/reward_model/mean",
    "rewards/judge/mean",
)
LEARNED_KEYS = ("rewards/reward_model/mean", "rewards/judge/mean")
# reward_hacking compares the two halves of its window and needs a spread in each.
HACK_WINDOW_MIN = 4


@dataclasses.dataclass(frozen=True)
class Alarm:
    """One rule set off: its ``name`` (``ALARMS``), the step and a message with the numbers."""

    name: str
    step: int
    message: str


def _num(record: Mapping, key: str) -> float | None:
    v = record.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _series(history: Sequence[Mapping], key: str) -> list[float]:
    """The finite values of ``key``, oldest first (records without it are skipped)."""
    return [v for r in history if (v := _num(r, key)) is not None]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _entropy(h, cfg, out):
    xs = _series(h, "train/entropy")
    n = cfg.entropy_window
    if len(xs) < n:
        return
    now = _mean(xs[-n:])
    if now < cfg.entropy_floor:
        out(
            "entropy_collapse",
            f"train/entropy {now:.4g} < health.entropy_floor {cfg.entropy_floor}",
        )
        return
    if len(xs) < 2 * n:
        return
    early = _mean(xs[:n])
    if now < cfg.entropy_frac * early:
        out(
            "entropy_collapse",
            f"train/entropy {now:.4g} (mean of the last {n} steps) < health.entropy_frac "
            f"{cfg.entropy_frac} x its early level {early:.4g}",
        )


def _length(h, cfg, out):
    xs = _series(h, "rollout/length_mean")
    n, b = cfg.length_window, cfg.length_baseline
    if b < 1 or len(xs) < n + b:
        return
    now, before = _mean(xs[-n:]), _mean(xs[-n - b : -n])
    if before <= 0:
        return
    ratio = now / before
    text = (
        f"rollout/length_mean {now:.4g} (last {n} steps) is {ratio:.3g}x its level "
        f"{before:.4g} over the {b} steps before"
    )
    if ratio > cfg.length_blowup:
        out("length_blowup", f"{text} (> health.length_blowup {cfg.length_blowup})")
    elif ratio < cfg.length_collapse:
        out("length_collapse", f"{text} (< health.length_collapse {cfg.length_collapse})")


def _truncation(h, cfg, out):
    xs = _series(h, "rollout/truncated_frac")
    n = cfg.truncation_window
    if len(xs) < n:
        return
    now = _mean(xs[-n:])
    if now > cfg.truncation_max:
        out(
            "truncation",
            f"rollout/truncated_frac {now:.4g} (mean of the last {n} steps) > "
            f"health.truncation_max {cfg.truncation_max}",
        )


def _spikes(h, cfg, out):
    last = h[-1]
    lo, hi = _num(last, "train/clip_frac_low"), _num(last, "train/clip_frac_high")
    if lo is not None or hi is not None:
        clip = (lo or 0.0) + (hi or 0.0)
        if clip > cfg.clip_frac_max:
            out(
                "clip_frac_spike",
                f"train/clip_frac_low + clip_frac_high = {lo or 0.0:.4g} + {hi or 0.0:.4g} = "
                f"{clip:.4g} > health.clip_frac_max {cfg.clip_frac_max}",
            )
    ratio = _num(last, "train/ratio_max")
    if ratio is not None and ratio > cfg.ratio_max:
        out("ratio_spike", f"train/ratio_max {ratio:.4g} > health.ratio_max {cfg.ratio_max}")


def _kl(h, cfg, out):
    now = _num(h[-1], "train/kl")
    if not now:  # absent or 0: no KL penalty (grpo.beta = 0)
        return
    if cfg.kl_window < 1:  # no steps to compare with ([-0:] would take them all)
        return
    before = _series(h[:-1], "train/kl")[-cfg.kl_window :]
    if len(before) < cfg.kl_window:
        return
    med = statistics.median(before)
    if now > cfg.kl_min and now > cfg.kl_spike_factor * med:
        out(
            "kl_spike",
            f"train/kl {now:.4g} > health.kl_spike_factor {cfg.kl_spike_factor} x its median "
            f"{med:.4g} over the {cfg.kl_window} steps before",
        )


def _zero_var(h, cfg, out):
    n = cfg.zero_var_steps
    if len(h) < n:
        return
    xs = [_num(r, "rollout/frac_zero_var_groups") for r in h[-n:]]
    if all(x is not None and x >= cfg.zero_var_max for x in xs):
        out(
            "zero_var_groups",
            f"rollout/frac_zero_var_groups >= health.zero_var_max {cfg.zero_var_max} for "
            f"{n} steps (min {min(xs):.4g}, now {xs[-1]:.4g}): few groups carry a learning signal",
        )


def _reward_at(h, step: int, window: int) -> float | None:
    xs = [
        v
        for r in h
        if (s := _num(r, "step")) is not None
        and step - window < s <= step
        and (v := _num(r, "rewards/mean")) is not None
    ]
    return _mean(xs) if xs else None


def _reward_vs_eval(h, cfg, out):
    evals = [
        (r, s)
        for r in h
        if _num(r, "eval/pass_at_1") is not None and (s := _num(r, "step")) is not None
    ]
    if len(evals) < 2:
        return
    (r1, s1), (r2, s2) = evals[-2:]
    w1, w2 = _reward_at(h, s1, cfg.reward_window), _reward_at(h, s2, cfg.reward_window)
    if w1 is None or w2 is None:
        return
    p1, p2 = r1["eval/pass_at_1"], r2["eval/pass_at_1"]
    if w2 - w1 > cfg.reward_rise_min and p1 - p2 > cfg.pass_drop_min:
        out(
            "reward_vs_eval",
            f"rewards/mean rose {w1:.4g} -> {w2:.4g} while eval/pass_at_1 fell {p1:.4g} -> "
            f"{p2:.4g} (steps {int(s1)} -> {int(s2)}): the policy may be exploiting the reward",
        )


def _hacking(h, cfg, out):
    key = next((k for k in LEARNED_KEYS if _num(h[-1], k) is not None), None)
    if key is None:
        return
    rows = [
        (a, b)
        for r in h[-cfg.hack_window :]
        if (a := _num(r, key)) is not None and (b := _num(r, cfg.hack_check)) is not None
    ]
    half = len(rows) // 2
    if len(rows) < cfg.hack_window or half < 2:  # each half needs a spread (a variance)
        return
    first, second = [a for a, _ in rows[:half]], [a for a, _ in rows[half:]]
    rise = _mean(second) - _mean(first)
    check = _mean([b for _, b in rows[half:]]) - _mean([b for _, b in rows[:half]])
    # The standard error of the rise: the learned reward's step-to-step noise in each half.
    se = math.sqrt(
        statistics.variance(first) / len(first) + statistics.variance(second) / len(second)
    )
    if rise > cfg.hack_rise_min and rise > cfg.hack_rise_z * se and check <= cfg.hack_flat_max:
        out(
            "reward_hacking",
            f"{key} rose by {rise:.4g} (> health.hack_rise_min {cfg.hack_rise_min}, and "
            f"{rise / se if se else math.inf:.3g} standard errors > health.hack_rise_z "
            f"{cfg.hack_rise_z}) over the last {len(rows)} steps while {cfg.hack_check} "
            f"changed by {check:+.4g} (<= health.hack_flat_max {cfg.hack_flat_max}): the "
            "policy may be exploiting the learned reward",
        )


def _mismatch(h, cfg, out):
    n, b = cfg.mismatch_window, cfg.mismatch_baseline
    for name, key in (
        ("logp_mismatch_policy", "policy/abs_log_ratio_mean"),
        ("logp_mismatch_behavior", "behavior/abs_log_diff_mean"),
    ):
        xs = _series(h, key)
        if b < 1 or len(xs) < n + b:
            continue
        now, med = _mean(xs[-n:]), statistics.median(xs[-n - b : -n])
        if now > cfg.mismatch_min and now > cfg.mismatch_growth * med:
            out(
                name,
                f"{key} {now:.4g} (mean of the last {n} steps) > health.mismatch_growth "
                f"{cfg.mismatch_growth} x its median {med:.4g} over the {b} steps before",
            )


_RULES = (
    _entropy,
    _length,
    _truncation,
    _spikes,
    _kl,
    _zero_var,
    _reward_vs_eval,
    _hacking,
    _mismatch,
)


def history_needed(cfg: HealthConfig) -> int:
    """How many recent records the windows look at (the rest of a history is not needed,
    except the first ``entropy_window`` records and the last two evaluations)."""
    return 1 + max(
        cfg.entropy_window,
        cfg.length_window + cfg.length_baseline,
        cfg.truncation_window,
        cfg.kl_window + 1,
        cfg.zero_var_steps,
        cfg.reward_window,
        cfg.hack_window,
        cfg.mismatch_window + cfg.mismatch_baseline,
    )


def diagnose(history: Sequence[Mapping[str, float]], cfg: HealthConfig) -> list[Alarm]:
    """The alarms the metric records ``history`` (oldest first) set off at its newest step.

    ``history`` holds each step's dict as written to metrics.jsonl. Pure: it reads only the
    keys its rules name, skips a rule whose keys are missing or whose windows are not yet full
    (a short history is quiet), and never raises on a missing or non-finite value. Each
    :class:`Alarm` names the rule, the step of the newest record and the numbers that set it
    off.
    """
    if not history:
        return []
    step = _num(history[-1], "step")
    step = int(step) if step is not None else len(history)
    alarms: list[Alarm] = []

    def out(name: str, text: str) -> None:
        alarms.append(Alarm(name, step, f"step {step}: {text}"))

    for rule in _RULES:
        rule(history, cfg, out)
    return alarms


def describe_stop(alarms) -> str:
    """ "health alarm <name> at step <s>: <metric> <value> <op> <threshold>" for each alarm
    (a ``health.Alarm`` or its dict) that stopped a run, joined by "; "."""
    as_dict = lambda a: a if isinstance(a, dict) else dataclasses.asdict(a)
    return "; ".join(f"health alarm {a['name']} at {a['message']}" for a in map(as_dict, alarms))


# ---------------------------------------------------------------------------
# The health section of the run config.


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """Training-health alarms (``run.health``: the rules; ``run.report``: the reports).

    The defaults keep a healthy run quiet; windows count steps (metric records).

    Attributes:
      enabled: check the run's metrics after every step.
      stop_on_alarm: when an alarm fires, save a checkpoint of the step and end
        the run with ``AlarmStop`` (the command: exit status 4).
      resume_after_stop: resume from a checkpoint that such a stop saved (a rerun
        refuses to otherwise).
      rearm_steps: an alarm that fired fires again only after it has been
        quiet for more than this many steps.
      entropy_window: steps averaged for the early and current entropy.
      entropy_frac: entropy collapse below this fraction of its early level.
      entropy_floor: entropy collapse below this absolute level (nats/token).
      length_window: recent steps of the completion length.
      length_baseline: the steps before them it is compared with.
      length_blowup: alarm when recent / earlier length exceeds this.
      length_collapse: alarm when recent / earlier length is below this.
      truncation_window: steps averaged for the truncation rate.
      truncation_max: alarm above this truncated share.
      clip_frac_max: alarm when one step's clipped share (low + high) exceeds this.
      ratio_max: alarm when one step's largest ratio pi_theta / pi_old exceeds this.
      kl_window: steps whose median KL a step's KL is compared with.
      kl_spike_factor: alarm when the KL exceeds this times that median ...
      kl_min: ... and this absolute level.
      zero_var_steps: steps in a row ...
      zero_var_max: ... with at least this share of zero-variance groups.
      reward_window: steps of reward averaged up to each evaluation.
      reward_rise_min: reward rise between two evaluations that counts ...
      pass_drop_min: ... with a held-out pass@1 drop above this.
      hack_window: steps of the learned reward and its check compared (two halves;
        at least 4, so that each half has a spread).
      hack_rise_min: a learned-reward rise above this (its own units) ...
      hack_rise_z: ... and above this many standard errors of the rise (the halves'
        step-to-step spread; 0: no such test) ...
      hack_flat_max: ... with the check rising by no more than this fires.
      hack_check: the metric that checks the learned reward.
      mismatch_window: recent steps of a log-prob mismatch.
      mismatch_baseline: the steps before them whose median it is compared with.
      mismatch_growth: alarm when the recent mean exceeds this times that median ...
      mismatch_min: ... and this absolute level.
    """

    enabled: bool = True
    stop_on_alarm: bool = False
    resume_after_stop: bool = False
    rearm_steps: int = 20
    entropy_window: int = 5
    entropy_frac: float = 0.2
    entropy_floor: float = 0.01
    length_window: int = 10
    length_baseline: int = 20
    length_blowup: float = 2.0
    length_collapse: float = 0.5
    truncation_window: int = 5
    truncation_max: float = 0.25
    clip_frac_max: float = 0.2
    ratio_max: float = 10.0
    kl_window: int = 20
    kl_spike_factor: float = 5.0
    kl_min: float = 1e-3
    zero_var_steps: int = 20
    zero_var_max: float = 0.9
    reward_window: int = 10
    reward_rise_min: float = 0.05
    pass_drop_min: float = 0.02
    hack_window: int = 40
    hack_rise_min: float = 0.1
    hack_rise_z: float = 3.0
    hack_flat_max: float = 0.0
    hack_check: str = "rollout/pass_rate"
    mismatch_window: int = 10
    mismatch_baseline: int = 40
    mismatch_growth: float = 3.0
    mismatch_min: float = 0.05

    def __post_init__(self):
        check_bool("health.enabled", self.enabled)
        check_bool("health.stop_on_alarm", self.stop_on_alarm)
        check_bool("health.resume_after_stop", self.resume_after_stop)
        check_range("health.rearm_steps", self.rearm_steps, lo=0, integer=True)
        for key in (
            "length_baseline",
            "kl_window",
            "mismatch_baseline",
            "entropy_window",
            "length_window",
            "truncation_window",
            "zero_var_steps",
            "reward_window",
            "mismatch_window",
        ):
            check_range(f"health.{key}", getattr(self, key), lo=1, integer=True)
        for key in (
            "entropy_frac",
            "entropy_floor",
            "length_blowup",
            "length_collapse",
            "truncation_max",
            "clip_frac_max",
            "ratio_max",
            "kl_spike_factor",
            "kl_min",
            "zero_var_max",
            "reward_rise_min",
            "pass_drop_min",
            "mismatch_growth",
            "mismatch_min",
            "hack_rise_min",
            "hack_rise_z",
        ):
            check_range(f"health.{key}", getattr(self, key), lo=0.0)
        check_range("health.hack_window", self.hack_window, integer=True)
        if self.hack_window < HACK_WINDOW_MIN:
            raise ConfigError(
                f"config key 'health.hack_window' = {self.hack_window} must be >= "
                f"{HACK_WINDOW_MIN}: each half of the window needs two steps, whose spread is "
                "the learned reward's step-to-step noise that the rise is tested against"
            )
        check_range("health.hack_flat_max", self.hack_flat_max)
        if not isinstance(self.hack_check, str) or not self.hack_check:
            raise ConfigError(
                f"config key 'health.hack_check' = {self.hack_check!r} must be a metric name"
            )
