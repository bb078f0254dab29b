"""Replays the health alarms over a run's metrics.jsonl with today's rules and settings.

    python docs/figures/replay_alarms.py WORKDIR [WORKDIR ...] [--alarm reward_hacking]
        [--set hack_rise_z=0 ...]

Each record in turn is given, with the records before it, to ``grpo_jax.run.health.diagnose``
under ``HealthConfig`` (its defaults, or ``--set`` overrides), and an alarm counts when it
fires after ``rearm_steps`` quiet steps, as the trainer's Reporter counts it. Prints, per
workdir, the steps at which the alarm fires. docs/learned_rewards.md's replay of the weight
sweep is this script's output.
"""

from __future__ import annotations

import argparse
import dataclasses

from grpo_jax.run import health
from grpo_jax.run.writers import read_metrics


def _number(text: str) -> int | float:
    """An int where the text is one (window lengths are counts), else a float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def fired_at(records, cfg: health.HealthConfig, alarm: str) -> list[int]:
    seen, out = None, []
    steps = [r for r in records if r.get("step", 0) >= 1]
    for i, r in enumerate(steps):
        if not any(a.name == alarm for a in health.diagnose(steps[: i + 1], cfg)):
            continue
        if seen is None or r["step"] - seen - 1 > cfg.rearm_steps:
            out.append(int(r["step"]))
        seen = r["step"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdirs", nargs="+")
    p.add_argument("--alarm", default="reward_hacking")
    p.add_argument("--set", action="append", default=[], help="health key=value (a number)")
    a = p.parse_args(argv)
    overrides = {k: _number(v) for k, v in (s.split("=", 1) for s in a.set)}
    cfg = dataclasses.replace(health.HealthConfig(), **overrides)
    for w in a.workdirs:
        print(w, fired_at(read_metrics(f"{w}/metrics.jsonl"), cfg, a.alarm))


if __name__ == "__main__":
    main()
