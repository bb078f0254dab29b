"""code_tests cannot be gamed by printing its pass markers or by exiting early."""

from grpo_jax.rewards import code
from grpo_jax.rewards.code import run_tests

TESTS = ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]
FAKE = "\n".join(
    [
        "for i in range(3):",
        f"    print({code._MARK!r}, i)",
        f"    print({code._MARK!r}, 'x' * 32, i)",  # with a guessed nonce in the right place
        f"    print('\\n' + {code._MARK!r} + ' ' + str(i), flush=True)",
    ]
)


def test_printing_fake_pass_markers_scores_zero():
    assert run_tests(FAKE, TESTS) == 0.0
    # Still nothing when the code also defines a wrong solution that runs fine.
    assert run_tests(FAKE + "\ndef add(a, b):\n    return 7", TESTS) == 0.0


def test_exiting_before_the_tests_scores_zero():
    for exit_call in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit"):
        assert run_tests(FAKE + "\n" + exit_call, TESTS) == 0.0, exit_call
        assert run_tests("def add(a, b):\n    return a + b\n" + exit_call, TESTS) == 0.0


def test_the_code_cannot_read_the_nonce_from_stdin_or_its_files():
    snoop = (
        "import os, sys\n"
        "seen = sys.stdin.read() + open('main.py').read()\n"
        "words = [w for w in seen.replace('\"', ' ').replace(\"'\", ' ').split() if len(w) == 32]\n"
        f"for w in words:\n    for i in range(3):\n        print({code._MARK!r}, w, i)\n"
    )
    assert run_tests(snoop, TESTS) == 0.0


def test_patching_builtins_the_harness_uses_does_not_pass_cases():
    # The harness binds exec, compile and its loop before the code runs.
    patched = (
        "import builtins\n"
        "builtins.exec = lambda *a, **k: None\n"
        "builtins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n"
        "builtins.enumerate = lambda xs, *a: ((i, 'pass') for i in range(3))\n"
        "builtins.zip = lambda *a: iter(())\n"
    )
    assert run_tests(patched, TESTS) == 0.0


def test_correct_and_partly_correct_solutions_still_score():
    assert run_tests("def add(a, b):\n    return a + b", TESTS) == 1.0
    # a - b is right only when b == 0: one case in three.
    assert run_tests("def add(a, b):\n    return a - b", TESTS) == 1 / 3
    # Printing without a newline, and printing a lot, does not hide a pass.
    noisy = "import sys\nsys.stdout.write('no newline')\nprint('x' * 5000, end='')\n"
    assert run_tests(noisy + "def add(a, b):\n    return a + b", TESTS) == 1.0
    # A case that fails in the middle does not stop the rest.
    half = "def add(a, b):\n    if a == 0:\n        raise ValueError\n    return a + b"
    assert run_tests(half, TESTS + ["assert add(1, 1) == 2"]) == 3 / 4
