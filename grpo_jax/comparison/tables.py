"""The compare command's tables as text: each under the caption that says which interval it
shows, in Markdown and as LaTeX tabulars."""

from __future__ import annotations

import re
from collections.abc import Sequence

INTERVALS = (
    "Wilson: Wilson score interval (one run); bootstrap: percentile bootstrap over problems "
    "(one run); cluster bootstrap: problems resampled with all their seeds (seeds that share "
    "some or all of their problems); stratified bootstrap: each seed's problems resampled on "
    "their own (each seed has its own problems)"
)
CAPTIONS = {
    "groups": (
        "95% intervals over the evaluation's problems and samples for these trained models, "
        f"not across training seeds. Interval: {INTERVALS}; after - before paired on the same "
        "units, resampled the same way. Steps: the evaluations' training steps (before -> after, "
        "one per seed where they differ)."
    ),
    "paired": (
        "Other - base on the same problems, runs matched by seed; 95% interval as in the first "
        "table, the differences resampled. Paired test: McNemar's exact test where each problem "
        "has one unit; otherwise the sign-flip test over problems (each problem's difference "
        "summed over its seeds, flipped whole). In brackets: problems better in base / in other."
    ),
    "across": (
        "Across training seeds: 95% intervals of the mean over seeds that also cover the spread "
        "from one training seed to the next (mean -+ t sqrt(problems' variance + between-seed "
        "variance / seeds), Student's t with Satterthwaite's degrees of freedom); sd: the "
        "estimated standard deviation of one seed's figure beyond the evaluation's noise."
    ),
    "paired_across": (
        "Across training seeds, other - base: 95% interval as in the previous table; "
        "P(other > base): the share of (other, base) pairs of runs in which the other run "
        "scores higher, ties half (no interval)."
    ),
    "tasks": (
        "Across tasks: the interquartile mean (IQM) of every run's figure on every task, with "
        "rliable's 95% stratified bootstrap interval (each task's runs resampled on their own); "
        "P(improvement): over tasks, the mean share of pairs of runs in which the method beats "
        "the first method. Steps: the runs' training steps, task by task (one where they agree)."
    ),
}


def _num(x, signed=False) -> str:
    return ("{:+.3f}" if signed else "{:.3f}").format(x)


def _ci(v, signed=False) -> str:
    if v is None:
        return "-"
    return f"{_num(v[0], signed)} [{_num(v[1], signed)}, {_num(v[2], signed)}]"


def _across_ci(a: dict | None, signed=False) -> str:
    return "-" if a is None else _ci((a["mean"], a["lo"], a["hi"]), signed)


def _seeds(s) -> str:
    return ",".join(str(x) for x in s)


def _steps(steps: Sequence[int | None] | None) -> str:
    """ "200" when every seed's evaluation is of step 200, else each seed's: "100/0"."""
    if steps is None:
        return "-"
    shown = ["?" if s is None else str(s) for s in steps]
    return shown[0] if len(set(shown)) == 1 else "/".join(shown)


def _test(t: dict | None) -> str:
    if t is None:
        return "-"
    # Random sign flips that never reached the observed sum: p is below the smallest they show.
    floor = not t["exact"] and t["p_value"] <= 1.0 / (1 + t["flips"]) * (1 + 1e-9)
    p = f"<{t['p_value']:.1g}" if floor else f"{t['p_value']:.3g}"
    return f"{p} ({t['negative']} / {t['positive']}, {t['name']})"


def _table(caption: str, header: list[str], rows: list[list[str]]) -> dict:
    return {"caption": CAPTIONS[caption], "header": header, "rows": rows}


def _groups(group_table: Sequence[dict]) -> dict:
    """Each group's figures: before, after, by seed and after - before."""
    header = ["run", "seeds", "steps", "problems", "units", "metric", "interval",
              "before [95% CI]", "after [95% CI]", "after by seed",
              "after - before [95% CI]"]  # fmt: skip
    rows = [
        [
            r["group"],
            _seeds(r["seeds"]),
            f"{_steps(r['steps']['before'])} -> {_steps(r['steps']['after'])}",
            str(r["problems"]),
            str(r["units"]),
            r["metric"],
            r["interval"],
            _ci(r.get("before")),
            _ci(r["after"]),
            " / ".join(_num(x) for x in r["per_seed"]),
            _ci(r.get("change"), True),
        ]
        for r in group_table
    ]
    return _table("groups", header, rows)


