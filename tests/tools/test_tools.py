"""The sandbox (run_python) holds its limits and leaves the trainer, machine and files alone."""

import functools
import json
import os
import pathlib
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from grpo_jax import tools
from grpo_jax.tools import _sandbox_boot, sandbox

_RLIMITS = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]


def _live_processes(session: int, uid: int | None) -> list[int]:
    """Pids of live (not zombie) processes in ``session`` or of user ``uid`` (Linux)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            status = pathlib.Path("/proc", entry, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields["State"].split()[0] in "ZX":
            continue
        if int(fields["NSsid"].split()[0]) == session or int(fields["Uid"].split()[0]) == uid:
            found.append(int(entry))
    return found


@pytest.fixture
def unharmed(monkeypatch):
    """After the test: each sandbox's directory is gone, no process of its session or of
    its user is left, and the trainer itself kept its working directory and resource limits
    (the child sets its limits and directory on itself only)."""
    cwd, limits = os.getcwd(), {r: resource.getrlimit(r) for r in _RLIMITS}
    made, procs, uids = [], [], []
    real_mkdtemp, real_popen = sandbox.tempfile.mkdtemp, sandbox.subprocess.Popen
    real_run_uid = sandbox._run_uid

    def run_uid():
        uids.append(real_run_uid())
        return uids[-1]

    def mkdtemp(*a, **k):
        made.append(real_mkdtemp(*a, **k))
        return made[-1]

    def popen(*a, **k):
        procs.append(real_popen(*a, **k))
        return procs[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(sandbox.subprocess, "Popen", popen)
    monkeypatch.setattr(sandbox, "_run_uid", run_uid)
    yield
    assert made and procs
    assert not any(os.path.exists(d) for d in made)
    for p in procs:
        assert p.returncode is not None  # reaped
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)  # its process group is empty
        assert not _live_processes(p.pid, None)  # nor its session
    for uid in uids:
        assert uid is None or not _live_processes(-1, uid)  # nor the run's own user
    assert os.getcwd() == cwd
    assert {r: resource.getrlimit(r) for r in _RLIMITS} == limits


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


@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_stdin_and_private_directory(unharmed, sandbox_name):
    code = (
        "import os\nopen('a.txt','w').write(input())\n"
        "print(open('a.txt').read(), sorted(os.listdir('.')))"
    )
    r = tools.run_python(code, timeout_s=5, stdin="hello\n", sandbox=sandbox_name)
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


@pytest.mark.skipif(
    sandbox.network_isolation("hooks") != "namespace", reason="no network namespace"
)
def test_network_namespace_has_no_route():
    # Below the audit hook: unshare's namespace itself has no network at all.
    code = (
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
        "except OSError as e:\n    print(e.errno)"
    )
    out = subprocess.run(
        [*sandbox._unshare_prefix(), sys.executable, "-c", code], capture_output=True, text=True
    )
    assert out.stdout.strip() == "101"  # ENETUNREACH


@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_files_outside_the_directory(unharmed, tmp_path, sandbox_name):
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
        r = tools.run_python(code, timeout_s=5, sandbox=sandbox_name)
        assert r.exit_code == 1 and "not allowed" in r.stderr, (code, r.stderr)
        assert "do not read" not in r.stdout
    assert victim.read_text() == "keep me" and secret.exists()
    assert not (pathlib.Path(tempfile.gettempdir()) / "escape.txt").exists()


def test_fifos_and_device_nodes_cannot_be_made(unharmed, outside):
    # No audit event covers mkfifo/mknod, so the sandbox takes them away altogether.
    target = repr(str(outside))
    for code in (
        f"import os\nos.mkfifo({target})",
        f"import os, stat\nos.mknod({target}, stat.S_IFREG | 0o600)",
        f"import os, stat\nos.mknod({target}, stat.S_IFIFO | 0o600)",
        f"import posix\nposix.mkfifo({target})",
        "import os\nos.mkfifo('fifo_inside')",
        f"import os\n[f for f in os.supports_dir_fd if f.__name__ == 'mkfifo'][0]({target})",
        f"import importlib, os\nimportlib.reload(os)\nos.mkfifo({target})",
        f"import sys\ndel sys.modules['posix']\nimport posix\nposix.mkfifo({target})",
        "import _imp, importlib.machinery as m\n"
        "p = _imp.create_builtin(m.ModuleSpec('posix', m.BuiltinImporter, origin='built-in'))\n"
        f"p.mkfifo({target})",
    ):
        r = tools.run_python(code, timeout_s=5)
        assert r.exit_code == 1 and "sandbox:" in r.stderr and "not allowed" in r.stderr, (
            code,
            r.stderr,
        )
        assert not outside.exists() and not outside.is_symlink(), code


def test_dir_fd_cannot_escape_the_directory(unharmed, outside):
    for code in (
        # A descriptor of a directory outside, then a path relative to it.
        "import os\nfd = os.open(os.path.dirname(os.__file__), os.O_RDONLY)\n"
        "os.open('evil.py', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
        # The sandbox directory's own descriptor, used from a deeper working directory: the
        # path looks inside when read from the cwd, and is outside when read from the fd.
        "import os\nfd = os.open('.', os.O_RDONLY)\nos.makedirs('a/b')\nos.chdir('a/b')\n"
        f"os.open('../{outside.name}', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
        "import os\nfd = os.open('.', os.O_PATH | os.O_WRONLY)\nos.makedirs('a/b')\n"
        f"os.chdir('a/b')\nos.mkdir('../{outside.name}', dir_fd=fd)",
        # A file descriptor of a readable file outside, changed through the descriptor.
        "import os\nfd = os.open('/dev/null', os.O_RDONLY)\nos.fchmod(fd, 0o600)",
    ):
        r = tools.run_python(code, timeout_s=5)
        assert r.exit_code == 1 and "sandbox:" in r.stderr and "not allowed" in r.stderr, (
            code,
            r.stderr,
        )
        assert not outside.exists(), code
    assert stat.S_IMODE(os.stat("/dev/null").st_mode) == 0o666


@pytest.mark.parametrize("sandbox_name", sandbox.SANDBOXES)
def test_directory_work_inside_still_works(unharmed, sandbox_name):
    code = (
        "import os, shutil\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\n"
        "os.chmod('a/b/f', 0o600)\n"
        "shutil.rmtree('a')\nprint(sorted(os.listdir('.')))"
    )
    r = tools.run_python(code, timeout_s=5, sandbox=sandbox_name)
    assert r.stdout == "['main.py']\n", r.stderr


@pytest.mark.parametrize(
    "euid, uid_map, drop",
    [
        (0, "         0          0 4294967295\n", True),  # root, no user namespace
        (0, None, True),  # no /proc: euid 0 is root
        (0, "         0       1000          1\n", False),  # unshare -r by uid 1000
        (0, "         0      65534          1\n", False),
        (0, "  1000 0 1\n         0       1000          1\n", False),
        (0, "         0          0          1\n", True),  # root's own unshare -r: still root
        (1000, "         0          0 4294967295\n", False),
        (65534, None, False),
    ],
)
def test_drop_root_only_for_the_real_root(euid, uid_map, drop):
    assert _sandbox_boot._is_real_root(euid, uid_map) is drop


_AS_NOBODY_IN_A_NAMESPACE = (
    *("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
    *("unshare", "-r", "-n"),
)


@functools.lru_cache(maxsize=1)
def _python_for_nobody():
    """A Python interpreter the nobody user can run inside ``unshare -r -n``, or None."""
    if os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("unshare")):
        return None
    for exe in (sys.executable, "/usr/bin/python3"):
        probe = [*_AS_NOBODY_IN_A_NAMESPACE, exe, "-I", "-c", "pass"]
        if os.path.exists(exe) and subprocess.run(probe, capture_output=True).returncode == 0:
            return exe
    return None


needs_nobody = pytest.mark.skipif(
    _python_for_nobody() is None, reason="needs root, setpriv and user namespaces"
)


def _boot_as_nobody(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` through the sandbox's boot script as a non-root user in a namespace
    made with ``unshare -r -n``: euid 0 inside, its own uid outside, no nobody to switch
    to. This is what a non-root trainer gets when ``unshare`` has no ``-c``."""
    work = tempfile.mkdtemp(prefix="grpo_boot_")
    try:
        main = pathlib.Path(work, "main.py")
        main.write_text(code)
        for path in (work, main):
            os.chown(path, 65534, 65534)
        limits = {"cpu_s": 5, "memory_bytes": 2**30, "file_bytes": 2**20, "nproc": 64}
        # The boot script's text, as run_python passes it: nobody may not be able to read
        # the checkout (a clone in a folder only its owner can read).
        boot = sandbox._BOOT.read_text()
        cmd = [*_AS_NOBODY_IN_A_NAMESPACE, _python_for_nobody(), "-I", "-c", boot]
        cmd += [work, str(main), json.dumps(limits)]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@needs_nobody
