"""Running untrusted Python code: a separate, limited process in a private directory.

    result = run_python("print(2 + 3)", timeout_s=5.0, memory_mb=256)
    result.stdout, result.stderr, result.exit_code, result.timed_out   # '5\\n', '', 0, False

Two sandboxes, chosen by ``sandbox=`` (or ``GRPO_JAX_SANDBOX``): ``"kernel"`` (the default),
bubblewrap namespaces with a seccomp filter, where :class:`SandboxUnavailable` says in one
line why it cannot run; and ``"hooks"``, a Python audit hook as the wall (weaker, only when
named). docs/multiturn.md, "The sandbox", says which layer enforces what.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import pwd
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpo_jax.tools.bubblewrap as bubblewrap
import grpo_jax.tools.seccomp as seccomp
from grpo_jax.core.errors import ConfigError

# The boot script's text is given to the interpreter (``-c``), not its path: the run's user
# need not be able to read the checkout.
_BOOT = pathlib.Path(__file__).with_name("_sandbox_boot.py")
DEFAULT_MAX_OUTPUT = 64 * 1024
_SIGNALS = {int(x) for x in signal.Signals}
SANDBOXES = ("kernel", "hooks")
ENV_VAR = "GRPO_JAX_SANDBOX"


class SandboxUnavailable(ConfigError):
    """The kernel sandbox cannot run on this machine; the message says what is missing."""


def sandbox_mode(sandbox: str | None = None) -> str:
    """The sandbox that runs code: ``sandbox`` ("kernel" or "hooks"), or when None the
    ``GRPO_JAX_SANDBOX`` environment variable, else "kernel".

    Raises ConfigError for another name and :class:`SandboxUnavailable` (one line: what is
    missing and how to install it) when "kernel" cannot run here. "hooks" is never chosen
    for the user: it must be named.
    """
    where = "sandbox"
    if sandbox is None:
        sandbox, where = os.environ.get(ENV_VAR, "") or "kernel", ENV_VAR
    if sandbox not in SANDBOXES:
        raise ConfigError(
            f"{where} = {sandbox!r} must be 'kernel' (bubblewrap: namespaces and seccomp, "
            "the default) or 'hooks' (Python audit hooks, weaker)"
        )
    if sandbox == "kernel":
        problem = bubblewrap.problem()
        if problem is not None:
            raise SandboxUnavailable(problem)
    return sandbox


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a sandboxed run (or any tool) gave back.

    Attributes:
      stdout, stderr: the text it wrote (at most ``max_output_bytes`` each).
      exit_code: the process's exit status; negative: killed by that signal
        (-9 when the timeout or the output cap killed it); 0 for a tool that ran fine.
      timed_out: the wall-clock limit was reached and every process of the run killed.
      truncated: the output passed its cap; the process was killed there.
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    # Root may make namespaces directly; others need a user namespace that maps them to
    # themselves (so RLIMIT_NPROC still counts their processes). Older unshare has no -c;
    # under -r the child is uid 0 inside, its own uid outside, and the boot script leaves
    # that uid as it is (see _sandbox_boot._is_real_root). A pid namespace (-p -f) ends
    # every process of the run with its first one, whatever session it made for itself;
    # --kill-child ends that first one with unshare. Root also gets a mount namespace of
    # its own, in which the boot script makes the Python installation readable to the
    # run's user (-m; mounts there are private).
    pid = ("-p", "-f", "--kill-child")
    if os.geteuid() == 0:
        options = [("-n", *pid, "-m"), ("-n", *pid), ("-n",)]
    else:
        options = [("-c", "-n", *pid), ("-r", "-n", *pid), ("-c", "-n"), ("-r", "-n")]
    for opts in options:
        cmd = (exe, *opts)
        try:
            ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return cmd
    return ()


# Users for the runs of a root trainer: above the ranges that system and directory-service
# accounts use, one per run (see _run_uid).
_RUN_UIDS = (2_000_300_000, 2_147_000_000)
_uids_in_use: set[int] = set()
_uids_lock = threading.Lock()


def _run_uid() -> int | None:
    """A user id no account and no other run of this process has, for one run under root.

    Its processes are then exactly the run's: RLIMIT_NPROC counts only them, concurrent
    runs cannot signal each other, and after the run every process of that user is ended.
    None where such ids are not mapped (a user namespace of 65536 ids): the run is then
    nobody, shared with other runs, and its processes are found by session only.
    """
    mapped = []
    try:
        with open("/proc/self/uid_map", encoding="ascii") as f:
            for line in f:
                inside, _, count = (int(x) for x in line.split())
                mapped.append((inside, inside + count))
    except (OSError, ValueError):
        pass
    for _ in range(100):
        uid = random.randrange(*_RUN_UIDS)
        if not any(lo <= uid < hi for lo, hi in mapped):
            return None
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        with _uids_lock:
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid
    return None


def network_isolation(sandbox: str | None = None) -> str:
    """How the child is cut off the network: "namespace" or "audit hook" (sockets refused).

    ``sandbox`` as for :func:`sandbox_mode`; the kernel sandbox always has a namespace.
    """
    if sandbox is None:
        sandbox = os.environ.get(ENV_VAR, "") or "kernel"
    return "namespace" if sandbox == "kernel" or _unshare_prefix() else "audit hook"


def _check(name: str, value, *, lo: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= lo:
        raise ValueError(f"run_python: {name} = {value!r} must be a number >= {lo}")
    if not math.isfinite(value):
        raise ValueError(f"run_python: {name} = {value!r} must be finite")


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    stdin: str = "",
    max_output_bytes: int = DEFAULT_MAX_OUTPUT,
    max_file_mb: int = 16,
    max_processes: int = 16,
    files: dict[str, str] | None = None,
    sandbox: str | None = None,
) -> ToolResult:
    """Runs ``code`` in a fresh, limited Python process (see the module docstring).

    Args:
      code: Python source, run as ``__main__`` (``main.py``) in a private temporary
        directory that is deleted afterwards.
      timeout_s: wall-clock limit; the CPU-time limit is one second more, rounded up.
      memory_mb: address-space limit of the child.
      stdin: text fed to the child's standard input.
      max_output_bytes: cap on each of stdout and stderr.
      max_file_mb: the largest file the child may write.
      max_processes: RLIMIT_NPROC (the audit hook refuses new processes anyway).
      files: extra files {relative name: text} written into the directory first.
      sandbox: "kernel" or "hooks" (:func:`sandbox_mode`; None: ``GRPO_JAX_SANDBOX``,
        else "kernel").

    Returns:
      :class:`ToolResult`. Nothing the code does raises here; bad arguments do, and
      :class:`SandboxUnavailable` when the kernel sandbox cannot run on this machine.
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    _check("timeout_s", timeout_s, lo=0.01)
    _check("memory_mb", memory_mb, lo=16)
    _check("max_output_bytes", max_output_bytes, lo=1)
    kernel = sandbox_mode(sandbox) == "kernel"
    run_uid = _run_uid() if os.geteuid() == 0 else None
    limits = _limits(kernel, run_uid, timeout_s, memory_mb, max_file_mb, max_processes)
    workdir = tempfile.mkdtemp(prefix="grpo_sandbox_")
    try:
        _fill_workdir(workdir, code, files or {}, limits["uid"])
        inside = bubblewrap.WORKDIR if kernel else workdir
        boot = [sys.executable, "-I", "-X", "utf8", "-c", pathlib.Path(_BOOT).read_text()]
        boot += [inside, os.path.join(inside, "main.py"), json.dumps(limits)]
        args = (_child_env(inside), workdir, stdin, timeout_s, int(max_output_bytes), run_uid)
        if not kernel:
            return _run([*_unshare_prefix(), *boot], *args)
        # bwrap reads the seccomp filter from a pipe (a few hundred bytes: no blocking).
        filter_r, filter_w = os.pipe()
        try:
            os.write(filter_w, seccomp.filter_program())
            os.close(filter_w)
            filter_w = -1
            cmd = [*bubblewrap.command(workdir, filter_r), *boot]
            return _run(cmd, *args, extra_fds=(filter_r,))
        finally:
            for fd in (filter_r, filter_w):
                if fd >= 0:
                    os.close(fd)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        with _uids_lock:
            _uids_in_use.discard(run_uid)


