"""The sandbox holds against code written to get out of it, and its timeout always holds.

Each case runs in a fresh interpreter under a hard outer timeout, so a sandbox that stops
holding its own deadline fails the test instead of hanging the suite.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import pytest

import grpo_jax
from grpo_jax.tools import sandbox

_ROOT = str(pathlib.Path(grpo_jax.__file__).parents[1])


def _isolated(body: str, timeout: float = 30.0) -> dict:
    """Runs ``body`` in a new interpreter (own session, killed at ``timeout``); the JSON
    object on its last stdout line."""
    env = {**os.environ, "PYTHONPATH": _ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys\nexec(sys.stdin.read())"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(body, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"no answer within the outer timeout of {timeout:g} s")
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def _sandboxed(code: str, *, outer: float = 30.0, boot: str | None = None, **kwargs) -> dict:
    """``run_python(code, **kwargs)`` in a new interpreter: the result's fields and ``elapsed``.
    ``boot``: another boot script to run the code with."""
    body = (
        "import dataclasses, json, time\nfrom grpo_jax.tools import sandbox\n"
        f"if {boot!r}:\n    sandbox._BOOT = {boot!r}\n"
        f"t0 = time.monotonic()\nr = sandbox.run_python({code!r}, **{kwargs!r})\n"
        "print(json.dumps({**dataclasses.asdict(r), 'elapsed': time.monotonic() - t0}))"
    )
    return _isolated(body, outer)


def _processes_with(token: str) -> list[int]:
    """Pids of live processes whose command line contains ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = pathlib.Path("/proc", entry, "cmdline").read_bytes()
            state = pathlib.Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if token.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def _processes_of_uid(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            status = pathlib.Path("/proc", entry, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] != "Z":
            found.append(int(entry))
    return found


# Routes to the audit hook's policy that code in the same interpreter can find.
_HOOK_ROUTES = {
    "the boot module as __main__": "import __main__\n__main__._DENIED_EVENTS.clear()",
    "a wrapped function's globals": (
        "import os\ng = os.mkfifo.__globals__\ng['_DENIED_EVENTS'].clear()\n"
        "g['_DENIED_EVENTS'] = set()"
    ),
    "the path functions the hook calls": (
        "import os, posixpath\nposixpath._joinrealpath = lambda *a: (os.getcwd(), True)"
    ),
}


@pytest.mark.parametrize("route", sorted(_HOOK_ROUTES))
def test_the_hook_policy_is_out_of_reach(route, outside):
    code = (
        "try:\n    "
        + _HOOK_ROUTES[route].replace("\n", "\n    ")
        + "\nexcept Exception as e:\n    print('no route:', type(e).__name__)\n"
        "import os\nfor attempt in (lambda: os.fork() or print('forked'),\n"
        f"                lambda: open({str(outside)!r}, 'w').write('out')):\n"
        "    try:\n        attempt()\n    except PermissionError as e:\n        print(e)\n"
    )
    r = _sandboxed(code, timeout_s=5)
    assert "forked" not in r["stdout"] and not outside.exists(), (r["stdout"], r["stderr"])
    assert r["stdout"].count("not allowed") == 2, (r["stdout"], r["stderr"])


def test_the_reported_escape_is_refused_and_leaves_nothing(outside):
    token = uuid.uuid4().hex
    code = (
        "import __main__, os\n__main__._DENIED_EVENTS.clear()\nif os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sh', ['sh', '-c', 'sleep 0.6; echo escaped > {outside}; : {token}'])\n"
        "import time\ntime.sleep(30)"
    )
    r = _sandboxed(code, timeout_s=0.5)
    time.sleep(0.6)
    assert not outside.exists() and not _processes_with(token), r
    assert r["exit_code"] == 1 and "_DENIED_EVENTS" in r["stderr"], r


def _boot_without_hook(tmp_path) -> str:
    """The boot script with its audit hook left out: what code that got past the hook has."""
    text = sandbox._BOOT.read_text()
    assert "\n    _install_hook(" in text
    boot = tmp_path / "boot_without_hook.py"
    boot.write_text(text.replace("\n    _install_hook(", "\n    (lambda *a: None)("))
    boot.chmod(0o644)
    return str(boot)


# A python, the one program the kernel sandbox has: it sleeps, then writes outside.
_DAEMON = (
    "import os, sys\nprint(os.getuid(), flush=True)\nif os.fork() == 0:\n    os.setsid()\n"
    "    if os.fork() == 0:\n"
    '        late = \'import sys, time; time.sleep(0.7); open(sys.argv[1], "w").write("x")\'\n'
    "        os.execv(sys.executable, [sys.executable, '-c', late, {out!r}, '{token}'])\n"
    "    os._exit(0)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("sandbox_name", ["kernel", "hooks"])
@pytest.mark.parametrize("ending", ["exits", "times out"])
def test_every_process_of_a_run_dies_with_it(ending, sandbox_name, tmp_path, outside):
    # Below the hook: a detached daemon (new session, parent gone) ends with the run.
    token = uuid.uuid4().hex
    code = _DAEMON.format(out=str(outside), token=token)
    if ending == "times out":
        code += "import time\ntime.sleep(30)\n"
    boot = _boot_without_hook(tmp_path)
    r = _sandboxed(code, boot=boot, timeout_s=0.5, sandbox=sandbox_name)
    assert r["timed_out"] is (ending == "times out"), r
    assert not _processes_with(token), r
    uid = int(r["stdout"].split()[0])
    if os.geteuid() == 0:  # the run had a user of its own: none of its processes is left
        assert uid != 0 and not _processes_of_uid(uid)
    time.sleep(1.0)
    assert not outside.exists() and not _processes_with(token)


def test_timeout_holds_with_a_large_stdin_the_code_never_reads():
    r = _sandboxed("import time\ntime.sleep(20)", timeout_s=1, stdin="x" * 200_000, outer=15)
    assert r["timed_out"] and r["elapsed"] < 4, r


def test_code_that_writes_before_it_reads_a_large_stdin():
    code = "import sys\nsys.stdout.write('y' * 300_000)\nprint(len(sys.stdin.read()))"
    r = _sandboxed(code, timeout_s=5, stdin="x" * 200_000, max_output_bytes=10**6, outer=15)
    assert r["exit_code"] == 0 and r["stdout"] == "y" * 300_000 + "200000\n", r["stderr"]
    assert r["elapsed"] < 4


def test_code_tests_with_a_large_stdin_and_per_line_output():
    lines = "".join(f"{i:07d}\n" for i in range(25_000))  # 200 kB in, 200 kB out
    body = (
        "import json, time\nfrom grpo_jax.rewards.code import run_tests\nt0 = time.monotonic()\n"
        "code = 'import sys\\nfor line in sys.stdin:\\n    print(line, end=\"\")'\n"
        f"score = run_tests(code, [{{'input': {lines!r}, 'output': {lines!r}}}], timeout_s=5)\n"
        "print(json.dumps({'score': score, 'elapsed': time.monotonic() - t0}))"
    )
    got = _isolated(body, timeout=20)
    assert got["score"] == 1.0 and got["elapsed"] < 5, got


def test_opening_with_truncate_is_a_write():
    # /dev/null is readable by the code and truncating it changes nothing: an open that the
    # hook lets through as a read succeeds here, and would truncate a file in the Python
    # installation that the sandbox's user could write.
    r = _sandboxed("import os\nos.open('/dev/null', os.O_RDONLY | os.O_TRUNC)", timeout_s=5)
    assert r["exit_code"] == 1 and "sandbox: writing '/dev/null'" in r["stderr"], r


def test_swapping_a_directory_in_for_a_file_gets_no_descriptor(outside):
    # A second thread renames a directory and a file back and forth under the name the
    # first thread opens: no check of the name before the open can see which it will be.
    code = f"""
import os, stat, sys, _thread, time
sys.setswitchinterval(1e-6)
os.makedirs('c/c/c'); os.mkdir('d'); open('x', 'w').close()
def swap():
    while True:
        os.rename('x', 't'); os.rename('d', 'x'); os.rename('x', 'd'); os.rename('t', 'x')
_thread.start_new_thread(swap, ())
t0, errors = time.monotonic(), set()
while time.monotonic() - t0 < 1.0:
    try:
        fd = os.open('x', os.O_RDONLY)
    except OSError as e:
        errors.add(str(e) if isinstance(e, PermissionError) else 'missing')
        continue
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.chdir('c/c/c')
        os.open('../../{outside.name}', os.O_CREAT | os.O_WRONLY, dir_fd=fd)
        print('got a directory descriptor')
        break
    os.close(fd)
print(sorted(errors), flush=True)
os._exit(0)
"""
    r = _sandboxed(code, timeout_s=5)
    assert "directory descriptor" not in r["stdout"] and not outside.exists(), r
    assert "not allowed" in r["stdout"], r


def test_output_printed_before_an_exception_is_kept():
    r = _sandboxed("print(42)\n1/0", timeout_s=5)
    assert r["stdout"] == "42\n" and "ZeroDivisionError" in r["stderr"], r


def test_bytes_paths_work_inside_and_are_refused_outside(outside):
    code = (
        "open(b'name', 'w').write('x')\nprint(open(b'name').read())\n"
        f"open({str(outside).encode()!r}, 'w')"
    )
    r = _sandboxed(code, timeout_s=5)
    assert r["stdout"] == "x\n" and "PermissionError" in r["stderr"], r
    assert "TypeError" not in r["stderr"] and not outside.exists(), r


def test_the_whole_standard_library_imports():
    # Under a root trainer the code runs as another user, who may not be able to read the
    # interpreter's files (a Python installed under /root).
    code = (
        "import queue, threading, concurrent.futures, zoneinfo, csv, sqlite3\n"
        "q = queue.Queue()\nthreading.Thread(target=q.put, args=(7,)).start()\nprint(q.get())"
    )
    r = _sandboxed(code, timeout_s=5)
    assert r["stdout"] == "7\n", r["stderr"]


@pytest.fixture
def outsides():
    """A fresh name in each folder of the host that every user may write to (the shared
    temporary directory, /var/tmp, /dev/shm); whatever is made there is removed afterwards."""
    import tempfile

    token = uuid.uuid4().hex
    folders = {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"}
    paths = [
        pathlib.Path(d, f"grpo_outside_{token}")
        for d in sorted(folders)
        if os.path.isdir(d) and os.access(d, os.W_OK)
    ]
    yield paths
    for base in paths:
        for p in base.parent.glob(base.name + "*"):
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink()


def _made(paths) -> list[str]:
    return sorted(str(p) for base in paths for p in base.parent.glob(base.name + "*"))


# Escape 1 of issue 47: the original _imp.create_builtin from the closure of the wrapper
# that guards it gives a fresh posix module, whose mkfifo and mknod raise no audit event.
_FRESH_POSIX = """
import _imp, importlib.machinery as m, stat
orig = _imp.create_builtin.__closure__[0].cell_contents
posix = orig(m.ModuleSpec("posix", m.BuiltinImporter))
_imp.exec_builtin(posix)
print("fresh posix", posix.mkfifo.__name__, flush=True)
for base in {paths!r} + ["made_inside"]:
    for kind, make in (
        ("fifo", lambda p: posix.mkfifo(p)),
        ("file", lambda p: posix.mknod(p, stat.S_IFREG | 0o600)),
    ):
        try:
            make(base + "_" + kind)
            print("made", base + "_" + kind)
        except OSError as e:
            print("not made", kind, e.errno)
"""

# Escape 2: _posixsubprocess loaded under another name passes the hook's exact-name check,
# and its fork_exec raises no audit event: /bin/sh writes outside and starts a python
# without the hook, which reads /etc/passwd and the checkout's README.md.
_ANY_PROGRAM = """
import _imp, importlib.machinery as m, os, sys
spec = m.PathFinder.find_spec("_posixsubprocess")
ps = _imp.create_dynamic(m.ModuleSpec("x._posixsubprocess", None, origin=spec.origin))
print("loaded", ps.fork_exec.__name__, flush=True)
reader = "print(open('/etc/passwd').read()); print(open({readme!r}).read())"
script = "for f in {paths_text}; do echo escaped > $f; done; "
script += sys.executable + ' -c "' + reader + '"'
for exe in ("/bin/sh", "/usr/bin/sh"):
    args = [exe.encode(), b"-c", script.encode()]
    r, w = os.pipe()
    head = (args, [exe.encode()], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False)
    for tail in ((-1, -1, None, -1, -1, None, True), (-1, -1, None, -1, -1, None),
                 (-1, None, -1, -1, None)):
        try:
            pid = ps.fork_exec(*head, *tail)
        except TypeError:
            continue
        except OSError as e:
            print("not started", exe, e.errno)
            break
        os.close(w)
        failed = os.read(r, 200)
        print("exit", exe, os.waitpid(pid, 0)[1], failed, flush=True)
        break
"""


@pytest.mark.parametrize("hook", ["with the hook", "hook left out"])
def test_a_fresh_posix_makes_nothing_outside(hook, outsides, tmp_path):
    code = _FRESH_POSIX.format(paths=[str(p) for p in outsides])
    boot = _boot_without_hook(tmp_path) if hook == "hook left out" else None
    r = _sandboxed(code, boot=boot, timeout_s=5)
    assert _made(outsides) == [], r
    assert "made" not in r["stdout"].replace("not made", ""), r
    if boot:  # the route itself works; the kernel refuses each file
        assert "fresh posix mkfifo" in r["stdout"], r
        assert r["stdout"].count("not made") == 2 * (len(outsides) + 1), r


@pytest.mark.parametrize("hook", ["with the hook", "hook left out"])
def test_a_renamed_posixsubprocess_starts_nothing_that_reaches_out(hook, outsides, tmp_path):
    readme = pathlib.Path(_ROOT, "README.md")
    code = _ANY_PROGRAM.format(readme=str(readme), paths_text=" ".join(str(p) for p in outsides))
    boot = _boot_without_hook(tmp_path) if hook == "hook left out" else None
    r = _sandboxed(code, boot=boot, timeout_s=5)
    time.sleep(0.2)
    assert _made(outsides) == [], r
    passwd = pathlib.Path("/etc/passwd").read_text().splitlines()[0]
    assert passwd not in r["stdout"] and readme.read_text().splitlines()[2] not in r["stdout"], r
    if boot:
        assert "loaded fork_exec" in r["stdout"], r


_LOOK_AROUND = """
import os
print("visible", sorted(p for p in {paths!r} if os.path.exists(p)))
if {walk!r}:
    writable = []
    for d, dirs, _ in os.walk("/"):
        if d.startswith(("/proc", "/sys")) or d.count("/") >= 6:
            dirs[:] = []
        try:
            fd = os.open(os.path.join(d, ".probe"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except OSError:
            continue
        os.close(fd)
        os.unlink(os.path.join(d, ".probe"))
        writable.append(d)
    print("writable", writable, os.getcwd())
"""


@pytest.mark.parametrize("hook", ["with the hook", "hook left out"])
def test_nothing_of_the_host_is_visible_or_writable(hook, outsides, tmp_path):
    # Files every user may read, the checkout, a fresh file in each world-writable folder.
    for p in outsides:
        p.write_text("host file")
    readme = pathlib.Path(_ROOT, "README.md")
    checkout = [str(readme), grpo_jax.__file__, str(pathlib.Path(_ROOT, "pyproject.toml"))]
    paths = ["/etc/passwd", "/etc/hostname", *checkout, str(tmp_path)]
    paths += [str(p) for p in outsides]
    boot = _boot_without_hook(tmp_path) if hook == "hook left out" else None
    code = _LOOK_AROUND.format(paths=paths, walk=bool(boot))
    r = _sandboxed(code, boot=boot, timeout_s=20, outer=60)
    assert r["exit_code"] == 0 and "visible []\n" in r["stdout"], r
    if boot:  # below the hook: the run's own directory is the one place it may write
        written = r["stdout"].split("writable ", 1)[1].split()
        assert written[0] == f"[{written[1]!r}]", r
