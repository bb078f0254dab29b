"""Symbolic answer equivalence through the math-verify library, in a killable process.

sympy can hang, sometimes in C code no Python timeout reaches, and math-verify's own
timeouts work only in a main thread; so the verifier runs in one persistent child process
(``_math_worker.py``), each completion a request with a deadline, and a request past it
kills the child and costs that completion a NaN counted as an error (docs/rewards.md).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import subprocess
import sys
import threading
import time

from grpo_jax.rewards.extract import last_tag
from grpo_jax.rewards.registry import register

_WORKER_PATH = pathlib.Path(__file__).with_name("_math_worker.py")


class MathVerifyProcess:
    """A persistent math-verify child process, restarted after a timeout or crash."""

    def __init__(self, startup_timeout_s: float = 120.0):
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self.restarts = 0

    def _read_line(self, deadline: float) -> bytes | None:
        """One reply line, or None at the deadline or when the child has exited."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _start(self) -> None:
        self._buf = b""
        self._proc = subprocess.Popen(
            [sys.executable, str(_WORKER_PATH)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self._read_line(time.monotonic() + self.startup_timeout_s)
        if line is None or json.loads(line) != {"ready": True}:
            self.close()
            raise RuntimeError(
                f"math-verify worker {_WORKER_PATH} did not start within "
                f"{self.startup_timeout_s}s (is math-verify installed?)"
            )

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                f.close()

    def check(
        self,
        gold: str,
        pred: str,
        *,
        timeout_s: float = 5.0,
        deadline_s: float | None = None,
        _sleep: float = 0.0,
    ):
        """1.0 / 0.0 for equivalence, None if ``gold`` cannot be parsed, or an Exception.

        ``timeout_s`` bounds each of math-verify's parse and verify steps
        (whole seconds, at least 1); the child is killed when the whole request
        exceeds ``deadline_s`` (default ``3 * timeout_s + 2``).
        """
        t = max(1, int(round(timeout_s)))
        deadline_s = 3 * t + 2 if deadline_s is None else deadline_s
        request = json.dumps({"gold": gold, "pred": pred, "timeout": t, "sleep": _sleep})
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self.close()
                    self.restarts += 1
                self._start()
            try:
                self._proc.stdin.write(request.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                self.close()
                return RuntimeError(f"math-verify worker died: {e}")
            line = self._read_line(time.monotonic() + deadline_s)
            if line is None:
                died = self._proc.poll() is not None
                self.close()
                self.restarts += 1
                if died:
                    return RuntimeError("math-verify worker exited while verifying")
                return TimeoutError(f"math-verify ran past {deadline_s}s; worker restarted")
        reply = json.loads(line)
        if "error" in reply:
            return RuntimeError(reply["error"])
        return reply["value"]


_SHARED: MathVerifyProcess | None = None
_SHARED_LOCK = threading.Lock()


def shared_process() -> MathVerifyProcess:
    """The process-wide math-verify child (closed at interpreter exit)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MathVerifyProcess()
            atexit.register(_SHARED.close)
        return _SHARED


def make_math_verify_reward(timeout_s: float = 5.0, tag: str | None = "answer"):
    """1.0 if the completion's answer is mathematically equivalent to ``answer``.

    The prediction is the content of the last ``<tag>`` block when there is
    one, else the whole completion (math-verify then finds the last
    ``\\boxed{}`` or expression itself). NaN where the reference cannot be
    parsed; a completion whose check errs or hangs gets NaN and is counted.
    """

    def math_verify_reward(prompts, completions, *, answer, **_) -> list:
        del prompts
        worker = shared_process()
        out = []
        for completion, ref in zip(completions, answer):
            if ref is None:
                out.append(None)
                continue
            tagged = last_tag(completion, tag) if tag else None
            pred = tagged if tagged is not None else completion
            out.append(worker.check(str(ref), pred, timeout_s=timeout_s))
        return out

    math_verify_reward.manages_timeout = True
    return math_verify_reward


register("math_verify", factory=True)(make_math_verify_reward)
