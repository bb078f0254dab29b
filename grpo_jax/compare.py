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
import dataclasses
import hashlib
import json
import pathlib
import re
import sys
from collections.abc import Sequence

import numpy as np

from grpo_jax import cli
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
    """One run's evaluations: ``after`` (and ``before``) with their file headers and steps.

    ``note``: which evaluation file a workdir without ``summary.json`` gave (None with one).
    """

    name: str
    seed: int
    config: dict
    after: problems.Problems
    after_header: dict
    before: problems.Problems | None = None
    workdir: pathlib.Path | None = None
    after_step: int | None = None
    before_step: int | None = None
    note: str | None = None


@dataclasses.dataclass
class Group:
    label: str
    runs: list[Run]

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]

    @property
    def task(self) -> str:
        return _task_key(self.runs[0].config)


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


def _step(header: dict, path: pathlib.Path) -> int | None:
    """The header's ``step`` (None where it has none: a Hugging Face model's evaluation)."""
    step = header.get("step")
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CompareError(f"{path}:1: the header's 'step' is {json.dumps(step)}, not a step")
    return step


def load_run(path: str | pathlib.Path) -> Run:
    """A workdir's or an evaluation file's :class:`Run`; CompareError naming what is missing,
    ValueError naming the file and line of a damaged evaluation file."""
    path = pathlib.Path(path)
    if not path.exists():
        raise CompareError(f"{path} does not exist (give training workdirs or eval/*.jsonl files)")
    workdir, before, before_step, note = None, None, None, None
    if path.is_dir():
        workdir = path
        after_path = _eval_file(path, "after")
        before_path = _eval_file(path, "before")
        if before_path is not None:
            before_header, before = problems.read(before_path)
            before_step = _step(before_header, before_path)
        if _summary_eval_files(path) is None:
            took = after_path.relative_to(path)
            also = "" if before_path is None else f" and {before_path.relative_to(path)} as before"
            note = (
                f"{path} has no summary.json (a run that stopped early): took its last "
                f"evaluation, {took}, as after{also}"
            )
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
        after_step=_step(header, after_path),
        before_step=before_step,
        note=note,
    )


def _without_seed(config: dict) -> dict:
    c = json.loads(json.dumps(config))
    c.pop("seed", None)
    if isinstance(c.get("data"), dict):
        c["data"].pop("seed", None)
    return c


TASK_SECTIONS = ("data", "env")  # what a run is evaluated on; the rest is its method


def _task_key(config: dict) -> str:
    c = _without_seed(config)
    return json.dumps({k: c.get(k) for k in TASK_SECTIONS}, sort_keys=True)


def _method_key(config: dict) -> str:
    c = _without_seed(config)
    return json.dumps({k: v for k, v in c.items() if k not in TASK_SECTIONS}, sort_keys=True)


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
# Pooling, units and figures.

MIN_SEEDS_ACROSS = 3  # seeds needed for the intervals across training seeds

LAYOUTS = {
    "one run": "one run",
    "shared": "seeds share problems",
    "per seed": "each seed its own problems",
    "overlapping": "some problems in several seeds",
}


@dataclasses.dataclass(frozen=True)
class Units:
    """The pooled units (seed, problem) of one or more runs: each unit's training seed and
    problem id, and how the seeds' problems relate (``layout``, a key of LAYOUTS)."""

    seeds: np.ndarray  # int [U]
    ids: np.ndarray  # str [U]
    layout: str

    @property
    def strata(self) -> np.ndarray | None:
        """Seeds with problems of their own keep their number of problems in a resample."""
        return self.seeds if self.layout == "per seed" else None

    @property
    def num_problems(self) -> int:
        return int(np.unique(self.ids).size)

    @property
    def num_seeds(self) -> int:
        return int(np.unique(self.seeds).size)


def layout_of(ids_by_seed: Sequence[Sequence[str]]) -> str:
    """How several seeds' evaluations relate, from their problem ids (module doc)."""
    sets = [set(ids) for ids in ids_by_seed]
    if len(sets) == 1:
        return "one run"
    if all(s == sets[0] for s in sets[1:]):
        return "shared"
    seen: set[str] = set()
    for s in sets:
        if seen & s:
            return "overlapping"
        seen |= s
    return "per seed"


