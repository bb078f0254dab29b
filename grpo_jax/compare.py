r"""The compare command: paired differences between runs, with intervals, as tables and figures.

    python -m grpo_jax.compare RUN [RUN ...] [--labels=full,lora] [--out=DIR]

Each RUN is a training workdir (its final evaluation, ``summary.json``'s
``eval_files``, and its first one as "before") or one evaluation file
(``<workdir>/eval/step_<N>.jsonl``, ``grpo_jax.core.problems``). Runs whose configs
are the same but for the seed (``seed`` and ``data.seed``, compared by the
record's config text) form one group; its runs are pooled with the problem as
the unit (seed s's problem i is one unit). A group's label is ``--labels``'
entry or the config keys in which it differs from the first group.

For every group: greedy pass@1 (Wilson interval), sampled pass@1 and pass@k
(bootstrap over problems), before and after, and after - before paired on the
same problems (paired bootstrap). For every later group against the first:
the paired difference of each figure, runs matched by seed and each pair checked
to have evaluated the same problems (by id), with a paired bootstrap interval and,
for greedy pass@1, McNemar's exact test. The tables are printed as Markdown;
``--out`` also writes ``compare.md``, ``compare.tex`` (a LaTeX table) and
``curves.png``: the training curves of each group (mean over seeds, the band
from the lowest to the highest seed) from each workdir's ``metrics.jsonl``.

Intervals are 95% and cover the evaluation's sampling of problems and
completions for these trained models; with few training seeds they do not
cover the spread from one training seed to another (the per-seed figures in the
table show it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from grpo_jax.core import problems, stats
from grpo_jax.core.checks import flat_keys
from grpo_jax.run.writers import read_metrics

CURVES = (("rollout/pass_rate", "training pass rate"), ("eval/pass_at_1", "held-out greedy pass@1"))
MISSING_MATPLOTLIB = (
    "no curves.png: the figures need matplotlib, an optional dependency; install it with "
    "pip install -e '.[plots]' in the grpo_jax checkout (or pip install 'matplotlib>=3.8,<4')"
)


class CompareError(ValueError):
    """Runs that cannot be compared; the message names which and why."""


@dataclasses.dataclass
class Run:
    """One run's evaluations: ``after`` (and ``before``) with their file headers."""

    name: str
    seed: int
    config: dict
    after: problems.Problems
    after_header: dict
    before: problems.Problems | None = None
    workdir: pathlib.Path | None = None


@dataclasses.dataclass
class Group:
    label: str
    runs: list[Run]

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


# ---------------------------------------------------------------------------
# Loading.


def _summary_eval_files(workdir: pathlib.Path) -> dict | None:
    """``summary.json``'s ``eval_files`` (None without a summary); CompareError if unreadable."""
    summary = workdir / "summary.json"
    if not summary.is_file():
        return None
    try:
        files = json.loads(summary.read_text(encoding="utf-8")).get("eval_files")
    except (ValueError, AttributeError) as e:  # not UTF-8, not JSON, not an object
        raise CompareError(f"{summary}: not a run summary ({e})") from None
    return files if isinstance(files, dict) else {}


def _eval_file(workdir: pathlib.Path, which: str) -> pathlib.Path | None:
    files_of = _summary_eval_files(workdir)
    if files_of is not None:
        name = files_of.get(which)
        if name:
            return workdir / name
        if which == "before":
            return None
    files = sorted(
        (f for f in (workdir / "eval").glob("step_*.jsonl") if f.stem[5:].isdigit()),
        key=lambda p: int(p.stem[5:]),
    )
    if not files:
        raise CompareError(
            f"{workdir} has no evaluation files (eval/step_<N>.jsonl): a run made before "
            "they were written; evaluate it again, or pass evaluation files"
        )
    if which == "before":
        return files[0] if len(files) > 1 and files[0].stem == "step_0" else None
    return files[-1]


