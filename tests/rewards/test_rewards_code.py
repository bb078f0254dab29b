"""The code_tests reward: fraction of test cases passed, run in the sandbox."""

import math

from grpo_jax import rewards
from grpo_jax.rewards.code import extract_code, run_tests

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]


def test_extract_code_prefers_the_last_python_block():
    text = "try:\n```\nx = 1\n```\nthen\n```python\ny = 2\n```\nand ```js\nz\n```"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("```\nplain\n```") == "plain\n"
    assert extract_code("print(1)") == "print(1)"


def test_fraction_of_asserts_passed():
    # add(a, b) = a - b passes exactly the cases with b == 0: (0, 0) only -> 1/3.
    assert run_tests(extract_code(ADD), TESTS) == 1.0
    assert run_tests(extract_code(WRONG), TESTS) == 1 / 3
    assert run_tests("def add(a, b):\n    raise ValueError", TESTS) == 0.0
    assert run_tests("syntax error here", TESTS) == 0.0
    assert math.isnan(run_tests("", []))


def test_stdin_stdout_cases():
    code = "a, b = map(int, input().split())\nprint(a * b)"
    cases = [{"input": "3 4", "output": "12"}, {"input": "2 5", "output": "10\n"}]
    assert run_tests(code, cases) == 1.0
    assert run_tests(code, cases + [{"input": "1 1", "output": "2"}]) == 2 / 3


def test_hanging_and_hostile_code_scores_zero_quickly():
    assert run_tests("while True:\n    pass", TESTS, timeout_s=0.5) == 0.0
    hostile = "import os\nos.system('rm -rf /')\ndef add(a, b):\n    return a + b"
    assert run_tests(hostile, TESTS) == 0.0


def test_registered_reward_through_score():
    specs = (rewards.RewardSpec("code_tests(timeout_s=2.0)", 1.0),)
    result = rewards.score(
        specs,
        ["p"] * 3,
        [ADD, WRONG, "no code"],
        {"tests": [TESTS, TESTS, None]},
        timeout_s=0.01,  # the reward bounds its own time: the trainer's budget does not cut it
    )
    got = result.per_reward["code_tests(timeout_s=2.0)"]
    assert got[0] == 1.0 and abs(got[1] - 1 / 3) < 1e-6 and math.isnan(got[2])