def units_of(probs: Sequence[problems.Problems], seeds: Sequence[int]) -> Units:
    """The units of ``probs`` (one evaluation per seed) pooled in the order of :func:`pool`."""
    return Units(
        seeds=np.concatenate([np.full(len(p.ids), s) for s, p in zip(seeds, probs, strict=True)]),
        ids=np.concatenate([np.asarray(p.ids, dtype=object) for p in probs]).astype(str),
        layout=layout_of([p.ids for p in probs]),
    )


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


def interval_name(units: Units, metric: str) -> str:
    """The interval a table shows for ``metric`` over ``units`` (module doc)."""
    if units.layout == "one run":
        return "Wilson" if metric == "greedy pass@1" else "bootstrap"
    return {"per seed": "stratified bootstrap"}.get(units.layout, "cluster bootstrap")


def interval(units: Units, metric: str, values: np.ndarray) -> tuple[float, float]:
    """The 95% interval of the mean of ``values`` (one per unit), as :func:`interval_name`."""
    if interval_name(units, metric) == "Wilson":
        return stats.wilson_interval(int(values.sum()), values.size)
    return stats.cluster_bootstrap_interval(values, units.ids, units.strata)


def _test_scale(metric: str, num_samples: int) -> int:
    """What makes a unit's difference an integer (exact sign-flip test): 1 for greedy 0/1,
    the samples per problem for sampled shares; 0 where none does (pass@k)."""
    return {"greedy pass@1": 1, "sampled pass@1": num_samples}.get(metric, 0)


def paired_test(units: Units, diffs: np.ndarray, scale: int) -> dict:
    """The paired test of ``diffs`` (other - base, one per unit) that respects clusters."""
    d = np.round(diffs * scale) if scale else diffs
    out = stats.cluster_sign_flip_test(d, units.ids)
    singletons = out["clusters"] == diffs.size
    out["name"] = "McNemar" if singletons and scale == 1 else "sign-flip"
    return out


def across_seeds(units: Units, values: np.ndarray, diff: bool = False) -> dict | None:
    """The interval across training seeds of a figure (a share) or, with ``diff``, of a
    difference of two (None with fewer than MIN_SEEDS_ACROSS seeds)."""
    if units.num_seeds < MIN_SEEDS_ACROSS:
        return None
    bounds = (-1.0, 1.0) if diff else (0.0, 1.0)
    return stats.across_seeds_interval(values, units.seeds, units.ids, units.strata, bounds=bounds)


def _check_same_problems(a: problems.Problems, b: problems.Problems, what: str) -> None:
    if a.ids != b.ids:
        differ = len(set(a.ids) ^ set(b.ids))
        raise CompareError(
            f"{what} were evaluated on different problems ({len(a.ids)} and {len(b.ids)} "
            f"problems, {differ} ids in only one of them, or another order): a paired "
            "comparison needs the same problems (the same data and eval settings)"
        )


def _check_same_step(runs: Sequence[tuple[Run, int | None]], what: str, allow: bool) -> None:
    """CompareError when ``runs``' evaluations (run, step) come from different steps."""
    steps = {step for _, step in runs}
    if allow or len(steps) <= 1:
        return
    shown = ", ".join(f"{r.name} at step {'?' if s is None else s}" for r, s in runs)
    raise CompareError(
        f"{what} are evaluations of different steps ({shown}): pooling or pairing them "
        "would credit the difference to the runs' configs; evaluate them at one step, or pass "
        "--allow_mixed_steps to compare them anyway (the tables name each run's step)"
    )