def _limits(kernel, run_uid, timeout_s, memory_mb, max_file_mb, max_processes) -> dict:
    """What the boot script applies in the child before the code runs."""
    return {
        "cpu_s": math.ceil(timeout_s) + 1,
        "memory_bytes": int(memory_mb) * 2**20,
        "file_bytes": int(max_file_mb) * 2**20,
        "nproc": int(max_processes),
        "uid": 65534 if run_uid is None else run_uid,
        "private_mounts": not kernel and "-m" in _unshare_prefix(),
        # Under bwrap the whole installation is readable by the run's user.
        "preload": not kernel,
    }


def _fill_workdir(workdir: str, code: str, files: dict[str, str], uid: int) -> None:
    """``main.py`` and the extra files, inside ``workdir`` only; owned by the run's user
    when the trainer is root."""
    os.chmod(workdir, 0o700)
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
        f.write(code)
    for name, text in files.items():
        target = os.path.realpath(os.path.join(workdir, name))
        if not target.startswith(os.path.realpath(workdir) + os.sep):
            raise ValueError(f"run_python: file name {name!r} leaves the sandbox directory")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    if os.geteuid() == 0:  # the run's user owns its directory (a root trainer's run)
        for parent, dirs, names in os.walk(workdir):
            for name in [parent, *(os.path.join(parent, n) for n in dirs + names)]:
                os.chown(name, uid, uid)


