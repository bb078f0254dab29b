"""Per-problem evaluation results, their figures with intervals, and their JSONL file.

An evaluation of P problems is a :class:`Problems`: each problem's id (a hash
of its prompt and answer, so two runs can be checked to have seen the same
problems), its greedy completion's correctness, length and truncation and, for
each sampling seed (``eval.seeds``), n sampled completions' correctness and
lengths. :func:`figures` turns it into the evaluation's metrics, each with a 95%
interval whose unit is the problem (``grpo_jax.stats``):

  ``pass_at_1``          greedy, Wilson interval (``_lo``/``_hi``) and the exact
                         Clopper-Pearson one (``_cp_lo``/``_cp_hi``)
  ``sampled_pass_at_1``  mean over problems of the share of its samples that are
                         correct, every seed's samples pooled; bootstrap over problems
  ``pass_at_k``          mean over problems of Chen et al.'s unbiased pass@k from all
                         of its S x n samples; bootstrap over problems

The file (``<workdir>/eval/step_<N>.jsonl``) has one header line,
``{"header": {...}}`` (the figures, k, the seeds and the run's record), then one
line per problem:

  {"index": 0, "id": "3f1c...", "greedy": {"correct": true, "length": 4,
   "truncated": false}, "sampled": [{"seed": 0, "correct": [...], "length": [...]}]}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from grpo_jax import stats

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
    """(header, problems) of a file :func:`write` wrote; ValueError naming what is wrong."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no evaluation file {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or "header" not in rows[0]:
        raise ValueError(f"{path} is not an evaluation file: its first line has no 'header'")
    return rows[0]["header"], from_lines(rows[1:], where=str(path))


def from_lines(lines: Sequence[Mapping], where: str = "evaluation") -> Problems:
    if not lines:
        raise ValueError(f"{where} holds no problems")
    g = [line["greedy"] for line in lines]
    kw = {}
    if "sampled" in lines[0]:
        seeds = tuple(s["seed"] for s in lines[0]["sampled"])
        for line in lines:
            if tuple(s["seed"] for s in line["sampled"]) != seeds:
                raise ValueError(f"{where}: problem {line['index']} has other seeds than {seeds}")
        kw = dict(
            seeds=seeds,
            sampled_correct=np.array(
                [[s["correct"] for s in line["sampled"]] for line in lines], bool
            ).transpose(1, 0, 2),
            sampled_length=np.array(
                [[s["length"] for s in line["sampled"]] for line in lines], np.int64
            ).transpose(1, 0, 2),
        )
    return Problems(
        ids=tuple(line["id"] for line in lines),
        greedy_correct=np.array([x["correct"] for x in g], bool),
        greedy_length=np.array([x["length"] for x in g], np.int64),
        greedy_truncated=np.array([x["truncated"] for x in g], bool),
        **kw,
    )