def group_rows(g: Group, k: int | None, allow_mixed_steps: bool = False) -> list[dict]:
    """One row per figure: before, after (each with its interval), after - before paired."""
    _check_same_step([(r, r.after_step) for r in g.runs], f"{g.label!r}'s runs", allow_mixed_steps)
    after = pool([r.after for r in g.runs], g.seeds)
    units = units_of([r.after for r in g.runs], g.seeds)
    has_before = all(r.before is not None for r in g.runs)
    before = None
    if has_before:
        _check_same_step(
            [(r, r.before_step) for r in g.runs], f"{g.label!r}'s before evaluations",
            allow_mixed_steps,
        )  # fmt: skip
        before = pool([r.before for r in g.runs], g.seeds)
        _check_same_problems(before, after, f"{g.label!r}'s before and after evaluations")
    per_seed = [per_problem(r.after, k) for r in g.runs]
    steps = {
        "after": [r.after_step for r in g.runs],
        "before": [r.before_step for r in g.runs] if has_before else None,
    }
    bv = per_problem(before, k) if before is not None else {}
    rows = []
    for name, a in per_problem(after, k).items():
        row = {"group": g.label, "seeds": g.seeds, "steps": steps, "metric": name}
        row.update(problems=units.num_problems, units=a.size, layout=units.layout)
        row["interval"] = interval_name(units, name)
        row["after"] = (float(a.mean()), *interval(units, name, a))
        row["per_seed"] = [float(s[name].mean()) for s in per_seed]
        if name in bv:
            b = bv[name]
            row["before"] = (float(b.mean()), *interval(units, name, b))
            change = stats.cluster_bootstrap_interval(a - b, units.ids, units.strata)
            row["change"] = (float((a - b).mean()), *change)
        across = across_seeds(units, a)
        if across is not None:
            row["across_seeds"] = {"after": across}
            if name in bv:
                row["across_seeds"]["change"] = across_seeds(units, a - bv[name], diff=True)
        rows.append(row)
    return rows


def paired_rows(
    base: Group, other: Group, k: int | None, allow_mixed_steps: bool = False
) -> list[dict]:
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
        _check_same_step(
            [(a, a.after_step), (b, b.after_step)], f"{a.name} and {b.name}", allow_mixed_steps
        )
    seeds = [b.seed for _, b in pairs]
    units = units_of([a.after for a, _ in pairs], seeds)
    va = per_problem(pool([a.after for a, _ in pairs], seeds), k)
    vb = per_problem(pool([b.after for _, b in pairs], seeds), k)
    per_seed_a = [per_problem(a.after, k) for a, _ in pairs]
    per_seed_b = [per_problem(b.after, k) for _, b in pairs]
    num_samples = pairs[0][0].after.num_samples
    steps = {"base": [a.after_step for a, _ in pairs], "other": [b.after_step for _, b in pairs]}
    rows = []
    for name in va:
        if name not in vb:
            continue
        a, b = va[name], vb[name]
        row = {"base": base.label, "other": other.label, "metric": name, "seeds": seeds}
        row.update(steps=steps, problems=units.num_problems, units=a.size, layout=units.layout)
        row.update(base_value=float(a.mean()), other_value=float(b.mean()))
        row["interval"] = "bootstrap" if units.layout == "one run" else interval_name(units, name)
        diff = stats.cluster_bootstrap_interval(b - a, units.ids, units.strata)
        row["diff"] = (float((b - a).mean()), *diff)
        row["test"] = paired_test(units, b - a, _test_scale(name, num_samples))
        across = across_seeds(units, b - a, diff=True)
        if across is not None:
            row["across_seeds"] = {"diff": across}
            row["p_improvement"] = stats.probability_of_improvement(
                [s[name].mean() for s in per_seed_a], [s[name].mean() for s in per_seed_b]
            )
        rows.append(row)
    return rows


def task_rows(groups: Sequence[Group], k: int | None) -> list[dict]:
    """With runs on several tasks: each method's interquartile mean over its runs on every
    task (rliable's stratified bootstrap interval) and, against the first method, the
    probability of improvement averaged over tasks. Only methods run on every task."""
    tasks = list(dict.fromkeys(g.task for g in groups))
    if len(tasks) < 2:
        return []
    methods: dict[str, dict[str, Group]] = {}
    for g in groups:
        methods.setdefault(_method_key(g.runs[0].config), {}).setdefault(g.task, g)
    full = [(m, by_task) for m, by_task in methods.items() if set(by_task) == set(tasks)]
    if not full:
        return []
    base_key, base = full[0]
    # The method's per-run figures on each task: {metric: [task][run]}.
    figs = {
        m: {
            name: [
                np.array([per_problem(r.after, k)[name].mean() for r in by_task[t].runs])
                for t in tasks
            ]
            for name in per_problem(by_task[tasks[0]].runs[0].after, k)
        }
        for m, by_task in full
    }
    rows = []
    for m, by_task in full:
        label = by_task[tasks[0]].label
        for name, per_task in figs[m].items():
            row = {"method": label, "tasks": len(tasks), "metric": name}
            row["runs"] = sum(v.size for v in per_task)
            row["iqm"] = (
                stats.interquartile_mean(np.concatenate(per_task)),
                *stats.stratified_bootstrap_interval(per_task),
            )
            if m != base_key and name in figs[base_key]:
                row["base"] = base[tasks[0]].label
                row["p_improvement"] = float(
                    np.mean(
                        [
                            stats.probability_of_improvement(b, o)
                            for b, o in zip(figs[base_key][name], per_task, strict=True)
                        ]
                    )
                )
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Tables.

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
        "the first method."
    ),
}


