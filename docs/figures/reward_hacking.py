"""The figure of docs/learned_rewards.md's reward-hacking demonstration, from runs' metrics.

    python docs/figures/reward_hacking.py WORKDIR [WORKDIR ...] [--out=docs/reward_hacking.png]

Three panels over GRPO steps, one line per run (a seed, say), each a moving mean over
``--smooth`` steps: the learned reward (``rewards/reward_model/mean``); the true check, the
exact-match pass rate of the step's samples (``rollout/pass_rate``, scored at weight 0) with
the held-out greedy pass@1 of each evaluation as points with their 95% intervals; and the
bias, the share of completions longer than their reference answer
(``rewards/longer_answer/mean``), with the share that are the right answer followed by more
characters (``rewards/padded_answer/mean``) dashed. A vertical line marks each step
where ``alarms/reward_hacking`` fired, in the run's colour. Needs matplotlib
(requirements-test.txt).
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from grpo_jax.run.writers import read_metrics


def smooth(values, width: int) -> np.ndarray:
    """Mean of each value and the ``width - 1`` before it (fewer at the start)."""
    x = np.asarray(values, dtype=float)
    c = np.cumsum(np.insert(x, 0, 0.0))
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(i - width, 0)
    return (c[i] - c[lo]) / (i - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdirs", type=pathlib.Path, nargs="+")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/reward_hacking.png"))
    ap.add_argument("--smooth", type=int, default=5, help="steps in each moving mean")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for n, workdir in enumerate(args.workdirs):
        records = read_metrics(workdir / "metrics.jsonl")
        rows = [r for r in records if "rollout/pass_rate" in r]
        if not rows:
            raise SystemExit(f"{workdir}/metrics.jsonl has no GRPO step records")
        color, label = f"C{n}", workdir.name
        steps = [r["step"] for r in rows]
        series = lambda key: smooth([r.get(key, np.nan) for r in rows], args.smooth)  # noqa: E731
        axes[0].plot(steps, series("rewards/reward_model/mean"), color=color, label=label)
        axes[1].plot(steps, series("rollout/pass_rate"), color=color)
        evals = [r for r in records if "eval/pass_at_1" in r]
        axes[1].errorbar(
            [r["step"] for r in evals],
            [r["eval/pass_at_1"] for r in evals],
            yerr=[
                [r["eval/pass_at_1"] - r["eval/pass_at_1_lo"] for r in evals],
                [r["eval/pass_at_1_hi"] - r["eval/pass_at_1"] for r in evals],
            ],
            fmt="o",
            color=color,
            ms=4,
            capsize=2,
        )
        axes[2].plot(steps, series("rewards/longer_answer/mean"), color=color, label=label)
        axes[2].plot(steps, series("rewards/padded_answer/mean"), color=color, ls="--", lw=1)
        for s in (r["step"] for r in rows if r.get("alarms/reward_hacking")):
            for ax in axes:
                ax.axvline(s, color=color, alpha=0.5, lw=1, ls=":")
        alarms = [r["step"] for r in rows if r.get("alarms/reward_hacking")]
        print(f"{workdir}: {len(rows)} steps; reward_hacking alarms at {alarms}")
    titles = [
        ("learned reward (reward model's score)", "rewards/reward_model/mean"),
        ("true check: exact-match pass@1", "pass rate"),
        ("the bias: longer than the answer", "share (dashed: right answer + more)"),
    ]
    for ax, (title, ylabel) in zip(axes, titles, strict=True):
        ax.set(title=title, xlabel="GRPO step", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_ylim(0, 1)
    axes[2].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    axes[1].plot([], [], color="grey", label="samples (moving mean)")
    axes[1].errorbar([], [], yerr=[], fmt="o", color="grey", ms=4, label="held-out greedy, 95% CI")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"{args.out} written")


if __name__ == "__main__":
    main()