def _child_env(inside: str) -> dict[str, str]:
    """The child's whole environment: nothing of the trainer's is passed on."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": inside,
        "TMPDIR": inside,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }


def _strays(session: int, uid: int | None) -> list[int]:
    """Live processes of the run: in its session, or (when it had a user of its own) of its
    user. Linux only (read from /proc); elsewhere none are found."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="utf-8", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if fields["State"].split()[0] in ("Z", "X"):
                continue  # already dead, holding only its pid until its parent reaps it
            sid = int(fields["NSsid"].split()[0])
            real_uid = int(fields["Uid"].split()[0])
        except (OSError, KeyError, ValueError, IndexError):
            continue
        if sid == session or (uid is not None and real_uid == uid):
            found.append(int(entry))
    return found


def _end_run(proc: subprocess.Popen, uid: int | None, reaps_child: bool) -> None:
    """SIGKILL to every process the run started, until a look finds none left.

    The process group is not enough: code that gets past the audit hook can fork, start a
    new session and outlive it. In a pid namespace the kernel ends all of the run's
    processes with its first one; without one (or when that first process changed user,
    which clears unshare's --kill-child), what is left is found by session and by the
    run's own user. The process started here is ended last: when it is ``unshare -f``
    (``reaps_child``), it then reaps the child it forked and exits by itself, leaving no
    zombie in the group.
    """
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        strays = [pid for pid in _strays(proc.pid, uid) if pid != proc.pid]
        if not strays:
            break
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)
    if reaps_child:
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


def _read_status(fd: int) -> bytes:
    """What the boot script reported on ``fd`` (empty if it was killed first); closes it."""
    try:
        os.set_blocking(fd, False)
        return os.read(fd, 64)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _run(cmd, env, cwd, stdin: str, timeout_s: float, cap: int, uid, extra_fds=()) -> ToolResult:
    # The boot script forks the code's process and reports how it ended on this pipe.
    status_r, status_w = os.pipe()
    cmd[-1] = json.dumps({**json.loads(cmd[-1]), "status_fd": status_w})
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own session: what it starts is found by session id
            close_fds=True,
            pass_fds=(status_w, *extra_fds),
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    out = {"stdout": bytearray(), "stderr": bytearray()}
    timed_out = truncated = False
    deadline = time.monotonic() + timeout_s
    try:
        timed_out, truncated = _exchange(proc, stdin, out, deadline, cap)
        if not (timed_out or truncated):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        # The process, and anything it left in its session or under its user.
        # unshare -f and bwrap wait for the process they started, and exit after it.
        _end_run(proc, uid, reaps_child="--kill-child" in cmd or "--die-with-parent" in cmd)
        reported = _read_status(status_r)
        if reported:
            exit_code = int(reported)
        elif timed_out or truncated:
            exit_code = -signal.SIGKILL
        else:
            exit_code = proc.returncode
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
    return _result(out, exit_code, timed_out, truncated, timeout_s, cap)


def _exchange(proc: subprocess.Popen, stdin: str, out: dict, deadline: float, cap: int):
    """Feeds ``stdin`` to the child and reads its output into ``out`` until both of its
    output streams close, the deadline passes or the output passes ``cap`` bytes;
    -> (timed_out, truncated).

    stdin is written as the child takes it, in the same loop that reads its output and
    watches the clock: a child that reads nothing, or writes before it reads, blocks
    neither the parent nor the deadline.
    """
    timed_out = truncated = False
    pending = memoryview(stdin.encode("utf-8"))
    sel = selectors.DefaultSelector()
    try:
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
        else:
            proc.stdin.close()
        open_streams = 2
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                if key.data == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]) :]
                    except BlockingIOError:
                        continue
                    except OSError:  # the child closed its stdin: the rest is not wanted
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                buf = out[key.data]
                room = cap - len(buf)
                buf.extend(chunk[:room])
                truncated |= len(chunk) > room
            if truncated:
                break
    finally:
        sel.close()
    return timed_out, truncated


def _result(out: dict, exit_code: int, timed_out: bool, truncated: bool, timeout_s, cap):
    """The run's ToolResult; stderr ends with a line saying why the sandbox killed it."""
    stderr = out["stderr"].decode("utf-8", "replace")
    if timed_out:
        stderr += f"\n[sandbox] killed: wall-clock limit of {timeout_s:g} s reached"
    if truncated:
        stderr += f"\n[sandbox] killed: output passed the {cap}-byte limit"
    elif exit_code < 0 and not timed_out:
        name = signal.Signals(-exit_code).name if -exit_code in _SIGNALS else str(-exit_code)
        why = " (CPU-time limit)" if name == "SIGXCPU" else ""
        stderr += f"\n[sandbox] killed by signal {name}{why}"
    return ToolResult(
        stdout=out["stdout"].decode("utf-8", "replace"),
        stderr=stderr,
        exit_code=exit_code,
        timed_out=timed_out,
        truncated=truncated,
    )