def load_run(path: str | pathlib.Path) -> Run:
    """A workdir's or an evaluation file's :class:`Run`; CompareError naming what is missing,
    ValueError naming the file and line of a damaged evaluation file."""
    path = pathlib.Path(path)
    if not path.exists():
        raise CompareError(f"{path} does not exist (give training workdirs or eval/*.jsonl files)")
    workdir, before = None, None
    if path.is_dir():
        workdir = path
        after_path = _eval_file(path, "after")
        before_path = _eval_file(path, "before")
        if before_path is not None:
            before = problems.read(before_path)[1]
    else:
        after_path = path
    header, after = problems.read(after_path)
    rec = header.get("record")
    if not rec:
        raise CompareError(f"{after_path} has no record of the run (header 'record')")
    try:
        seed, config = rec["seeds"]["seed"], json.loads(rec["config"])
        if isinstance(seed, bool) or not isinstance(seed, int) or not isinstance(config, dict):
            raise TypeError(f"seed {seed!r}, config {type(config).__name__}")
    except (KeyError, TypeError, ValueError) as e:
        raise CompareError(
            f"{after_path}:1: the header's record has no readable seed and config "
            f"('record': {{'seeds': {{'seed': <int>}}, 'config': <JSON text>}}; {e!r})"
        ) from None
    return Run(
        name=str(path),
        seed=seed,
        config=config,
        after=after,
        after_header=header,
        before=before,
        workdir=workdir,
    )


def _without_seed(config: dict) -> dict:
    c = json.loads(json.dumps(config))
    c.pop("seed", None)
    if isinstance(c.get("data"), dict):
        c["data"].pop("seed", None)
    return c


def group_runs(runs: Sequence[Run], labels: Sequence[str] | None = None) -> list[Group]:
    """Runs grouped by their config without the seed, in the order first seen."""
    by_key: dict[str, list[Run]] = {}
    for r in runs:
        text = json.dumps(_without_seed(r.config), sort_keys=True)
        by_key.setdefault(hashlib.sha256(text.encode()).hexdigest(), []).append(r)
    groups = list(by_key.values())
    for g in groups:
        seeds = [r.seed for r in g]
        if len(set(seeds)) != len(seeds):
            names = [r.name for r in g]
            raise CompareError(f"runs {names} have the same config and the same seeds {seeds}")
        g.sort(key=lambda r: r.seed)
    if labels is not None and len(labels) != len(groups):
        raise CompareError(f"--labels names {len(labels)} groups, but the runs form {len(groups)}")
    base = flat_keys(_without_seed(groups[0][0].config))
    out = []
    for i, g in enumerate(groups):
        if labels is not None:
            label = labels[i]
        else:
            flat = flat_keys(_without_seed(g[0].config))
            diff = [
                f"{k}={flat.get(k)}"
                for k in sorted(set(base) | set(flat))
                if base.get(k) != flat.get(k)
            ]
            label = ", ".join(diff) if diff else "baseline"
        out.append(Group(label, g))
    return out


# ---------------------------------------------------------------------------
# Pooling and figures.


def pool(probs: Sequence[problems.Problems], seeds: Sequence[int]) -> problems.Problems:
    """Several runs' evaluations as one, each (run seed, problem) a unit."""
    first = probs[0]
    for p in probs[1:]:
        if p.seeds != first.seeds or p.num_samples != first.num_samples:
            raise CompareError(
                f"evaluations with different sampling (seeds {first.seeds} vs {p.seeds}, "
                f"{first.num_samples} vs {p.num_samples} samples per problem) cannot be pooled"
            )
    cat = lambda f: np.concatenate([getattr(p, f) for p in probs])
    kw = {}
    if first.num_samples:
        kw = dict(
            seeds=first.seeds,
            sampled_correct=np.concatenate([p.sampled_correct for p in probs], axis=1),
            sampled_length=np.concatenate([p.sampled_length for p in probs], axis=1),
        )
    return problems.Problems(
        ids=tuple(f"{s}:{i}" for s, p in zip(seeds, probs, strict=True) for i in p.ids),
        greedy_correct=cat("greedy_correct"),
        greedy_length=cat("greedy_length"),
        greedy_truncated=cat("greedy_truncated"),
        **kw,
    )


def per_problem(prob: problems.Problems, k: int | None) -> dict[str, np.ndarray]:
    """Each figure's per-problem values: greedy 0/1, sampled share, pass@k."""
    out = {"greedy pass@1": prob.greedy_correct.astype(np.float64)}
    if prob.num_samples:
        pooled = prob.pooled_correct()
        out["sampled pass@1"] = pooled.mean(axis=1)
        if k:
            out[f"pass@{k}"] = stats.pass_at_k_values(pooled, k)
    return out


