"""The compare command's figures: runs pooled into units, the intervals and paired tests that
respect how the seeds' problems relate, and the rows of its tables (docs/evaluation.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from grpo_jax.comparison.runs import CompareError, Group, Run, method_key
from grpo_jax.core import problems, stats

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
        methods.setdefault(method_key(g.runs[0].config), {}).setdefault(g.task, g)
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
            row["steps"] = [r.after_step for t in tasks for r in by_task[t].runs]
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
