r"""The compare command: paired differences between runs, with intervals, as tables and figures.

    python -m grpo_jax.compare RUN [RUN ...] [--labels=full,lora] [--out=DIR]
        [--allow_mixed_steps]

Each RUN is a training workdir (its final evaluation, ``summary.json``'s
``eval_files``, and its first one as "before"; without a summary, its last
``eval/step_<N>.jsonl``, and the command says which it took) or one evaluation
file (``grpo_jax.core.problems``). Every table names the step each evaluation
comes from (the file header's ``step``); evaluations of different steps are
neither pooled nor paired unless ``--allow_mixed_steps`` asks for it.

Runs whose configs are the same but for the seed (``seed`` and ``data.seed``) form
one group; a group's label is ``--labels``' entry or the config keys in which it
differs from the first group. A group's runs are pooled: seed s's problem i is one
unit. Which units are independent follows from the problem ids:

  one run       greedy pass@1: Wilson; other figures: bootstrap over problems
  shared        every seed evaluated the same problems: one problem's units are
                correlated, so problems are resampled with all their seeds (a
                cluster bootstrap)
  per seed      no problem in two seeds: each seed's problems are resampled on
                their own (a bootstrap stratified by seed)
  overlapping   some problems in several seeds: clusters by problem id

For every later group against the first group of its task (the ``data`` and ``env``
sections), runs are matched by seed and each pair is checked to have evaluated the
same problems: the paired difference with the same resampling of the differences,
and a paired test that respects the clusters (``stats.cluster_sign_flip_test``:
McNemar's exact test when each problem has one unit). These intervals are 95% and
cover the evaluation's sampling of problems and completions for these trained
models. With three seeds or more, a further table gives intervals that also cover
the spread from one training seed to the next (``stats.across_seeds_interval``)
and the probability that a run of one group beats a run of the other; when the
runs span several tasks, another gives each method's interquartile mean over runs
and tasks with rliable's stratified bootstrap interval. Each table says which
interval it shows.

The tables are printed as Markdown; ``--out`` also writes ``compare.md``,
``compare.tex`` (LaTeX tables), ``compare.json`` (every number) and ``curves.png``:
the training curves of each group (mean over seeds, the band from the lowest to
the highest seed) from each workdir's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from grpo_jax import cli
from grpo_jax.comparison.rows import (
    MIN_SEEDS_ACROSS,
    Units,
    across_seeds,
    group_rows,
    interval,
    layout_of,
    paired_rows,
    paired_test,
    task_rows,
)
from grpo_jax.comparison.runs import CompareError, Group, group_runs, load_run
from grpo_jax.comparison.tables import _test, latex, markdown
from grpo_jax.run.writers import read_metrics

# What benchmarks/interval_coverage.py and the tests use from here; the rest is in comparison/.
__all__ = [
    "MIN_SEEDS_ACROSS", "CompareError", "Units", "_test", "across_seeds", "compare", "curves",
    "interval", "latex", "layout_of", "load_run", "main", "markdown", "paired_test", "plot",
    "task_rows",
]  # fmt: skip

CURVES = (("rollout/pass_rate", "training pass rate"), ("eval/pass_at_1", "held-out greedy pass@1"))
MISSING_MATPLOTLIB = (
    "no curves.png: the figures need matplotlib, an optional dependency; install it with "
    "pip install -e '.[plots]' in the grpo_jax checkout (or pip install 'matplotlib>=3.8,<4')"
)


# ---------------------------------------------------------------------------
# Figures.


def curves(group: Group, key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, values [runs, steps]) of ``key`` at the steps every run of ``group`` logged."""
    series = []
    for r in group.runs:
        if r.workdir is None:
            return None
        path = r.workdir / "metrics.jsonl"
        try:
            recs = read_metrics(path)
        except UnicodeDecodeError as e:
            raise CompareError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        ok = lambda rec: (
            isinstance(rec, dict)
            and isinstance(rec.get("step"), int)
            and isinstance(rec.get(key), (int, float))
        )
        series.append({rec["step"]: rec[key] for rec in recs if ok(rec)})
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    if not steps:
        return None
    return np.array(steps), np.array([[s[t] for t in steps] for s in series], np.float64)