def _interval(name: str, v: np.ndarray) -> tuple[float, float]:
    if name == "greedy pass@1":
        return stats.wilson_interval(int(v.sum()), v.size)
    return stats.bootstrap_interval(v)


def _check_same_problems(a: problems.Problems, b: problems.Problems, what: str) -> None:
    if a.ids != b.ids:
        differ = len(set(a.ids) ^ set(b.ids))
        raise CompareError(
            f"{what} were evaluated on different problems ({len(a.ids)} and {len(b.ids)} "
            f"problems, {differ} ids in only one of them, or another order): a paired "
            "comparison needs the same problems (the same data and eval settings)"
        )


def group_rows(g: Group, k: int | None) -> list[dict]:
    """One row per figure: before, after (each with its interval), after - before paired."""
    after = pool([r.after for r in g.runs], g.seeds)
    has_before = all(r.before is not None for r in g.runs)
    before = pool([r.before for r in g.runs], g.seeds) if has_before else None
    if before is not None:
        _check_same_problems(before, after, f"{g.label}'s before and after evaluations")
    per_seed = [per_problem(r.after, k) for r in g.runs]
    rows = []
    for name, a in per_problem(after, k).items():
        row = {"group": g.label, "seeds": g.seeds, "problems": a.size, "metric": name}
        row["after"] = (float(a.mean()), *_interval(name, a))
        row["per_seed"] = [float(s[name].mean()) for s in per_seed]
        if before is not None and name in (bv := per_problem(before, k)):
            b = bv[name]
            row["before"] = (float(b.mean()), *_interval(name, b))
            row["change"] = (float((a - b).mean()), *stats.paired_bootstrap_interval(b, a))
        rows.append(row)
    return rows


def paired_rows(base: Group, other: Group, k: int | None) -> list[dict]:
    """``other`` - ``base`` per figure on the same problems, runs matched by seed."""
    by_seed = {r.seed: r for r in base.runs}
    missing = [s for s in other.seeds if s not in by_seed]
    if missing:
        raise CompareError(
            f"{other.label!r} has seeds {missing} that {base.label!r} lacks (seeds "
            f"{base.seeds}): paired comparisons match runs by seed"
        )
    pairs = [(by_seed[r.seed], r) for r in other.runs]
    for a, b in pairs:
        _check_same_problems(a.after, b.after, f"{a.name} and {b.name}")
    seeds = [b.seed for _, b in pairs]
    va = per_problem(pool([a.after for a, _ in pairs], seeds), k)
    vb = per_problem(pool([b.after for _, b in pairs], seeds), k)
    rows = []
    for name in va:
        if name not in vb:
            continue
        a, b = va[name], vb[name]
        row = {"base": base.label, "other": other.label, "metric": name, "seeds": seeds}
        row.update(problems=a.size, base_value=float(a.mean()), other_value=float(b.mean()))
        row["diff"] = (float((b - a).mean()), *stats.paired_bootstrap_interval(a, b))
        if name == "greedy pass@1":
            row["mcnemar"] = stats.mcnemar_exact(a.astype(bool), b.astype(bool))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Tables.


def _ci(v, signed=False) -> str:
    if v is None:
        return "-"
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(v[0])} [{f.format(v[1])}, {f.format(v[2])}]"


def _seeds(s) -> str:
    return ",".join(str(x) for x in s)