def _paired(paired_table: Sequence[dict]) -> dict:
    """Other - base on the same problems, with the paired test."""
    header = ["comparison", "seeds", "steps (base / other)", "problems", "metric", "interval",
              "base", "other", "other - base [95% CI]",
              "paired test p (base / other better)"]  # fmt: skip
    rows = [
        [
            f"{r['other']} vs {r['base']}",
            _seeds(r["seeds"]),
            f"{_steps(r['steps']['base'])} / {_steps(r['steps']['other'])}",
            str(r["problems"]),
            r["metric"],
            r["interval"],
            _num(r["base_value"]),
            _num(r["other_value"]),
            _ci(r["diff"], True),
            _test(r.get("test")),
        ]
        for r in paired_table
    ]
    return _table("paired", header, rows)


def _across(group_table: Sequence[dict]) -> dict:
    """The groups' figures across training seeds (rows that have them)."""
    header = ["run", "seeds", "steps", "metric", "after [95% CI across seeds]",
              "sd between seeds", "after - before [95% CI across seeds]"]  # fmt: skip
    rows = [
        [
            r["group"],
            _seeds(r["seeds"]),
            _steps(r["steps"]["after"]),
            r["metric"],
            _across_ci(r["across_seeds"]["after"]),
            _num(r["across_seeds"]["after"]["between"]),
            _across_ci(r["across_seeds"].get("change"), True),
        ]
        for r in group_table
    ]
    return _table("across", header, rows)


def _paired_across(paired_table: Sequence[dict]) -> dict:
    """Other - base across training seeds, and the probability of improvement."""
    header = ["comparison", "seeds", "steps (base / other)", "metric",
              "other - base [95% CI across seeds]", "sd between seeds",
              "P(other > base)"]  # fmt: skip
    rows = [
        [
            f"{r['other']} vs {r['base']}",
            _seeds(r["seeds"]),
            f"{_steps(r['steps']['base'])} / {_steps(r['steps']['other'])}",
            r["metric"],
            _across_ci(r["across_seeds"]["diff"], True),
            _num(r["across_seeds"]["diff"]["between"]),
            f"{r['p_improvement']:.2f}",
        ]
        for r in paired_table
    ]
    return _table("paired_across", header, rows)


def _tasks(task_table: Sequence[dict]) -> dict:
    """Each method's interquartile mean over tasks."""
    header = ["method", "tasks", "runs", "steps", "metric", "IQM [95% CI]",
              "P(improvement) vs first"]  # fmt: skip
    rows = [
        [
            r["method"],
            str(r["tasks"]),
            str(r["runs"]),
            _steps(r["steps"]),
            r["metric"],
            _ci(r["iqm"]),
            "-" if "p_improvement" not in r else f"{r['p_improvement']:.2f}",
        ]
        for r in task_table
    ]
    return _table("tasks", header, rows)


def tables(
    group_table: list[dict], paired_table: list[dict], task_table: Sequence[dict] = ()
) -> list[dict]:
    """The tables as {caption, header, rows} of text cells, for Markdown and LaTeX: those
    that have rows, in the order of CAPTIONS."""
    out = [_groups(group_table)]
    if paired_table:
        out.append(_paired(paired_table))
    across = [r for r in group_table if "across_seeds" in r]
    if across:
        out.append(_across(across))
    across = [r for r in paired_table if "across_seeds" in r]
    if across:
        out.append(_paired_across(across))
    if task_table:
        out.append(_tasks(task_table))
    return out


def markdown(
    group_table: list[dict], paired_table: list[dict], task_table: Sequence[dict] = ()
) -> str:
    """The tables in Markdown, each under the line that says which interval it shows."""
    parts = []
    for t in tables(group_table, paired_table, task_table):
        lines = [t["caption"], "", "| " + " | ".join(t["header"]) + " |"]
        lines.append("|" + "---|" * len(t["header"]))
        lines += ["| " + " | ".join(row) + " |" for row in t["rows"]]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _tex(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("&", r"\&"), ("%", r"\%"),
                 ("#", r"\#"), ("$", r"\$")):  # fmt: skip
        s = s.replace(a, b)
    s = s.replace("->", r"$\to$")
    return re.sub(r"(?<![\w.])([+-]?\d+\.\d+)", r"$\1$", s)


def latex(
    group_table: list[dict], paired_table: list[dict], task_table: Sequence[dict] = ()
) -> str:
    """The tables as LaTeX tabulars (booktabs), each under a comment naming its interval."""
    out = []
    for t in tables(group_table, paired_table, task_table):
        out += [
            f"% grpo_jax.compare: {t['caption']}",
            r"\begin{tabular}{" + "l" * len(t["header"]) + "}",
            r"\toprule",
            " & ".join(_tex(h) for h in t["header"]) + r" \\",
            r"\midrule",
            *(" & ".join(_tex(c) for c in row) + r" \\" for row in t["rows"]),
            r"\bottomrule",
            r"\end{tabular}",
            "",
        ]
    return "\n".join(out)
