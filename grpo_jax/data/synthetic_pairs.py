"""Synthetic preference pairs with a known bias, for reward-model and reward-hacking experiments.

Each pair is a training problem of the CPU default (3-digit addition, digits least
significant first). The labeller this simulates prefers correct answers and, among them,
longer ones, padded with "0"s: a trailing zero is a leading zero of the number, which exact
match counts wrong, and that is the exploitable bias. ``python -m grpo_jax.make_pairs``
writes them. docs/data.md ("Preference pairs") has the kinds of pairs and their draws,
docs/learned_rewards.md the demonstration.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from grpo_jax.core.checks import check_range
from grpo_jax.core.errors import ConfigError
from grpo_jax.data.synthetic import make_split, split_of, write_number

# configs/default.py's data section (the prompts a reward model for that run must score).
ARITH_DEFAULT_KNOBS = dict(
    n_operands=2, min_digits=3, max_digits=3, ops="+", reverse_digits=True, reverse_operands=True
)


def wrong_answer(answer: str, rng: np.random.Generator) -> str:
    """``answer`` with one digit replaced by another digit (never the same one, never a
    most significant 0, which is the last character when digits are reversed)."""
    i = int(rng.integers(len(answer)))
    last = i == len(answer) - 1
    choices = [d for d in "0123456789" if d != answer[i] and not (d == "0" and last)]
    return answer[:i] + str(rng.choice(choices)) + answer[i + 1 :]


def biased_pairs(
    n: int,
    seed: int,
    *,
    pad_max: int = 2,
    both_right: float = 0.0,
    taste: float = 1.0,
    independent_pad: bool = False,
    **knobs,
) -> list[dict]:
    """``n`` {"prompt", "chosen", "rejected"} pairs, the two kinds the module docstring
    describes: a seeded share ``both_right`` of two right answers (the longer chosen with
    probability ``taste``), the rest right against wrong (``independent_pad``: their zeros
    drawn independently). ``knobs`` override ``ARITH_DEFAULT_KNOBS``
    (``grpo_jax.data.synthetic`` arithmetic knobs).
    """
    check_settings(n, pad_max=pad_max, both_right=both_right, taste=taste, **knobs)
    problems = make_split("arithmetic", "train", n, seed, **{**ARITH_DEFAULT_KNOBS, **knobs})
    rng = np.random.default_rng([seed, 0xB1A5])
    # Streams of their own, so both_right = 0 gives the pairs it gave before it existed.
    extra = np.random.default_rng([seed, 0x2B07])
    same_N, longer_N = extra.random(n) < both_right, extra.random(n) < taste
    out = []
    for ex, same, longer in zip(problems, same_N, longer_N, strict=True):
        answer = ex["answer"]
        if same:
            k, j = (int(x) for x in extra.choice(pad_max + 1, size=2, replace=False))
            k, j = (max(k, j), min(k, j)) if longer else (min(k, j), max(k, j))
            rejected = answer
        else:
            k = int(rng.integers(pad_max + 1))
            j = int(rng.integers(pad_max + 1 if independent_pad else k + 1))
            rejected = wrong_answer(answer, rng)
        out.append(
            {"prompt": ex["prompt"], "chosen": answer + "0" * k, "rejected": rejected + "0" * j}
        )
    return out


def check_settings(n: int, *, pad_max: int, both_right: float, taste: float, **knobs) -> None:
    """ConfigError, naming the setting, for what :func:`biased_pairs` would refuse, before any
    pair is drawn: among them more pairs than the task has training problems."""
    check_range("n", n, lo=1, integer=True)
    check_range("pad_max", pad_max, lo=0, integer=True)
    check_range("both_right", both_right, lo=0.0, hi=1.0)
    check_range("taste", taste, lo=0.0, hi=1.0)
    if both_right > 0 and pad_max < 1:
        raise ConfigError(
            "both_right > 0 needs pad_max >= 1: two right answers differ only by their zeros"
        )
    if not knobs:  # the default task: its training split counted once, in about 2 s
        most = training_problems() if n > 100_000 else n
        if n > most:
            raise ConfigError(
                f"n = {n} is more than the {most:,} training problems of the default task "
                "(3-digit addition), and each pair is a distinct one; lower n"
            )


# The number of training problems of the default task (the most pairs), once counted.
_TRAINING_PROBLEMS: list[int] = []


def training_problems() -> int:
    """The distinct training problems of ``ARITH_DEFAULT_KNOBS``' task: every pair of
    3-digit numbers whose prompt ``grpo_jax.data.synthetic.split_of`` puts in "train"."""
    if not _TRAINING_PROBLEMS:
        k = ARITH_DEFAULT_KNOBS
        assert (k["n_operands"], k["min_digits"], k["max_digits"], k["ops"]) == (2, 3, 3, "+")
        numbers = [write_number(a, k["reverse_operands"]) for a in range(100, 1000)]
        _TRAINING_PROBLEMS.append(
            sum(split_of(f"arithmetic:{a}+{b}=", 0.1) == "train" for a in numbers for b in numbers)
        )
    return _TRAINING_PROBLEMS[0]


def write_pairs(pairs: list[dict], path) -> pathlib.Path:
    """One JSON object a line (the format ``python -m grpo_jax.train_reward_model`` reads)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path
