"""Training-health alarms: what in a run's recent metrics says it is going wrong.

    alarms = diagnose(history, cfg)   # cfg: grpo_jax.config.HealthConfig

``history`` is the metric records of recent steps, oldest first, each one
step's dict as written to metrics.jsonl. :func:`diagnose` is pure: it reads
only the keys named below, skips a rule whose keys are missing or whose
windows are not yet full (a short history is quiet), and never raises on a
missing or non-finite value. Each :class:`Alarm` names the rule, the step of
the newest record and the numbers that set it off.

The rules (thresholds and windows: ``HealthConfig``, whose defaults keep a
healthy run quiet):

  entropy_collapse        mean ``train/entropy`` of the last ``entropy_window``
                          records < ``entropy_frac`` x that of the first
                          ``entropy_window`` records, or < ``entropy_floor``.
  length_blowup /         mean ``rollout/length_mean`` of the last
  length_collapse         ``length_window`` records over that of the
                          ``length_baseline`` records before them is
                          > ``length_blowup`` / < ``length_collapse``.
  truncation              mean ``rollout/truncated_frac`` of the last
                          ``truncation_window`` records > ``truncation_max``.
  clip_frac_spike         the newest ``train/clip_frac_low`` +
                          ``train/clip_frac_high`` > ``clip_frac_max``.
  ratio_spike             the newest ``train/ratio_max`` > ``ratio_max``.
  kl_spike                the newest ``train/kl`` > ``kl_spike_factor`` x the
                          median of the ``kl_window`` records before it and
                          > ``kl_min``. Only with a KL penalty (grpo.beta > 0):
                          where ``train/kl`` is absent or 0, never.
  zero_var_groups         ``rollout/frac_zero_var_groups`` >= ``zero_var_max``
                          in each of the last ``zero_var_steps`` records.
  reward_vs_eval          between the last two evaluations (records with
                          ``eval/pass_at_1``), ``rewards/mean`` (averaged over
                          the records of the ``reward_window`` steps up to each
                          evaluation) rose by > ``reward_rise_min`` while
                          ``eval/pass_at_1`` fell by > ``pass_drop_min``.
  logp_mismatch_policy    mean ``policy/abs_log_ratio_mean`` (how far one step's
                          update moved the policy) of the last
                          ``mismatch_window`` records > ``mismatch_growth`` x
                          the median of the ``mismatch_baseline`` records
                          before them and > ``mismatch_min``.
  logp_mismatch_behavior  the same rule on ``behavior/abs_log_diff_mean``:
                          the mean |log pi_old - log q| of the sampled tokens
                          (q: the distribution the sampler drew from), logged
                          by every update. With ``grpo.old_logps = "sampler"``
                          it is the truncation gap alone; the sampler/trainer
                          precision gap enters it only with ``"recompute"``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_jax.config import HealthConfig

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
)


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
    if len(xs) < n + b:
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


def _mismatch(h, cfg, out):
    n, b = cfg.mismatch_window, cfg.mismatch_baseline
    for name, key in (
        ("logp_mismatch_policy", "policy/abs_log_ratio_mean"),
        ("logp_mismatch_behavior", "behavior/abs_log_diff_mean"),
    ):
        xs = _series(h, key)
        if len(xs) < n + b:
            continue
        now, med = _mean(xs[-n:]), statistics.median(xs[-n - b : -n])
        if now > cfg.mismatch_min and now > cfg.mismatch_growth * med:
            out(
                name,
                f"{key} {now:.4g} (mean of the last {n} steps) > health.mismatch_growth "
                f"{cfg.mismatch_growth} x its median {med:.4g} over the {b} steps before",
            )


_RULES = (_entropy, _length, _truncation, _spikes, _kl, _zero_var, _reward_vs_eval, _mismatch)


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
        cfg.mismatch_window + cfg.mismatch_baseline,
    )


def diagnose(history: Sequence[Mapping[str, float]], cfg: HealthConfig) -> list[Alarm]:
    """The alarms the metric records ``history`` (oldest first) set off at its newest step."""
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
