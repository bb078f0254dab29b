"""Per-problem evaluation results, their figures with intervals, and their JSONL file.

An evaluation of P problems is a :class:`Problems`: each problem's id (a hash
of its prompt and answer, so two runs can be checked to have seen the same
problems), its greedy completion's correctness, length and truncation and, for
each sampling seed (``eval.seeds``), n sampled completions' correctness and
lengths. :func:`figures` turns it into the evaluation's metrics, each with a 95%
interval whose unit is the problem (``grpo_jax.core.stats``):

  ``pass_at_1``          greedy, Wilson interval (``_lo``/``_hi``) and the exact
                         Clopper-Pearson one (``_cp_lo``/``_cp_hi``)
  ``sampled_pass_at_1``  mean over problems of the share of its samples that are
                         correct, every seed's samples pooled; bootstrap over problems
  ``pass_at_k``          mean over problems of Chen et al.'s unbiased pass@k from all
                         of its S x n samples; bootstrap over problems

These intervals cover the sampling of problems and completions for the one trained
model evaluated, not the spread between training seeds; ``grpo_jax.compare`` pools
seeds (resampling a problem with all its seeds when they share it) and gives intervals
across training seeds.

The file (``<workdir>/eval/step_<N>.jsonl``) has one header line,
``{"header": {...}}`` (the figures, k, the seeds and the run's record), then one
line per problem:

  {"index": 0, "id": "3f1c...", "greedy": {"correct": true, "length": 4,
   "truncated": false}, "sampled": [{"seed": 0, "correct": [...], "length": [...]}]}

:func:`read` checks every field: a correctness or truncation flag is a JSON bool
or the number 0 or 1 (a string such as "false", or NaN, an unscored result, is
refused), a length a count, and every problem has the same seeds and samples. A
bad line, a truncated or binary file is one ValueError naming the file and line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from grpo_jax.core import stats

CONFIDENCE = 0.95


def problem_id(example: Mapping) -> str:
    """A stable id of a problem: the first 16 hex digits of sha256 of its prompt and answer."""
    text = json.dumps(
        {"prompt": example.get("prompt"), "answer": example.get("answer")}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Problems:
    """One evaluation, problem by problem (P problems, S seeds, n samples per seed).

    ``sampled_correct`` / ``sampled_length``: [S, P, n] (n = 0: no sampling).
    """

    ids: tuple[str, ...]
    greedy_correct: np.ndarray  # bool [P]
    greedy_length: np.ndarray  # int [P]
    greedy_truncated: np.ndarray  # bool [P]
    seeds: tuple[int, ...] = ()
    sampled_correct: np.ndarray | None = None  # bool [S, P, n]
    sampled_length: np.ndarray | None = None  # int [S, P, n]

    def __post_init__(self):
        p = len(self.ids)
        for name in ("greedy_correct", "greedy_length", "greedy_truncated"):
            if np.shape(getattr(self, name)) != (p,):
                raise ValueError(f"{name} has shape {np.shape(getattr(self, name))}, not ({p},)")
        if self.sampled_correct is not None:
            s = np.shape(self.sampled_correct)
            if len(s) != 3 or s[:2] != (len(self.seeds), p):
                raise ValueError(f"sampled_correct has shape {s}, not ({len(self.seeds)}, {p}, n)")

    @property
    def num_samples(self) -> int:
        """Samples per problem over all seeds (S x n); 0 without sampling."""
        if self.sampled_correct is None:
            return 0
        s, _, n = self.sampled_correct.shape
        return s * n

    def pooled_correct(self) -> np.ndarray:
        """bool [P, S x n]: each problem's samples of every seed, seed by seed."""
        return np.concatenate(list(self.sampled_correct), axis=1)


