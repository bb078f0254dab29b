"""The end of a run: summary.json and the before/after table."""

from __future__ import annotations

import json
import time


def summarize(
    run, workdir, before, after, warm_info, prior_seconds, t_start, final_step, progress, is_main,
    data_stats=None, sampled_tokens=0, ended_by="train.steps",
):  # fmt: skip
    wall = prior_seconds + time.time() - t_start
    pick = lambda ev: (
        None
        if ev is None
        else {
            k.split("/", 1)[1]: v
            for k, v in ev.items()
            if k.startswith("eval/") and not k.startswith("eval/num")
        }
    )
    summary = {
        "before": pick(before),
        "after": pick(after),
        "wall_seconds": wall,
        "steps": final_step,
        "seed": run.seed,
        "num_problems": int(after["eval/num_problems"]),
        "warm_start": None
        if warm_info is None
        else {
            k: warm_info.get(k)
            for k in ("steps", "val_pass_at_1", "reached_target", "seconds", "cached")
        },
        "data": dict(data_stats or {}),  # "skipped/<split>": malformed rows skipped
        "sampled_tokens": sampled_tokens,  # completion tokens sampled by GRPO
        "ended_by": ended_by,  # "train.steps" or "train.sampled_tokens_budget"
    }
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    b, a = summary["before"] or {}, summary["after"]
    table = [
        "",
        f"{'held-out (' + str(summary['num_problems']) + ' problems)':<32}{'before':>10}"
        f"{'after':>10}{'change':>10}",
        _row("greedy pass@1", b.get("pass_at_1"), a["pass_at_1"]),
    ]
    if "pass_at_k" in a:
        label = f"pass@{run.eval.k} (n={run.eval.num_samples})"
        table.append(_row(label, b.get("pass_at_k"), a["pass_at_k"]))
    if not b:
        table.append("no before figures: the run did not evaluate before GRPO (eval.at_start)")
    table.append(
        f"wall time {wall:.0f}s, {final_step} GRPO steps; summary in {workdir / 'summary.json'}"
    )
    progress.message("\n".join(table))
    return summary


def _row(label: str, before: float | None, after: float) -> str:
    """One line of the table; "-" where there is no "before" figure."""
    if before is None:
        return f"{label:<32}{'-':>10}{after:>10.3f}{'-':>10}"
    return f"{label:<32}{before:>10.3f}{after:>10.3f}{after - before:>+10.3f}"