def markdown(group_table: list[dict], paired_table: list[dict]) -> str:
    lines = [
        "| run | seeds | problems | metric | before [95% CI] | after [95% CI] | after by seed "
        "| after - before [95% CI] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in group_table:
        lines.append(
            f"| {r['group']} | {_seeds(r['seeds'])} | {r['problems']} | {r['metric']} | "
            f"{_ci(r.get('before'))} | {_ci(r['after'])} | "
            f"{' / '.join(f'{x:.3f}' for x in r['per_seed'])} | {_ci(r.get('change'), True)} |"
        )
    if paired_table:
        lines += [
            "",
            "| comparison | seeds | problems | metric | base | other | other - base [95% CI] "
            "| McNemar p (only base / only other) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in paired_table:
            m = r.get("mcnemar")
            test = "-" if m is None else f"{m['p_value']:.3g} ({m['only_a']} / {m['only_b']})"
            lines.append(
                f"| {r['other']} vs {r['base']} | {_seeds(r['seeds'])} | {r['problems']} | "
                f"{r['metric']} | {r['base_value']:.3f} | {r['other_value']:.3f} | "
                f"{_ci(r['diff'], True)} | {test} |"
            )
    return "\n".join(lines) + "\n"


def _tex(s: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("_", r"\_"), ("&", r"\&"), ("%", r"\%"),
                 ("#", r"\#"), ("$", r"\$")):  # fmt: skip
        s = s.replace(a, b)
    return s


def _tex_ci(v, signed=False) -> str:
    if v is None:
        return "--"
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"${f.format(v[0])}$ {{\\small[${f.format(v[1])}$, ${f.format(v[2])}$]}}"


def latex(group_table: list[dict], paired_table: list[dict]) -> str:
    """The tables as LaTeX tabulars (booktabs), 95% intervals in brackets."""
    out = [
        "% grpo_jax.compare: 95% intervals; greedy pass@1 Wilson, others bootstrap over problems.",
        r"\begin{tabular}{llrlccc}",
        r"\toprule",
        r"run & seeds & problems & metric & before & after & after $-$ before \\",
        r"\midrule",
    ]
    for r in group_table:
        out.append(
            f"{_tex(r['group'])} & {_seeds(r['seeds'])} & {r['problems']} & {_tex(r['metric'])} & "
            f"{_tex_ci(r.get('before'))} & {_tex_ci(r['after'])} & "
            f"{_tex_ci(r.get('change'), True)} \\\\"
        )
    out += [r"\bottomrule", r"\end{tabular}"]
    if paired_table:
        out += [
            "",
            r"\begin{tabular}{lrlcccc}",
            r"\toprule",
            r"comparison & problems & metric & base & other & other $-$ base & McNemar $p$ \\",
            r"\midrule",
        ]
        for r in paired_table:
            m = r.get("mcnemar")
            test = "--" if m is None else f"{m['p_value']:.3g}"
            out.append(
                f"{_tex(r['other'])} vs {_tex(r['base'])} & {r['problems']} & "
                f"{_tex(r['metric'])} & ${r['base_value']:.3f}$ & ${r['other_value']:.3f}$ & "
                f"{_tex_ci(r['diff'], True)} & {test} \\\\"
            )
        out += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(out) + "\n"


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
            label = f"{g.label} (seeds {_seeds(g.seeds)})"
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
    paths: Sequence[str], labels: Sequence[str] | None = None
) -> tuple[list[Group], list[dict], list[dict]]:
    """(groups, group rows, paired rows) of the runs at ``paths``."""
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
    group_table = [row for g in groups for row in group_rows(g, k)]
    paired_table = [row for g in groups[1:] for row in paired_rows(groups[0], g, k)]
    return groups, group_table, paired_table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m grpo_jax.compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("runs", nargs="+", help="training workdirs or eval/step_<N>.jsonl files")
    p.add_argument("--labels", default="", help="comma-separated names, one per group")
    p.add_argument("--out", default="", help="directory for compare.md, compare.tex, curves.png")
    a = p.parse_args(argv)
    labels = [s.strip() for s in a.labels.split(",")] if a.labels else None
    try:
        groups, group_table, paired_table = compare(a.runs, labels)
    except (CompareError, ValueError, OSError) as e:  # damaged files: ValueError naming them
        print(f"error: {e}", file=sys.stderr)
        return 2
    md = markdown(group_table, paired_table)
    print(md, end="")
    if not a.out:
        return 0
    out = pathlib.Path(a.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(md)
        (out / "compare.tex").write_text(latex(group_table, paired_table))
        rows = {"groups": group_table, "paired": paired_table}
        (out / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
        try:
            fig = plot(groups, out / "curves.png")
        except ImportError:
            fig = None
            print(MISSING_MATPLOTLIB)
    except CompareError as e:  # a damaged metrics.jsonl; the tables are written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = e.filename or out
        print(f"error: cannot write --out={a.out}: {e.strerror or e} ({where})", file=sys.stderr)
        return 2
    print(f"wrote {out / 'compare.md'}, {out / 'compare.tex'}" + (f", {fig}" if fig else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
