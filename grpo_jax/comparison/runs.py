"""The compare command's runs: one run's evaluations read from its workdir or file, and runs
grouped by their config without the seed, a setting newer than a run read as its default
(docs/evaluation.md, "Comparing runs")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Sequence

from grpo_jax.core import problems
from grpo_jax.core.checks import flat_keys
from grpo_jax.run.config import section_defaults


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
        return task_key(self.runs[0].config)


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
    """The config as runs are grouped and paired by: no seed, and every setting the run's
    version of grpo_jax did not have yet filled in with its default
    (``grpo_jax.run.config.section_defaults``):
    a run from before a section existed ran as that section's default does."""
    c = json.loads(json.dumps(config))
    c.pop("seed", None)
    if isinstance(c.get("data"), dict):
        c["data"].pop("seed", None)
    for key, value in section_defaults().items():
        *path, last = key.split(".")
        node = c
        for part in path:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.setdefault(last, value)
    return c


TASK_SECTIONS = ("data", "env")  # what a run is evaluated on; the rest is its method


def task_key(config: dict) -> str:
    c = _without_seed(config)
    return json.dumps({k: c.get(k) for k in TASK_SECTIONS}, sort_keys=True)


def method_key(config: dict) -> str:
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
