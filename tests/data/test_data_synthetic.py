"""Synthetic tasks: golden problems, determinism, disjoint splits, solutions the rewards accept."""

import re

import pytest

from grpo_jax import rewards
from grpo_jax.data import synthetic
from grpo_jax.data.synthetic import arithmetic_problem, make_split, write_number
from grpo_jax.run.config import ConfigError


def test_arithmetic_golden():
    assert arithmetic_problem([12, 345, 7], ["+", "-"], False) == {
        "prompt": "12+345-7=",
        "answer": "350",
        "solution": "<think>12+345=357;357-7=350</think><answer>350</answer>",
    }
    assert arithmetic_problem([12, 345, 7], ["+", "-"], True) == {
        "prompt": "12+345-7=",
        "answer": "053",
        "solution": "<think>21+543=753;753-7=053</think><answer>053</answer>",
    }
    # Products first, then left to right.
    assert arithmetic_problem([2, 3, 4, 5], ["+", "*", "-"], False)["solution"] == (
        "<think>3*4=12;2+12=14;14-5=9</think><answer>9</answer>"
    )
    assert arithmetic_problem([3, 10], ["-"], True)["answer"] == "-7"
    assert write_number(-350, True) == "-053" and write_number(1200, True) == "0021"
    assert write_number(0, True) == "0" and write_number(-42, False) == "-42"


def _unreverse(s):
    return int(s[0] + s[:0:-1]) if s.startswith("-") else int(s[::-1])


KNOBS = [
    {},
    {"reverse_digits": True},
    {"n_operands": 4, "max_digits": 3, "ops": "+-*", "reverse_digits": True},
    {"n_operands": 3, "max_digits": 2, "min_digits": 2, "ops": "-"},
]


@pytest.mark.parametrize("knobs", KNOBS)
def test_arithmetic_answers_and_knobs(knobs):
    exs = make_split("arithmetic", "train", 300, 0, **knobs)
    k = {**synthetic.ARITH_KNOBS, **knobs}
    for ex in exs:
        expr = ex["prompt"].rstrip("=")
        operands = re.split(r"[-+*]", expr)
        assert len(operands) == k["n_operands"]
        assert all(k["min_digits"] <= len(o) <= k["max_digits"] for o in operands)
        assert set(re.findall(r"[-+*]", expr)) <= set(k["ops"])
        value = eval(expr)  # the prompt is plain integer arithmetic
        got = _unreverse(ex["answer"]) if k["reverse_digits"] else int(ex["answer"])
        assert got == value, ex
    n = len(exs)
    sol = [ex["solution"] for ex in exs]
    ans = [ex["answer"] for ex in exs]
    assert rewards.get("exact_match")([""] * n, sol, answer=ans) == [1.0] * n
    assert rewards.get("format")([""] * n, sol) == [1.0] * n


def test_default_arithmetic_is_short():
    exs = make_split("arithmetic", "train", 200, 0)
    assert max(len(ex["prompt"]) for ex in exs) <= 6  # "99+99="
    assert max(len(ex["solution"]) for ex in exs) <= 45


@pytest.mark.parametrize(
    "task,knobs",
    [
        ("arithmetic", {}),
        ("arithmetic", {"max_digits": 1, "n_operands": 3, "ops": "+-"}),
        ("countdown", {"n_numbers": 3, "max_number": 10, "max_target": 30}),
    ],
)
def test_train_and_test_never_overlap(task, knobs):
    train = make_split(task, "train", 400, 1, heldout_fraction=0.25, **knobs)
    test = make_split(task, "test", 100, 2, heldout_fraction=0.25, **knobs)
    tr_keys = {synthetic.problem_key(task, ex) for ex in train}
    te_keys = {synthetic.problem_key(task, ex) for ex in test}
    assert len(tr_keys) == 400 and len(te_keys) == 100  # distinct within a split
    assert not tr_keys & te_keys
    assert {synthetic.split_of(k, 0.25) for k in tr_keys} == {"train"}
    assert {synthetic.split_of(k, 0.25) for k in te_keys} == {"test"}


def test_deterministic_given_seed():
    for task in ("arithmetic", "countdown"):
        a = make_split(task, "train", 50, 11)
        assert a == make_split(task, "train", 50, 11)
        assert a != make_split(task, "train", 50, 12)
        # A longer list from the same seed starts with the shorter one.
        assert make_split(task, "train", 80, 11)[:50] == a


def test_countdown_solutions_and_knobs():
    k = {"n_numbers": 5, "max_number": 12, "max_target": 60}
    exs = make_split("countdown", "train", 200, 0, **k)
    for ex in exs:
        assert len(ex["numbers"]) == 5 and all(1 <= x <= 12 for x in ex["numbers"])
        assert 1 <= ex["target"] <= 60 and ex["answer"] == str(ex["target"])
        assert ex["prompt"] == f"{' '.join(map(str, ex['numbers']))} -> {ex['target']}:"
    n = len(exs)
    got = rewards.get("countdown")(
        [""] * n,
        [ex["solution"] for ex in exs],
        answer=[ex["answer"] for ex in exs],
        numbers=[ex["numbers"] for ex in exs],
    )
    assert got == [1.0] * n
    assert rewards.get("format")([""] * n, [ex["solution"] for ex in exs]) == [1.0] * n


def test_make_split_errors():
    with pytest.raises(
        ConfigError, match=r"'task' = 'sudoku' is not one of \['arithmetic', 'countdown'\]"
    ):
        make_split("sudoku", "train", 1, 0)
    with pytest.raises(ConfigError, match=r"'split' = 'val' is not one of \['test', 'train'\]"):
        make_split("arithmetic", "val", 1, 0)
    with pytest.raises(
        ConfigError, match=r"unknown arithmetic knob\(s\) \['n_numbers'\]; known knobs"
    ):
        make_split("arithmetic", "train", 1, 0, n_numbers=3)
    with pytest.raises(ConfigError, match="'ops' = '/' must be a non-empty string over"):
        make_split("arithmetic", "train", 1, 0, ops="/")
    with pytest.raises(ConfigError, match="'n_operands' = 1 must be >= 2"):
        make_split("arithmetic", "train", 1, 0, n_operands=1)
    with pytest.raises(ConfigError, match="'reverse_digits' = 1 must be a bool"):
        make_split("arithmetic", "train", 1, 0, reverse_digits=1)
    with pytest.raises(
        ConfigError, match=r"gave only \d+ distinct test problems .* fewer than n=50"
    ):
        make_split("arithmetic", "test", 50, 0, max_digits=1)
