"""The figure of docs/learned_rewards.md's reward-hacking demonstration, from a run's metrics.

    python docs/figures/reward_hacking.py WORKDIR [--out=docs/reward_hacking.png]

Three panels over GRPO steps: the learned reward (``rewards/reward_model/mean``), the true
check (``rollout/pass_rate``: exact match, scored at weight 0), and the length the reward
model's bias favours (``rollout/length_mean``, tokens), with ``rewards/trailing_zeros/mean``
(the share of zero-padded answers, the pairs' own bias) on its right axis; a vertical line
at each step where ``alarms/reward_hacking`` fired. Needs matplotlib (requirements-test.txt).
"""

from __future__ import annotations

import argparse
import pathlib

from grpo_jax.metrics import read_metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/reward_hacking.png"))
    args = ap.parse_args()
    rows = [r for r in read_metrics(args.workdir / "metrics.jsonl") if "rollout/pass_rate" in r]
    if not rows:
        raise SystemExit(f"{args.workdir}/metrics.jsonl has no GRPO step records")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    alarms = [r["step"] for r in rows if r.get("alarms/reward_hacking")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    panels = [
        ("rewards/reward_model/mean", "learned reward (reward model's score)"),
        ("rollout/pass_rate", "true check: exact-match pass rate"),
        ("rollout/length_mean", "completion length (tokens) and zero padding"),
    ]
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows])
        for s in alarms:
            ax.axvline(s, color="red", alpha=0.6, lw=1)
        ax.set(title=title, xlabel="GRPO step", ylabel=key)
        ax.grid(alpha=0.3)
    right = axes[2].twinx()
    right.plot(steps, [r.get("rewards/trailing_zeros/mean", 0.0) for r in rows], color="C2")
    right.set_ylabel("share zero-padded (C2)")
    right.set_ylim(0, 1)
    if alarms:
        axes[0].text(alarms[0], axes[0].get_ylim()[1], f" alarm, step {alarms[0]}", va="top")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"{args.out} written ({len(rows)} steps; reward_hacking alarms at {alarms})")


if __name__ == "__main__":
    main()