def _num(x, signed=False) -> str:
    return ("{:+.3f}" if signed else "{:.3f}").format(x)


def _ci(v, signed=False) -> str:
    if v is None:
        return "-"
    return f"{_num(v[0], signed)} [{_num(v[1], signed)}, {_num(v[2], signed)}]"


def _across(a: dict | None, signed=False) -> str:
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


def tables(
    group_table: list[dict], paired_table: list[dict], task_table: Sequence[dict] = ()
) -> list[dict]:
    """The tables as {caption, header, rows} of text cells, for Markdown and LaTeX."""
    out = [
        {
            "caption": CAPTIONS["groups"],
            "header": [
                "run",
                "seeds",
                "steps",
                "problems",
                "units",
                "metric",
                "interval",
                "before [95% CI]",
                "after [95% CI]",
                "after by seed",
                "after - before [95% CI]",
            ],  # fmt: skip
            "rows": [
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
            ],  # fmt: skip
        }
    ]
    if paired_table:
        out.append(
            {
                "caption": CAPTIONS["paired"],
                "header": [
                    "comparison",
                    "seeds",
                    "steps (base / other)",
                    "problems",
                    "metric",
                    "interval",
                    "base",
                    "other",
                    "other - base [95% CI]",
                    "paired test p (base / other better)",
                ],  # fmt: skip
                "rows": [
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
                ],  # fmt: skip
            }
        )
    across = [r for r in group_table if "across_seeds" in r]
    if across:
        out.append(
            {
                "caption": CAPTIONS["across"],
                "header": [
                    "run",
                    "seeds",
                    "steps",
                    "metric",
                    "after [95% CI across seeds]",
                    "sd between seeds",
                    "after - before [95% CI across seeds]",
                ],  # fmt: skip
                "rows": [
                    [
                        r["group"],
                        _seeds(r["seeds"]),
                        _steps(r["steps"]["after"]),
                        r["metric"],
                        _across(r["across_seeds"]["after"]),
                        _num(r["across_seeds"]["after"]["between"]),
                        _across(r["across_seeds"].get("change"), True),
                    ]
                    for r in across
                ],  # fmt: skip
            }
        )
    across = [r for r in paired_table if "across_seeds" in r]
    if across:
        out.append(
            {
                "caption": CAPTIONS["paired_across"],
                "header": [
                    "comparison",
                    "seeds",
                    "metric",
                    "other - base [95% CI across seeds]",
                    "sd between seeds",
                    "P(other > base)",
                ],  # fmt: skip
                "rows": [
                    [
                        f"{r['other']} vs {r['base']}",
                        _seeds(r["seeds"]),
                        r["metric"],
                        _across(r["across_seeds"]["diff"], True),
                        _num(r["across_seeds"]["diff"]["between"]),
                        f"{r['p_improvement']:.2f}",
                    ]
                    for r in across
                ],  # fmt: skip
            }
        )
    if task_table:
        out.append(
            {
                "caption": CAPTIONS["tasks"],
                "header": [
                    "method",
                    "tasks",
                    "runs",
                    "metric",
                    "IQM [95% CI]",
                    "P(improvement) vs first",
                ],  # fmt: skip
                "rows": [
                    [
                        r["method"],
                        str(r["tasks"]),
                        str(r["runs"]),
                        r["metric"],
                        _ci(r["iqm"]),
                        "-" if "p_improvement" not in r else f"{r['p_improvement']:.2f}",
                    ]
                    for r in task_table
                ],  # fmt: skip
            }
        )
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
