"""The processes that score user rewards for :mod:`grpo_jax.rewards.isolation`: a pool of them.

A :class:`Worker` is one process running :mod:`grpo_jax.rewards._reward_worker` and the two
pipes it is spoken to through; a :class:`Pool` holds up to ``size`` of them, idle, busy or
starting, and replaces one that was killed in the background. Workers are fresh interpreters
(never a fork of this process and its JAX threads) with ``JAX_PLATFORMS=cpu``, in process
groups of their own, that die with this process (docs/rewards.md, "Where a reward runs").
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

_WORKER_PATH = pathlib.Path(__file__).with_name("_reward_worker.py")
_HEADER = struct.Struct("<Q")


class Unavailable(RuntimeError):
    """The reward cannot run in a worker (it then runs in this process)."""


class Died(Exception):
    """The worker exited, or its pipe broke."""


def encode(message) -> bytes:
    """Pickles a request; raises Unavailable when its contents cannot be pickled."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 -- PicklingError, TypeError, AttributeError, ...
        raise Unavailable(f"its arguments cannot be sent to a worker process ({e!r})") from None


class Worker:
    """One worker process and its two pipes."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.fd = proc.stdout.fileno()
        self.buf = bytearray()
        self.loaded: set[tuple[str, str | None]] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message) -> None:
        """Sends a message, or bytes that :func:`encode` made of one."""
        data = message if isinstance(message, bytes) else encode(message)
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise Died(f"cannot write to worker {self.pid}: {e}") from None

    def poll(self):
        """Reads what the pipe holds; -> a complete reply, or None. Raises Died at EOF."""
        try:
            chunk = os.read(self.fd, 1 << 20)
        except OSError as e:
            raise Died(str(e)) from None
        if not chunk:
            raise Died(f"worker {self.pid} exited")
        self.buf += chunk
        return self._frame()

    def _frame(self):
        if len(self.buf) < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(self.buf)
        if len(self.buf) < _HEADER.size + n:
            return None
        data = bytes(self.buf[_HEADER.size : _HEADER.size + n])
        del self.buf[: _HEADER.size + n]
        try:
            return pickle.loads(data)
        except Exception as e:  # noqa: BLE001 -- e.g. an exception class missing here
            return ("raised", RuntimeError(f"unreadable reply from the reward worker: {e!r}"))

    def recv(self, deadline: float):
        """The next reply; None at the deadline. Raises Died when the worker exits."""
        message = self._frame()
        if message is not None:
            return message
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if sel.select(left):
                    message = self.poll()
                    if message is not None:
                        return message

    def kill(self) -> None:
        proc = self.proc
        if proc.returncode is None:  # not reaped yet: the group id still names its group
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own children too
            except (ProcessLookupError, PermissionError):
                proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Pool:
    """Up to ``size`` workers: idle ones, busy ones, and ones starting in the background."""

    def __init__(self, size: int, startup_timeout_s: float):
        self.size = size
        self.startup_timeout_s = startup_timeout_s
        self._cond = threading.Condition()
        self._idle: list[Worker] = []
        self._busy: set[Worker] = set()
        self._starting = 0
        self._closed = False
        self._broken: str | None = None  # why workers cannot start, once one failed to
        self._modules: list[tuple[str, str | None]] = []  # imported by every new worker
        self._bad_modules: dict[tuple[str, str | None], str] = {}
        self._spawns: collections.deque = collections.deque()
        # Workers are started from one long-lived thread: PR_SET_PDEATHSIG fires
        # when the thread that started the process ends, not only the process.
        self._spawner = threading.Thread(target=self._spawn_loop, name="reward-spawner")
        self._spawner.daemon = True
        self._spawner.start()

    # -- starting workers --------------------------------------------------

    def _fill(self) -> None:
        """Starts workers until the pool is full (caller holds the lock)."""
        if self._closed or self._broken:
            return
        while len(self._idle) + len(self._busy) + self._starting < self.size:
            self._starting += 1
            self._spawns.append(list(self._modules))
            self._cond.notify_all()

    def _spawn_loop(self) -> None:
        while True:
            with self._cond:
                while not self._spawns and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                modules = self._spawns.popleft()
            try:
                proc = subprocess.Popen(
                    [sys.executable, str(_WORKER_PATH), str(os.getpid())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                )
            except OSError as e:
                self._started(None, modules, f"cannot start a reward worker: {e}")
                continue
            threading.Thread(
                target=self._await_ready, args=(Worker(proc), modules), daemon=True
            ).start()

    def _await_ready(self, worker: Worker, modules) -> None:
        try:
            worker.send({"sys_path": list(sys.path), "modules": modules})
            reply = worker.recv(time.monotonic() + self.startup_timeout_s)
        except Died as e:
            reply, why = None, f"the reward worker exited while starting ({e})"
        else:
            why = f"the reward worker did not start within {self.startup_timeout_s}s"
        if not (isinstance(reply, tuple) and reply and reply[0] == "ready"):
            worker.kill()
            self._started(None, modules, why)
            return
        failed = reply[1]
        for i, module in enumerate(modules):
            if i not in failed:
                worker.loaded.add(module)
        self._started(worker, modules, None, {modules[i]: err for i, err in failed.items()})

    def _started(self, worker, modules, why, failed=None) -> None:
        with self._cond:
            self._starting -= 1
            if worker is not None and self._closed:
                worker.kill()
            elif worker is not None:
                self._idle.append(worker)
                for module, err in (failed or {}).items():
                    self._bad_modules.setdefault(module, err)
            elif not self._closed:
                self._broken = why
                log.warning("%s; user rewards run in this process from now on", why)
            self._cond.notify_all()

    # -- using workers -----------------------------------------------------

    def acquire(self, *, block: bool = True) -> Worker | None:
        """An idle worker (waiting up to the start-up timeout when ``block``), else None.

        Raises Unavailable when workers cannot start or the pool was shut down.
        """
        deadline = time.monotonic() + self.startup_timeout_s
        with self._cond:
            if self.size == 0:
                raise Unavailable("the pool has no workers (workers=0)")
            self._fill()
            while not self._idle:
                if self._closed:
                    raise Unavailable("the reward workers were shut down")
                if self._broken:
                    raise Unavailable(self._broken)
                left = deadline - time.monotonic()
                if not block or left <= 0:
                    return None
                self._cond.wait(left)
            worker = self._idle.pop()
            self._busy.add(worker)
            return worker

    def release(self, worker: Worker) -> None:
        with self._cond:
            self._busy.discard(worker)
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
            self._cond.notify_all()

    def discard(self, worker: Worker) -> None:
        """Kills a worker (past its deadline, or dead) and starts its replacement."""
        worker.kill()
        with self._cond:
            self._busy.discard(worker)
            self._fill()

    def ensure_loaded(self, worker: Worker, module: tuple[str, str | None]) -> None:
        """Has ``worker`` import ``module``; raises Unavailable if it cannot."""
        if module in worker.loaded:
            return
        with self._cond:
            err = self._bad_modules.get(module)
        if err is None:
            try:
                worker.send(("load", *module))
                reply = worker.recv(time.monotonic() + self.startup_timeout_s)
            except Died as e:
                reply = ("loaded", f"the worker exited while importing it ({e})")
            if reply is None:
                reply = ("loaded", f"the import took over {self.startup_timeout_s}s")
                self.discard(worker)
                worker = None
            err = reply[1]
        if err is not None:
            with self._cond:
                self._bad_modules.setdefault(module, err)
            if worker is not None:
                self.release(worker)
            raise Unavailable(f"a reward worker cannot import {module[0]!r}: {err}")
        worker.loaded.add(module)
        with self._cond:
            if module not in self._modules:
                self._modules.append(module)

    def pids(self) -> list[int]:
        with self._cond:
            return sorted(w.pid for w in [*self._idle, *self._busy])

    def close(self) -> None:
        with self._cond:
            self._closed = True
            workers = [*self._idle, *self._busy]
            self._idle.clear()
            self._busy.clear()
            self._cond.notify_all()
        for w in workers:
            w.kill()