def test_boot_runs_in_a_namespace_made_by_a_non_root_user():
    # The boot must run the code as it is, not fail switching to nobody.
    out = _boot_as_nobody("import os\nprint(os.geteuid(), open('x', 'w').write('ok'))")
    assert (out.returncode, out.stdout) == (0, "0 2\n"), out.stderr


@needs_nobody
def test_temporary_files_and_directory_walks_still_work():
    # With a Python whose whole standard library the child can read (tempfile among it).
    code = (
        "import os, tempfile, shutil, pathlib\nwith tempfile.TemporaryFile() as t:\n"
        "    t.write(b'y')\n    t.seek(0)\n    print(t.read())\n"
        "with tempfile.TemporaryDirectory(dir='.') as d:\n"
        "    pathlib.Path(d, 'a').mkdir()\n    pathlib.Path(d, 'a', 'f').write_text('x')\n"
        "    shutil.copytree(d, 'copy')\n"
        "print([sorted(f) for _, _, f in os.walk('copy')])\nshutil.rmtree('copy')\n"
        "print(sorted(os.listdir('.')))"
    )
    out = _boot_as_nobody(code)
    assert out.stdout == "b'y'\n[[], ['f']]\n['main.py']\n", out.stderr


@needs_nobody
def test_ctypes_cannot_be_loaded_by_any_import():
    # With a Python whose extensions the child can read, so that _ctypes is found.
    code = (
        "import importlib, importlib.util as u\nfor attempt in (\n"
        "    'import _ctypes', 'import ctypes', \"importlib.import_module('_ctypes')\",\n"
        "    \"u.module_from_spec(u.find_spec('_ctypes'))\",\n"
        "    \"import _imp; _imp.create_dynamic(u.find_spec('_ctypes'))\",\n):\n"
        "    try:\n        exec(attempt)\n        print('loaded', attempt)\n"
        "    except PermissionError as e:\n        print(e)\n"
    )
    out = _boot_as_nobody(code)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 5, (out.stdout, out.stderr)
    assert all(ln.startswith("sandbox: import") and "not allowed" in ln for ln in lines), lines


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


def test_the_model_cannot_raise_the_python_tools_limits(monkeypatch):
    """A tool call's own ``timeout_s`` / ``memory_mb`` may lower the trainer's limits, never
    raise them: the model writes those arguments."""
    from grpo_jax.tools import registry

    seen = []
    monkeypatch.setattr(registry, "run_python", lambda code, **kw: seen.append(kw) or kw)
    python = registry.get_tool("python").fn
    python({"code": "1", "timeout_s": 3600, "memory_mb": 10**6})
    python({"code": "1", "timeout_s": 1, "memory_mb": 64})
    assert [(k["timeout_s"], k["memory_mb"]) for k in seen] == [(5.0, 256), (1.0, 64)]
    for bad in ({"timeout_s": "x"}, {"timeout_s": float("nan")}, {"memory_mb": 1}):
        r = python({"code": "1", **bad})
        assert r.exit_code == 1 and r.stderr.startswith("error:")
    assert len(seen) == 2
