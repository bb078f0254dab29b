"""The end of a run: summary.json (with the record of what ran) and the before/after table."""

from __future__ import annotations

import json
import time

INTERVALS = (
    "95% intervals over the held-out problems for this trained model (greedy pass@1: Wilson; "
    "pass@k: bootstrap over problems), not across training seeds: python -m grpo_jax.compare "
    "of three seeds or more gives those"
)


def summarize(
    run, workdir, before, after, warm_info, prior_seconds, t_start, final_step, progress, is_main,
    data_stats=None, sampled_tokens=0, ended_by="train.steps", record=None,
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
        # What ran: config hash and text, code, versions, devices, seeds, data
        # (grpo_jax.run.record); each evaluation's problems are in eval/step_<N>.jsonl.
        "record": record,
        "eval_files": {
            "before": "eval/step_0.jsonl" if before is not None else None,
            "after": f"eval/step_{final_step}.jsonl",
        },
    }
    if is_main:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    b, a = summary["before"] or {}, summary["after"]
    table = [
        "",
        f"{'held-out (' + str(summary['num_problems']) + ')':<24}{'before [95% CI]':>22}"
        f"{'after [95% CI]':>22}{'change':>10}",
        _row("greedy pass@1", b, a, "pass_at_1"),
    ]
    if "pass_at_k" in a:
        seeds = len(run.eval.seeds)
        n = f"n={run.eval.num_samples}" + (f"x{seeds} seeds" if seeds > 1 else "")
        table.append(_row(f"pass@{run.eval.k} ({n})", b, a, "pass_at_k"))
    if not b:
        table.append("no before figures: the run did not evaluate before GRPO (eval.at_start)")
    table.append(INTERVALS)
    table.append(
        f"wall time {wall:.0f}s, {final_step} GRPO steps; summary in {workdir / 'summary.json'}"
    )
    progress.message("\n".join(table))
    return summary


def _row(label: str, before: dict, after: dict, key: str) -> str:
    """One line of the table with 95% intervals; "-" where there is no "before" figure."""

    def cell(ev):
        if key not in ev:
            return f"{'-':>22}"
        lo, hi = ev.get(f"{key}_lo"), ev.get(f"{key}_hi")
        ci = "" if lo is None else f" [{lo:.3f}, {hi:.3f}]"
        return f"{ev[key]:.3f}{ci}".rjust(22)

    change = f"{after[key] - before[key]:>+10.3f}" if key in before else f"{'-':>10}"
    return f"{label:<24}{cell(before)}{cell(after)}{change}"