def figures(
    prob: Problems, k: int | None, prefix: str = "eval", confidence: float = CONFIDENCE
) -> dict[str, float]:
    """The evaluation's metrics and their intervals (module doc), keyed ``{prefix}/...``."""
    p = len(prob.ids)
    if p == 0:
        raise ValueError("an evaluation needs at least one problem")
    c = int(prob.greedy_correct.sum())
    out = {
        f"{prefix}/pass_at_1": c / p,
        f"{prefix}/length_mean": float(np.mean(prob.greedy_length)),
        f"{prefix}/truncated_frac": float(np.mean(prob.greedy_truncated)),
        f"{prefix}/num_problems": float(p),
    }
    _put(out, f"{prefix}/pass_at_1", stats.wilson_interval(c, p, confidence))
    _put(out, f"{prefix}/pass_at_1_cp", stats.clopper_pearson_interval(c, p, confidence))
    if prob.num_samples:
        pooled = prob.pooled_correct()
        out[f"{prefix}/num_seeds"] = float(len(prob.seeds))
        per_problem = {"sampled_pass_at_1": pooled.mean(axis=1)}
        if k:
            per_problem["pass_at_k"] = stats.pass_at_k_values(pooled, k)
        for name, v in per_problem.items():
            out[f"{prefix}/{name}"] = float(v.mean())
            _put(out, f"{prefix}/{name}", stats.bootstrap_interval(v, confidence))
        if k and k != 1:  # pass_at_1 is the greedy figure; never overwrite it.
            out[f"{prefix}/pass_at_{k}"] = out[f"{prefix}/pass_at_k"]
    return out


def _put(out: dict, name: str, interval: tuple[float, float]) -> None:
    out[f"{name}_lo"], out[f"{name}_hi"] = interval


# ---------------------------------------------------------------------------
# The file.


def to_lines(prob: Problems) -> list[dict]:
    """One JSON-ready dict per problem (the module doc's layout)."""
    lines = []
    for i, pid in enumerate(prob.ids):
        line = {
            "index": i,
            "id": pid,
            "greedy": {
                "correct": bool(prob.greedy_correct[i]),
                "length": int(prob.greedy_length[i]),
                "truncated": bool(prob.greedy_truncated[i]),
            },
        }
        if prob.num_samples:
            line["sampled"] = [
                {
                    "seed": int(seed),
                    "correct": [bool(x) for x in prob.sampled_correct[j, i]],
                    "length": [int(x) for x in prob.sampled_length[j, i]],
                }
                for j, seed in enumerate(prob.seeds)
            ]
        lines.append(line)
    return lines


def write(path: str | pathlib.Path, prob: Problems, header: Mapping) -> pathlib.Path:
    """Writes the header line and one line per problem to ``path`` (parents made)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"header": dict(header)}, *to_lines(prob)]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    tmp.replace(path)
    return path


def read(path: str | pathlib.Path) -> tuple[dict, Problems]:
    """(header, problems) of a file :func:`write` wrote; ValueError naming the file, the line
    and what is wrong (not UTF-8, not JSON, a field of the wrong type, fewer problems than the
    header counts: a truncated file)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no evaluation file {path}")
    rows, linenos = [], []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at column "
                f"{e.start + 1}): not an evaluation file, or a damaged one"
            ) from None
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{lineno}: not JSON ({e.msg}, column {e.colno}): a truncated or damaged "
                "evaluation file"
            ) from None
        linenos.append(lineno)
    if not rows or not isinstance(rows[0], dict) or not isinstance(rows[0].get("header"), dict):
        raise ValueError(f"{path} is not an evaluation file: its first line has no 'header'")
    header = rows[0]["header"]
    prob = from_lines(rows[1:], where=str(path), linenos=linenos[1:])
    figures_ = header.get("figures")
    counted = [
        v
        for k, v in (figures_.items() if isinstance(figures_, dict) else ())
        if k.endswith("/num_problems") and isinstance(v, (int, float))
    ]
    if counted and counted[0] != len(prob.ids):
        raise ValueError(
            f"{path} holds {len(prob.ids)} problems, but its header counts {counted[0]:g}: a "
            "truncated evaluation file"
        )
    return header, prob