def plot(groups: Sequence[Group], path: pathlib.Path) -> pathlib.Path | None:
    """Training curves, mean over seeds with a min-max band, one panel per key (PNG)."""
    data = {key: [(g, curves(g, key)) for g in groups] for key, _ in CURVES}
    if not any(c is not None for v in data.values() for _, c in v):
        return None
    # Optional and heavy: only the figures need matplotlib, the "plots" extra of
    # pyproject.toml (pip install -e ".[plots]"); not a runtime dependency.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.6))
    for ax, (key, title) in zip(np.atleast_1d(axes), CURVES, strict=True):
        for g, c in data[key]:
            if c is None:
                continue
            steps, v = c
            label = f"{g.label} (seeds {','.join(map(str, g.seeds))})"
            (line,) = ax.plot(
                steps, v.mean(axis=0), label=label, marker="." if len(steps) < 20 else None
            )
            ax.fill_between(steps, v.min(axis=0), v.max(axis=0), color=line.get_color(), alpha=0.2)
        ax.set(title=title, xlabel="GRPO step", ylabel=key)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------
# The command.


def compare(
    paths: Sequence[str], labels: Sequence[str] | None = None, allow_mixed_steps: bool = False
) -> tuple[list[Group], list[dict], list[dict]]:
    """(groups, group rows, paired rows) of the runs at ``paths``: every group against the
    first group of its task (:func:`task_rows` gives the table across tasks)."""
    if not paths:
        raise CompareError("give at least one run (a workdir or an evaluation file)")
    runs = [load_run(p) for p in paths]
    ks = {r.after_header.get("k") for r in runs}
    if len(ks) > 1:
        raise CompareError(
            f"the runs' evaluations use different k for pass@k: {sorted(map(str, ks))}"
        )
    k = ks.pop()
    groups = group_runs(runs, labels)
    group_table = [row for g in groups for row in group_rows(g, k, allow_mixed_steps)]
    first: dict[str, Group] = {}
    paired_table = []
    for g in groups:
        base = first.setdefault(g.task, g)
        if base is not g:
            paired_table += paired_rows(base, g, k, allow_mixed_steps)
    return groups, group_table, paired_table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m grpo_jax.compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("runs", nargs="+", help="training workdirs or eval/step_<N>.jsonl files")
    p.add_argument("--labels", default="", help="comma-separated names, one per group")
    p.add_argument("--out", default="", help="directory for compare.md, compare.tex, curves.png")
    p.add_argument(
        "--allow_mixed_steps",
        action="store_true",
        help="pool and pair evaluations of different training steps (each table names them)",
    )
    a = p.parse_args(argv)
    labels = [s.strip() for s in a.labels.split(",")] if a.labels else None
    try:
        groups, group_table, paired_table = compare(a.runs, labels, a.allow_mixed_steps)
        task_table = task_rows(groups, groups[0].runs[0].after_header.get("k"))
    except (CompareError, ValueError, OSError) as e:  # damaged files: ValueError naming them
        return cli.report_error(e, prefix="error")
    for note in (r.note for g in groups for r in g.runs if r.note):
        print(f"note: {note}", file=sys.stderr)
    md = markdown(group_table, paired_table, task_table)
    print(md, end="")
    if not a.out:
        return 0
    out = pathlib.Path(a.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(md)
        (out / "compare.tex").write_text(latex(group_table, paired_table, task_table))
        rows = {"groups": group_table, "paired": paired_table, "tasks": task_table}
        (out / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
        try:
            fig = plot(groups, out / "curves.png")
        except ImportError:
            fig = None
            print(MISSING_MATPLOTLIB)
    except CompareError as e:  # a damaged metrics.jsonl; the tables are written
        return cli.report_error(e, prefix="error")
    except OSError as e:
        where = e.filename or out
        return cli.report_error(f"cannot write --out={a.out}: {e.strerror or e} ({where})")
    print(f"wrote {out / 'compare.md'}, {out / 'compare.tex'}" + (f", {fig}" if fig else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
