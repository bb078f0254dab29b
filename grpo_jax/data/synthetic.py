"""Synthetic verifiable tasks generated from a seed: multi-step arithmetic and countdown.

Small enough for a ~1-5M parameter model with a character tokenizer to learn on a laptop
CPU, with exact answers the rewards can check: ``arithmetic`` (``"12+345-7="``, optionally
with digits least significant first; reward ``exact_match``) and ``countdown``
(``"3 7 25 50 -> 100:"``; reward ``countdown``). Train and test never overlap: a problem's
split is a hash of its canonical text. docs/data.md, "Synthetic tasks", has the knobs.
"""

from __future__ import annotations

import hashlib

import numpy as np

from grpo_jax.core.checks import check_choice, check_range
from grpo_jax.core.errors import ConfigError

SPLITS = ("train", "test")
_SPLIT_IDS = {"train": 0, "test": 1}


def split_of(key: str, heldout_fraction: float) -> str:
    """ "test" for a ``heldout_fraction`` share of problem keys (by SHA-256), else "train"."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h / 2**64 < heldout_fraction else "train"


def write_number(value: int, reverse: bool) -> str:
    """Decimal text of ``value``, digits least-significant first when ``reverse``."""
    sign, digits = ("-", str(-value)) if value < 0 else ("", str(value))
    return sign + (digits[::-1] if reverse else digits)


# ---------------------------------------------------------------- arithmetic

ARITH_KNOBS = {
    "n_operands": 2,
    "max_digits": 2,
    "min_digits": 1,
    "ops": "+",
    "reverse_digits": False,
    "reverse_operands": False,
}


def _check_arith(k: dict) -> None:
    check_range("n_operands", k["n_operands"], lo=2, hi=16, integer=True)
    check_range("max_digits", k["max_digits"], lo=1, hi=18, integer=True)
    check_range("min_digits", k["min_digits"], lo=1, hi=k["max_digits"], integer=True)
    ops = k["ops"]
    if not isinstance(ops, str) or not ops or set(ops) - set("+-*"):
        raise ConfigError(f"config key 'ops' = {ops!r} must be a non-empty string over '+-*'")
    for knob in ("reverse_digits", "reverse_operands"):
        if not isinstance(k[knob], bool):
            raise ConfigError(f"config key '{knob}' = {k[knob]!r} must be a bool")


def arithmetic_problem(
    operands: list[int], operators: list[str], reverse_digits: bool, reverse_operands: bool = False
) -> dict:
    """Prompt, answer and worked solution of ``operands[0] op operands[1] op ...``."""
    prompt = "".join(
        f"{write_number(a, reverse_operands)}{op}" for a, op in zip(operands, operators + ["="])
    )
    w = lambda v: write_number(v, reverse_digits)
    vals, ops, steps = list(operands), list(operators), []
    for wanted in ("*", "+-"):
        i = 0
        while i < len(ops):
            if ops[i] in wanted:
                a, b, op = vals[i], vals[i + 1], ops[i]
                r = a * b if op == "*" else a + b if op == "+" else a - b
                steps.append(f"{w(a)}{op}{w(b)}={w(r)}")
                vals[i : i + 2] = [r]
                del ops[i]
            else:
                i += 1
    answer = w(vals[0])
    solution = f"<think>{';'.join(steps)}</think><answer>{answer}</answer>"
    return {"prompt": prompt, "answer": answer, "solution": solution}


def _sample_arith(rng: np.random.Generator, k: dict) -> tuple[str, dict]:
    operands = []
    for _ in range(k["n_operands"]):
        d = int(rng.integers(k["min_digits"], k["max_digits"] + 1))
        lo = 0 if d == 1 else 10 ** (d - 1)
        operands.append(int(rng.integers(lo, 10**d)))
    operators = [str(rng.choice(list(k["ops"]))) for _ in range(k["n_operands"] - 1)]
    ex = arithmetic_problem(operands, operators, k["reverse_digits"], k["reverse_operands"])
    return "arithmetic:" + ex["prompt"], ex


# ---------------------------------------------------------------- countdown

COUNTDOWN_KNOBS = {"n_numbers": 4, "max_number": 25, "max_target": 100}


def _check_countdown(k: dict) -> None:
    check_range("n_numbers", k["n_numbers"], lo=2, hi=8, integer=True)
    check_range("max_number", k["max_number"], lo=2, integer=True)
    check_range("max_target", k["max_target"], lo=1, integer=True)


def _sample_countdown(rng: np.random.Generator, k: dict) -> tuple[str, dict] | None:
    numbers = [int(x) for x in rng.integers(1, k["max_number"] + 1, k["n_numbers"])]
    pool = [(v, str(v)) for v in numbers]  # (value, expression)
    steps = []
    while len(pool) > 1:
        i, j = (int(x) for x in rng.choice(len(pool), 2, replace=False))
        (a, ea), (b, eb) = pool[i], pool[j]
        if a < b:
            (a, ea), (b, eb) = (b, eb), (a, ea)
        choices = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
        op = str(rng.choice(choices))
        r = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        steps.append(f"{a}{op}{b}={r}")
        wrap = lambda e: e if e.isdigit() else f"({e})"
        pool = [p for n, p in enumerate(pool) if n not in (i, j)] + [
            (r, f"{wrap(ea)}{op}{wrap(eb)}")
        ]
    target, expr = pool[0]
    if not 1 <= target <= k["max_target"]:
        return None
    prompt = f"{' '.join(map(str, numbers))} -> {target}:"
    ex = {
        "prompt": prompt,
        "answer": str(target),
        "solution": f"<think>{';'.join(steps)}</think><answer>{expr}</answer>",
        "numbers": numbers,
        "target": target,
    }
    return f"countdown:{sorted(numbers)}->{target}", ex


TASKS = {
    "arithmetic": (ARITH_KNOBS, _check_arith, _sample_arith),
    "countdown": (COUNTDOWN_KNOBS, _check_countdown, _sample_countdown),
}


def make_split(
    task: str, split: str, n: int, seed: int, *, heldout_fraction: float = 0.1, **knobs
) -> list[dict]:
    """``n`` distinct problems of ``task`` in ``split``, deterministic given ``seed``.

    Args:
      task: "arithmetic" or "countdown".
      split: "train" or "test"; the two never share a problem (see module doc).
      n: number of problems.
      seed: the same seed, knobs and split give the same list.
      heldout_fraction: share of the problem space reserved for "test".
      **knobs: difficulty: arithmetic ``n_operands`` (2..), ``max_digits``,
        ``min_digits``, ``ops`` ("+", "+-", "+-*"), ``reverse_digits``,
        ``reverse_operands``;
        countdown ``n_numbers``, ``max_number``, ``max_target``.

    Returns:
      Example dicts with "prompt", "answer", "solution" (countdown also
      "numbers" and "target").

    Raises:
      ConfigError for an unknown task, split or knob or a bad value, and when
      the problem space has fewer than ``n`` problems for this split.
    """
    check_choice("task", task, TASKS)
    check_choice("split", split, SPLITS)
    check_range("n", n, lo=0, integer=True)
    check_range("seed", seed, lo=0, integer=True)
    check_range("heldout_fraction", heldout_fraction, lo=0.0, hi=1.0, lo_open=True)
    defaults, check, sample = TASKS[task]
    unknown = sorted(set(knobs) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown {task} knob(s) {unknown}; known knobs are {sorted(defaults)}")
    k = {**defaults, **knobs}
    check(k)

    rng = np.random.default_rng([seed, _SPLIT_IDS[split], 0x5EED])
    out, seen = [], set()
    max_tries = 200 * n + 20_000
    for _ in range(max_tries):
        if len(out) == n:
            break
        drawn = sample(rng, k)
        if drawn is None:
            continue
        key, ex = drawn
        if key in seen or split_of(key, heldout_fraction) != split:
            continue
        seen.add(key)
        out.append(ex)
    if len(out) < n:
        raise ConfigError(
            f"{task} with knobs {k} gave only {len(out)} distinct {split} problems in "
            f"{max_tries} draws, fewer than n={n}; raise the difficulty knobs or lower n"
        )
    return out


def problem_key(task: str, example: dict) -> str:
    """The canonical text of a problem, the key hashed into its split."""
    if task == "arithmetic":
        return "arithmetic:" + example["prompt"]
    if task == "countdown":
        return f"countdown:{sorted(example['numbers'])}->{example['target']}"
    raise ConfigError(f"task {task!r} is not one of {sorted(TASKS)}")