def _bool(value, what: str) -> bool:
    """A correctness or truncation flag: a JSON bool, or the number 0 or 1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    why = " (NaN: unscored)" if isinstance(value, float) and value != value else ""
    raise ValueError(f"{what} is {json.dumps(value)}{why}, not true/false (or 0/1)")


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} is {json.dumps(value)}, not a token count")
    return value


def _problem(line):
    """(id, greedy (correct, length, truncated), sampled [(seed, corrects, lengths)] or None)
    of one problem's line, each field checked."""
    if not isinstance(line, dict):
        raise ValueError(f"the line is a JSON {type(line).__name__}, not a problem's object")
    pid, g = line.get("id"), line.get("greedy")
    if not isinstance(pid, str):
        raise ValueError(f"'id' is {json.dumps(pid)}, not a string")
    if not isinstance(g, dict):
        raise ValueError(f"'greedy' is {json.dumps(g)}, not an object")
    greedy = (
        _bool(g.get("correct"), "greedy 'correct'"),
        _count(g.get("length"), "greedy 'length'"),
        _bool(g.get("truncated"), "greedy 'truncated'"),
    )
    if "sampled" not in line:
        return pid, greedy, None
    sampled = line["sampled"]
    if (
        not isinstance(sampled, list)
        or not sampled
        or not all(isinstance(x, dict) for x in sampled)
    ):
        raise ValueError(f"'sampled' is {json.dumps(sampled)[:80]}, not a list of seeds' objects")
    out = []
    for x in sampled:
        seed, c, ln = x.get("seed"), x.get("correct"), x.get("length")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"a sampled 'seed' is {json.dumps(seed)}, not an integer")
        if not isinstance(c, list) or not isinstance(ln, list) or not c or len(c) != len(ln):
            raise ValueError(
                f"seed {seed}'s 'correct' and 'length' must be lists of one value per sample, "
                f"got {json.dumps(c)[:40]} and {json.dumps(ln)[:40]}"
            )
        corrects = [_bool(v, f"seed {seed}'s 'correct'[{j}]") for j, v in enumerate(c)]
        lengths = [_count(v, f"seed {seed}'s 'length'[{j}]") for j, v in enumerate(ln)]
        out.append((seed, corrects, lengths))
    counts = {len(c) for _, c, _ in out}
    if len(counts) > 1:
        raise ValueError(
            f"its seeds have {'/'.join(str(len(c)) for _, c, _ in out)} samples (seed "
            f"{'/'.join(str(seed) for seed, _, _ in out)}): every seed needs the same number"
        )
    return pid, greedy, out


def from_lines(
    lines: Sequence[Mapping], where: str = "evaluation", linenos: Sequence[int] | None = None
) -> Problems:
    """The :class:`Problems` of a file's problem lines (``linenos``: their line numbers, for
    the messages); ValueError naming the line (or problem), the field and its value. Every
    problem has the first one's seeds and number of samples per seed."""
    if not lines:
        raise ValueError(f"{where} holds no problems")
    parsed = []
    for i, line in enumerate(lines):
        try:
            pid, greedy, sampled = _problem(line)
            if parsed:
                _same_sampling(parsed[0], (pid, greedy, sampled), i)
        except ValueError as e:
            at = f"{where}:{linenos[i]}" if linenos is not None else f"{where}, problem {i}"
            raise ValueError(f"{at}: {e}") from None
        parsed.append((pid, greedy, sampled))
    kw = {}
    first = parsed[0][2]
    if first is not None:
        kw = dict(
            seeds=tuple(seed for seed, _, _ in first),
            sampled_correct=np.array([[c for _, c, _ in s] for _, _, s in parsed], bool),
            sampled_length=np.array([[ln for _, _, ln in s] for _, _, s in parsed], np.int64),
        )
        kw["sampled_correct"] = kw["sampled_correct"].transpose(1, 0, 2)
        kw["sampled_length"] = kw["sampled_length"].transpose(1, 0, 2)
    return Problems(
        ids=tuple(pid for pid, _, _ in parsed),
        greedy_correct=np.array([g[0] for _, g, _ in parsed], bool),
        greedy_length=np.array([g[1] for _, g, _ in parsed], np.int64),
        greedy_truncated=np.array([g[2] for _, g, _ in parsed], bool),
        **kw,
    )


def _same_sampling(first, this, i: int) -> None:
    """Problem ``i`` has the first problem's seeds and, per seed, its number of samples."""
    (pid0, _, s0), (pid, _, s) = first, this
    if (s0 is None) != (s is None):
        has, lacks = (f"problem {i} ({pid})", "the first") if s0 is None else ("the first", "it")
        raise ValueError(f"{has} has sampled results and {lacks} has none")
    if s0 is None:
        return
    seeds0, seeds = [x[0] for x in s0], [x[0] for x in s]
    if seeds != seeds0:
        raise ValueError(f"problem {i} ({pid}) has seeds {seeds}, the first problem {seeds0}")
    counts0, counts = [len(x[1]) for x in s0], [len(x[1]) for x in s]
    if counts != counts0:
        raise ValueError(
            f"problem {i} ({pid}) has {'/'.join(map(str, counts))} samples (seed "
            f"{'/'.join(map(str, seeds))}), the first problem ({pid0}) "
            f"{'/'.join(map(str, counts0))}: every problem needs the same number of samples"
        )
