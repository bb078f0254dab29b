"""The ``code_tests`` reward: run a completion's code against its problem's test cases.

    reward = fraction of the example's ``tests`` that the completion's code passes

A case is an assert statement run after the code, or ``{"input": ..., "output": ...}`` for
the code run as a program. Everything runs in the sandbox of :func:`grpo_jax.tools.run_python`,
and a pass counts only when the harness writes a marker with a fresh nonce, so printing
markers or exiting early scores nothing. docs/multiturn.md (the ``code_tests`` reward) has
the cases, the options, what the nonce protects against and what it does not.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import secrets

from grpo_jax.rewards.registry import register
from grpo_jax.tools.sandbox import DEFAULT_MAX_OUTPUT, run_python, sandbox_mode

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


# The harness that runs a completion's code, then its assert cases (see the module
# docstring). Everything it uses after the code has run is bound before: the code may
# replace builtins, sys.stdout or os.write, and must not be able to make a case pass.
_HARNESS = """\
def _harness(src, cases, mark):
    import os
    read, write, exit_, exec_, base = os.read, os.write, os._exit, exec, BaseException

    def report(what, e):
        write(2, f"{what} {type(e).__name__} {e}\\n".encode("utf-8", "replace"))

    nonce = b""
    while not nonce.endswith(b"\\n"):
        chunk = read(0, 64)
        if not chunk:
            break
        nonce += chunk
    prefix = b"\\n" + mark + b" " + nonce.strip() + b" "
    del nonce, chunk
    out = os.dup(1)  # a private stdout: the code may close or replace fd 1 and sys.stdout
    runs = []
    for i, case in enumerate(cases):
        why = f"test {i} failed:"
        try:
            runs.append((compile(case, f"test_{i}", "exec"), prefix + b"%d\\n" % i, why))
        except base as e:
            report(why, e)
    del prefix
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec_(compile(src, "solution.py", "exec"), ns)
    except base as e:
        report("solution failed:", e)
        exit_(1)
    for test, marker, why in runs:
        try:
            exec_(test, ns)
        except base as e:
            report(why, e)
            continue
        write(out, marker)
"""


def _assert_program(code: str, cases: list[str]) -> str:
    """The harness program for ``code`` and its assert ``cases``; it reads a nonce on stdin."""
    return _HARNESS + f"\n\n_harness({code!r}, {list(cases)!r}, {_MARK.encode()!r})\n"


def _count_passes(stdout: str, nonce: str, n: int) -> int:
    """How many of the ``n`` cases the harness reported passed with this run's ``nonce``."""
    lines = set(stdout.splitlines())
    return sum(f"{_MARK} {nonce} {i}" in lines for i in range(n))


def run_tests(
    code: str, tests, *, timeout_s: float = 5.0, memory_mb: int = 256, sandbox: str | None = None
) -> float:
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
        nonce = secrets.token_hex(16)  # fresh for every run: a printed marker cannot know it
        r = run_python(
            _assert_program(code, asserts),
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            stdin=nonce + "\n",
            sandbox=sandbox,
        )
        passed += _count_passes(r.stdout, nonce, len(asserts))
    for case in io_cases:
        expected = str(case["output"]).strip()
        r = run_python(
            code,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            stdin=str(case.get("input", "")),
            # Room for the expected output with ample white space around it: a program
            # that writes more cannot match, and one that writes that much must not be cut.
            max_output_bytes=max(DEFAULT_MAX_OUTPUT, 2 * len(expected.encode()) + 4096),
            sandbox=sandbox,
        )
        if r.ok and r.stdout.strip() == expected:
            passed += 1
    return passed / len(tests)


def make_code_tests(
    timeout_s: float = 5.0, memory_mb: int = 256, workers: int = 4, sandbox: str | None = None
):
    """``code_tests``: the fraction of each example's ``tests`` the completion's code passes."""
    sandbox = sandbox_mode(sandbox)  # refused now, not as NaN rewards mid-run

    def code_tests(prompts, completions, *, tests, **_) -> list[float]:
        del prompts

        def one(pair):
            completion, cases = pair
            if cases is None:
                return math.nan
            try:
                return run_tests(
                    extract_code(completion),
                    cases,
                    timeout_s=timeout_s,
                    memory_mb=memory_mb,
                    sandbox=sandbox,
                )
            except (ValueError, TypeError, KeyError):  # malformed test cases: unscored
                return math.nan

        with concurrent.futures.ThreadPoolExecutor(max(1, int(workers))) as pool:
            return list(pool.map(one, zip(completions, tests, strict=True)))

    code_tests.manages_timeout = True  # every program has its own deadline in the sandbox
    return code_tests


register("code_tests", factory=True)(make_code_tests)
