"""Running untrusted Python code: a separate, limited process in a private directory.

    result = run_python("print(2 + 3)", timeout_s=5.0, memory_mb=256)
    result.stdout, result.stderr, result.exit_code, result.timed_out   # '5\n', '', 0, False

What bounds the code, and who enforces it:

* **Wall time**: the parent waits ``timeout_s`` seconds, then kills the child's whole
  process group (SIGKILL; the child is started in a new session). Enforced by the
  kernel; ``timed_out`` is then True.
* **CPU time, memory, processes, file size, open files**: ``RLIMIT_CPU`` (the timeout
  rounded up, plus one second: a backstop the wall clock reaches first, since a
  single-threaded child's CPU time runs no faster than the clock), ``RLIMIT_AS``
  (``memory_mb``), ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, set by the
  child on itself before the code runs. Kernel-enforced: an allocation past the limit
  raises ``MemoryError``, a write past the file size fails with ``EFBIG``. A trainer
  running as root would make ``RLIMIT_NPROC`` void and every file writable, so under
  root the child first becomes the ``nobody`` user. (Not in the ``unshare -r``
  namespace of a non-root trainer: its uid 0 there is the trainer's own uid outside.)
* **Output**: stdout and stderr are read as they come, at most ``max_output_bytes``
  each; a child that writes more is killed at once and ``truncated`` is True, so
  printing gigabytes costs neither memory nor time in the trainer.
* **Network**: when ``unshare`` can make a network namespace (Linux, root or user
  namespaces allowed), the child runs in a new, empty one: no interface but a
  loopback that is down, kernel-enforced. :func:`network_isolation` says which
  applies. In every case an audit hook in the child refuses to create sockets.
* **Files and processes**: the working directory is a fresh temporary directory,
  removed afterwards. An audit hook (PEP 578) installed before the code runs refuses
  writing outside that directory, reading outside it and the Python installation,
  starting processes (``fork``, ``exec``, ``subprocess``, ``os.system``), sending
  signals, sockets, native code (``ctypes``) and subinterpreters. It also refuses to
  open directories, since the audit event of ``open`` does not carry ``dir_fd`` and a
  path relative to a directory's descriptor would be checked against the wrong place,
  and changing a file through a descriptor (``fchmod``) unless the file is in the
  directory. ``os.mkfifo`` and ``os.mknod`` raise no audit event at all, so they are
  removed from ``os`` and ``posix`` before the code runs.

The audit hook guards against accidents and the ordinary ways of doing these things
inside Python; it is not a hardened jail against code written to escape it (a
C extension in the installation could still be imported). Run code you suspect of
malice inside a container or a virtual machine as well.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_BOOT = pathlib.Path(__file__).with_name("_sandbox_boot.py")
DEFAULT_MAX_OUTPUT = 64 * 1024
_SIGNALS = {int(x) for x in signal.Signals}


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a sandboxed run (or any tool) gave back.

    Attributes:
      stdout, stderr: the text it wrote (at most ``max_output_bytes`` each).
      exit_code: the process's exit status; negative: killed by that signal
        (-9 when the timeout or the output cap killed it); 0 for a tool that ran fine.
      timed_out: the wall-clock limit was reached and the process group killed.
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
    # Root may make a network namespace directly; others need a user namespace that
    # maps them to themselves (so RLIMIT_NPROC still counts their processes). Older
    # unshare has no -c; under -r the child is uid 0 inside, its own uid outside, and
    # the boot script leaves that uid as it is (see _sandbox_boot._is_real_root).
    options = [("-n",)] if os.geteuid() == 0 else [("-c", "-n"), ("-r", "-n")]
    for opts in options:
        cmd = (exe, *opts)
        try:
            ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return cmd
    return ()


def network_isolation() -> str:
    """How the child is cut off the network: "namespace" or "audit hook" (sockets refused)."""
    return "namespace" if _unshare_prefix() else "audit hook"


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

    Returns:
      :class:`ToolResult`. Nothing the code does raises here; bad arguments do.
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    _check("timeout_s", timeout_s, lo=0.01)
    _check("memory_mb", memory_mb, lo=16)
    _check("max_output_bytes", max_output_bytes, lo=1)
    limits = {
        "cpu_s": math.ceil(timeout_s) + 1,
        "memory_bytes": int(memory_mb) * 2**20,
        "file_bytes": int(max_file_mb) * 2**20,
        "nproc": int(max_processes),
    }
    workdir = tempfile.mkdtemp(prefix="grpo_sandbox_")
    try:
        os.chmod(workdir, 0o700)
        code_path = os.path.join(workdir, "main.py")
        with open(code_path, "w", encoding="utf-8") as f:
            f.write(code)
        for name, text in (files or {}).items():
            target = os.path.realpath(os.path.join(workdir, name))
            if not target.startswith(os.path.realpath(workdir) + os.sep):
                raise ValueError(f"run_python: file name {name!r} leaves the sandbox directory")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
        cmd = [
            *_unshare_prefix(),
            sys.executable,
            "-I",  # isolated: no PYTHON* variables, no user site, no script dir on the path
            "-X",
            "utf8",
            str(_BOOT),
            workdir,
            code_path,
            json.dumps(limits),
        ]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        }
        return _run(cmd, env, workdir, stdin, timeout_s, int(max_output_bytes))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _run(cmd, env, cwd, stdin: str, timeout_s: float, cap: int) -> ToolResult:
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,  # its own process group: one killpg ends all it started
        close_fds=True,
    )
    out = {"stdout": bytearray(), "stderr": bytearray()}
    timed_out = truncated = False
    deadline = time.monotonic() + timeout_s
    try:
        try:
            proc.stdin.write(stdin.encode("utf-8"))
        except (BrokenPipeError, OSError):
            pass
        proc.stdin.close()
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        open_streams = 2
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fileobj.fileno(), 65536)
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
        sel.close()
        if timed_out or truncated:
            _kill_group(proc)
        else:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
        exit_code = proc.wait()
    finally:
        _kill_group(proc)  # anything it left in its group goes too
        for stream in (proc.stdout, proc.stderr):
            stream.close()
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
