"""The sandbox (run_python) holds its limits and leaves the trainer, machine and files alone."""

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest

from grpo_jax import tools
from grpo_jax.tools import sandbox


@pytest.fixture
def unharmed(monkeypatch):
    """After the test: each sandbox's directory is gone, and no process of its group is left."""
    made, procs = [], []
    real_mkdtemp, real_popen = sandbox.tempfile.mkdtemp, sandbox.subprocess.Popen

    def mkdtemp(*a, **k):
        made.append(real_mkdtemp(*a, **k))
        return made[-1]

    def popen(*a, **k):
        procs.append(real_popen(*a, **k))
        return procs[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(sandbox.subprocess, "Popen", popen)
    yield
    assert made and procs
    assert not any(os.path.exists(d) for d in made)
    for p in procs:
        assert p.returncode is not None  # reaped
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)  # its process group is empty


def test_runs_code_and_returns_output(unharmed):
    r = tools.run_python("import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)", timeout_s=5)
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated) == (
        "42\n",
        "oops\n",
        0,
        False,
        False,
    )
    assert tools.run_python("raise SystemExit(3)", timeout_s=5).exit_code == 3
    r = tools.run_python("1/0", timeout_s=5)
    assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr and 'File "main.py"' in r.stderr


def test_stdin_and_private_directory(unharmed):
    code = (
        "import os\nopen('a.txt','w').write(input())\n"
        "print(open('a.txt').read(), sorted(os.listdir('.')))"
    )
    r = tools.run_python(code, timeout_s=5, stdin="hello\n")
    assert r.stdout == "hello ['a.txt', 'main.py']\n", r.stderr


def test_infinite_loop_is_killed_at_the_deadline(unharmed):
    t0 = time.monotonic()
    r = tools.run_python("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and r.exit_code == -9
    assert "wall-clock limit" in r.stderr
    assert time.monotonic() - t0 < 5


def test_sleeping_child_is_killed_at_the_deadline(unharmed):
    r = tools.run_python("import time\ntime.sleep(60)", timeout_s=0.5)
    assert r.timed_out and not r.ok


def test_unbounded_allocation_fails_with_memory_error(unharmed):
    r = tools.run_python("x = []\nwhile True:\n    x.append(bytearray(2**24))", memory_mb=128)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and not r.timed_out


def test_fork_bomb_is_refused(unharmed):
    for code in (
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.Popen(['sleep', '100'])",
        "import os\nos.system('sleep 100')",
        "import os\nos.posix_spawn('/bin/sleep', ['sleep', '100'], {})",
        "import ctypes",
    ):
        r = tools.run_python(code, timeout_s=5)
        assert r.exit_code != 0 and not r.timed_out, code
        assert "not allowed" in r.stderr or "No module named" in r.stderr, (code, r.stderr)


def test_network_socket_is_refused(unharmed):
    r = tools.run_python(
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)", timeout_s=5
    )
    assert r.exit_code == 1 and "socket" in r.stderr and "not allowed" in r.stderr


@pytest.mark.skipif(sandbox.network_isolation() != "namespace", reason="no network namespace")
def test_network_namespace_has_no_route():
    # Below the audit hook: the namespace itself has no network at all.
    code = (
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
        "except OSError as e:\n    print(e.errno)"
    )
    out = subprocess.run(
        [*sandbox._unshare_prefix(), sys.executable, "-c", code], capture_output=True, text=True
    )
    assert out.stdout.strip() == "101"  # ENETUNREACH


def test_files_outside_the_directory(unharmed, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for code in (
        f"print(open({str(secret)!r}).read())",
        f"open({str(victim)!r}, 'w').write('gone')",
        f"import os\nos.remove({str(victim)!r})",
        f"import os\nprint(os.listdir({str(tmp_path)!r}))",
        "open('../escape.txt', 'w').write('x')",
        f"import os\nos.symlink({str(secret)!r}, 'link')",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
    ):
        r = tools.run_python(code, timeout_s=5)
        assert r.exit_code == 1 and "not allowed" in r.stderr, (code, r.stderr)
        assert "do not read" not in r.stdout
    assert victim.read_text() == "keep me" and secret.exists()
    assert not (pathlib.Path(tempfile.gettempdir()) / "escape.txt").exists()


def test_printing_gigabytes_is_cut(unharmed):
    t0 = time.monotonic()
    r = tools.run_python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        timeout_s=30,
        max_output_bytes=1000,
    )
    assert r.truncated and not r.timed_out and r.exit_code == -9
    assert len(r.stdout) == 1000 and "output passed" in r.stderr
    assert time.monotonic() - t0 < 10


def test_large_file_write_is_limited(unharmed):
    r = tools.run_python(
        "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)", timeout_s=10, max_file_mb=4
    )
    assert r.exit_code == 1 and "File too large" in r.stderr


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="timeout_s"):
        tools.run_python("pass", timeout_s=-1)
    with pytest.raises(ValueError, match="memory_mb"):
        tools.run_python("pass", memory_mb=0)
    with pytest.raises(TypeError, match="code"):
        tools.run_python(b"pass")


def test_calculator_exact_and_safe():
    assert tools.calculate("2 * (3 + 4) / 5") == "2.8"
    assert tools.calculate("17*23") == "391"
    assert tools.calculate("1/3 + 1/6") == "0.5"
    assert tools.calculate("2^10") == "1024"
    for bad in ("__import__('os')", "9**9**9", "1/0", "x + 1", ""):
        with pytest.raises(tools.CalculatorError):
            tools.calculate(bad)


def test_tool_calls_parsed_and_run_in_order():
    text = (
        "first <calculator>6*7</calculator> then "
        '<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>'
        " and <tool_call>{bad json}</tool_call> <unknown>1</unknown>"
    )
    calls = tools.parse_tool_calls(text)
    assert [c.name for c in calls] == ["calculator", "python", ""]
    assert calls[2].error is not None
    out = tools.format_results(tools.run_tool_calls(calls))
    assert out.startswith(
        '<tool_result name="calculator">42</tool_result>'
        '<tool_result name="python">1024</tool_result>'
    )
    assert "malformed tool call" in out
    assert tools.parse_tool_calls("<python>x</python>", tools=["calculator"]) == []


def test_register_tool_rejects_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        tools.register_tool("calculator", lambda a: None)
    with pytest.raises(ValueError, match="identifier"):
        tools.register_tool("not a name", lambda a: None)
    with pytest.raises(KeyError, match="registered tools"):
        tools.get_tool("nope")
