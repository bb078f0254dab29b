"""The ``code_tests`` reward: run a completion's code against its problem's test cases.

    reward = fraction of the example's ``tests`` that the completion's code passes

Each example carries a ``tests`` field, a list of test cases in either form:

* a string: a Python statement, usually an ``assert``, run after the completion's
  code in the same interpreter (``"assert add(2, 3) == 5"``);
* a mapping ``{"input": ..., "output": ...}``: the code runs as a program with that
  standard input, and passes when its standard output, stripped of surrounding
  white space, equals ``output`` stripped.

The code is the last fenced ```` ```python ```` block of the completion (or the last
fenced block of any language), else the whole completion. Everything runs in the
sandbox of :func:`grpo_jax.tools.run_python`: a separate process per program with
limits on time, memory, processes and output, no network, and a private directory.
All assert-style cases of a completion run in one process, each guarded, so a failing
case does not stop the rest; a case that hangs uses up the run's time and the cases
after it count as failed. Completions are run in parallel (one thread waiting per
process, ``workers`` at a time).

Options: ``code_tests(timeout_s=5.0, memory_mb=256, workers=4)``. A reward that cannot
score (no ``tests`` for an example) gives NaN. The reward bounds its own time (each
program has ``timeout_s``), so ``train.reward_timeout_s`` does not cut it short.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re

from grpo_jax.rewards.registry import register
from grpo_jax.tools.sandbox import run_python

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)
_MARK = "__grpo_case_passed__"


def extract_code(completion: str) -> str:
    """The last ```python block, else the last fenced block, else the whole text."""
    blocks = _FENCE.findall(completion)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def _assert_program(code: str, cases: list[str]) -> str:
    lines = [
        "import sys as _s",
        f"_src = {code!r}",
        "try:",
        "    exec(compile(_src, 'solution.py', 'exec'), globals())",
        "except BaseException as _e:",
        "    print('solution failed:', type(_e).__name__, _e, file=_s.stderr)",
        "    raise SystemExit(1)",
    ]
    for i, case in enumerate(cases):
        lines += [
            "try:",
            f"    exec(compile({case!r}, 'test_{i}', 'exec'), globals())",
            f"    print({_MARK!r}, {i}, flush=True)",
            "except BaseException as _e:",
            f"    print('test {i} failed:', type(_e).__name__, _e, file=_s.stderr)",
        ]
    return "\n".join(lines) + "\n"


def run_tests(code: str, tests, *, timeout_s: float = 5.0, memory_mb: int = 256) -> float:
    """The fraction of ``tests`` (see the module docstring) that ``code`` passes."""
    if isinstance(tests, str):
        tests = json.loads(tests)
    tests = list(tests)
    if not tests:
        return math.nan
    asserts = [t for t in tests if isinstance(t, str)]
    io_cases = [t for t in tests if isinstance(t, dict)]
    if len(asserts) + len(io_cases) != len(tests):
        raise ValueError("each test must be a string or a mapping with 'input' and 'output'")
    passed = 0
    if asserts:
        r = run_python(_assert_program(code, asserts), timeout_s=timeout_s, memory_mb=memory_mb)
        marks = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith(_MARK + " ")}
        passed += len(marks & {str(i) for i in range(len(asserts))})
    for case in io_cases:
        r = run_python(
            code, timeout_s=timeout_s, memory_mb=memory_mb, stdin=str(case.get("input", ""))
        )
        if r.ok and r.stdout.strip() == str(case["output"]).strip():
            passed += 1
    return passed / len(tests)


def make_code_tests(timeout_s: float = 5.0, memory_mb: int = 256, workers: int = 4):
    """``code_tests``: the fraction of each example's ``tests`` the completion's code passes."""

    def code_tests(prompts, completions, *, tests, **_) -> list[float]:
        del prompts

        def one(pair):
            completion, cases = pair
            if cases is None:
                return math.nan
            try:
                return run_tests(
                    extract_code(completion), cases, timeout_s=timeout_s, memory_mb=memory_mb
                )
            except (ValueError, TypeError, KeyError):  # malformed test cases: unscored
                return math.nan

        with concurrent.futures.ThreadPoolExecutor(max(1, int(workers))) as pool:
            return list(pool.map(one, zip(completions, tests, strict=True)))

    code_tests.manages_timeout = True  # every program has its own deadline in the sandbox
    return code_tests


register("code_tests", factory=True)(make_code_tests)
