"""Worker processes for user reward functions: a deadline that can always be enforced.

Python cannot stop a thread, so a reward that spins in pure Python keeps
running (and taking CPU and the interpreter lock from the trainer) after its
deadline, and one stuck in C code that holds the interpreter lock (a regex
backtracking catastrophically) stops the whole process. Reward functions
registered by user code therefore run in a small pool of long-lived worker
processes (:mod:`grpo_jax.rewards._reward_worker`); a request past its
deadline costs its worker, which is killed (SIGKILL, with its process group)
and replaced in the background while the other workers go on.

Which rewards run where (:func:`runs_in_worker`):

* in this process: the built-in rewards of grpo_jax.rewards (``gsm8k``,
  ``exact_match``, ``countdown``, ``overlong``, ``format`` with its own
  template), which are linear-time Python and regexes, and ``math_verify``,
  which runs the verifier in a killable process of its own;
* in a worker: every reward registered by other code, and ``format`` given a
  ``pattern`` (a user's regex may backtrack catastrophically);
* in this process, with a warning once per reward: a user reward that a
  worker cannot import, because its ``register`` call ran in ``__main__`` (a
  script or notebook, which a worker must not re-run) or its function is
  defined inside another function; or when the workers cannot start or import
  its module. Move such a reward to the top level of a module and load it with
  :func:`grpo_jax.rewards.load_user_module` (the run config's
  ``reward_modules``) to have it run in a worker.

How a worker finds a user reward: :func:`grpo_jax.rewards.register` records
the module whose code called it (``__name__`` and ``__file__``). The worker
gets the parent's ``sys.path``, imports that module the same way (a file
given to ``load_user_module`` through ``load_user_module``; another module by
name, else from its file), which registers the reward in the worker's own
registry, then checks that the entry is the same function (module and
qualified name) and builds it from the same spec, options included.
Arguments and results travel pickled, so every reward sees its own copy of
the fields.

Workers are started with ``subprocess`` (a fresh interpreter, never a fork of
this process and its JAX threads), with ``JAX_PLATFORMS=cpu`` so that reward
code importing JAX never claims an accelerator, in a process group of their
own. They exit with this process: :func:`shutdown` runs at interpreter exit,
and a worker dies with its parent even when the parent is killed
(``PR_SET_PDEATHSIG`` on Linux, else a thread that watches the parent).

Workers are started on the first call that needs one (the pool fills up to
``workers``: 2, or the environment variable ``GRPO_JAX_REWARD_WORKERS``, or
:func:`configure`; 0 scores every reward in this process, e.g. to debug one),
and a killed one is replaced at once, in the background, so the next call does
not wait for a start-up (nor does a deadline count the wait for one).

What this means for a user reward: its module is imported again in each
worker (keep module-level work light, and guard a script's work with ``if
__name__ == "__main__":``); module-level state lives per worker and is lost
when a worker is killed; side effects on objects of this process (appending
to a list) do not happen here. Arguments and return values must pickle (an
argument that does not makes that call run in this process, with the
warning).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
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

import grpo_jax.rewards.registry as registry

log = logging.getLogger(__name__)

_WORKER_PATH = pathlib.Path(__file__).with_name("_reward_worker.py")
_HEADER = struct.Struct("<Q")
_POLL_S = 0.02  # how often a waiting dispatcher looks for a worker that became free

DEFAULT_WORKERS = 2
DEFAULT_STARTUP_TIMEOUT_S = 120.0
WORKERS_ENV = "GRPO_JAX_REWARD_WORKERS"  # the pool's size when set (0: all in process)


class Unavailable(RuntimeError):
    """The reward cannot run in a worker (it then runs in this process)."""


@dataclasses.dataclass(frozen=True)
class Reply:
    """Outcome of one request.

    ``kind`` is "ok" (``value``: what the reward returned), "raised"
    (``value``: the exception), "malformed" (``value``: the type name of a
    return value that could not be sent back), "timeout" or "died" (the
    worker was killed or exited), or "skipped" (not tried: the re-scoring gave
    up after too many lost workers).
    """

    kind: str
    value: object = None


class _Died(Exception):
    pass


def _encode(message) -> bytes:
    """Pickles a request; raises Unavailable when its contents cannot be pickled."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 -- PicklingError, TypeError, AttributeError, ...
        raise Unavailable(f"its arguments cannot be sent to a worker process ({e!r})") from None


class _Worker:
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
        """Sends a message, or bytes that :func:`_encode` made of one."""
        data = message if isinstance(message, bytes) else _encode(message)
        try:
            self.proc.stdin.write(_HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise _Died(f"cannot write to worker {self.pid}: {e}") from None

    def poll(self):
        """Reads what the pipe holds; -> a complete reply, or None. Raises _Died at EOF."""
        try:
            chunk = os.read(self.fd, 1 << 20)
        except OSError as e:
            raise _Died(str(e)) from None
        if not chunk:
            raise _Died(f"worker {self.pid} exited")
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
        """The next reply; None at the deadline. Raises _Died when the worker exits."""
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


class _Pool:
    """Up to ``size`` workers: idle ones, busy ones, and ones starting in the background."""

    def __init__(self, size: int, startup_timeout_s: float):
        self.size = size
        self.startup_timeout_s = startup_timeout_s
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
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
                target=self._await_ready, args=(_Worker(proc), modules), daemon=True
            ).start()

    def _await_ready(self, worker: _Worker, modules) -> None:
        try:
            worker.send({"sys_path": list(sys.path), "modules": modules})
            reply = worker.recv(time.monotonic() + self.startup_timeout_s)
        except _Died as e:
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

    def acquire(self, *, block: bool = True) -> _Worker | None:
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

    def release(self, worker: _Worker) -> None:
        with self._cond:
            self._busy.discard(worker)
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
            self._cond.notify_all()

    def discard(self, worker: _Worker) -> None:
        """Kills a worker (past its deadline, or dead) and starts its replacement."""
        worker.kill()
        with self._cond:
            self._busy.discard(worker)
            self._fill()

    def ensure_loaded(self, worker: _Worker, module: tuple[str, str | None]) -> None:
        """Has ``worker`` import ``module``; raises Unavailable if it cannot."""
        if module in worker.loaded:
            return
        with self._cond:
            err = self._bad_modules.get(module)
        if err is None:
            try:
                worker.send(("load", *module))
                reply = worker.recv(time.monotonic() + self.startup_timeout_s)
            except _Died as e:
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


def _default_workers() -> int:
    value = os.environ.get(WORKERS_ENV, "").strip()
    if not value:
        return DEFAULT_WORKERS
    try:
        workers = int(value)
    except ValueError:
        workers = -1
    if workers < 0:
        log.warning("%s=%r is not a non-negative integer; using %d", WORKERS_ENV, value, 2)
        return DEFAULT_WORKERS
    return workers


_settings = {"workers": _default_workers(), "startup_timeout_s": DEFAULT_STARTUP_TIMEOUT_S}
_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()
_ATEXIT = False


def _pool() -> _Pool:
    global _POOL, _ATEXIT
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = _Pool(_settings["workers"], _settings["startup_timeout_s"])
            if not _ATEXIT:
                atexit.register(shutdown)
                _ATEXIT = True
        return _POOL


def configure(*, workers: int | None = None, startup_timeout_s: float | None = None) -> None:
    """Sets the pool's size (0: every reward in this process) and start-up timeout.

    Shuts down the current workers; new ones start on the next call that needs one.
    """
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers={workers!r} must be a non-negative integer")
        _settings["workers"] = workers
    if startup_timeout_s is not None:
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s={startup_timeout_s!r} must be positive")
        _settings["startup_timeout_s"] = float(startup_timeout_s)
    shutdown()


def shutdown() -> None:
    """Kills every worker process (registered to run at interpreter exit).

    Scoring afterwards starts new workers when a reward needs them.
    """
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


def worker_pids() -> list[int]:
    """Process ids of the live workers (started and not killed)."""
    with _POOL_LOCK:
        pool = _POOL
    return pool.pids() if pool is not None else []


# -- which rewards run in a worker ---------------------------------------------

_UNAVAILABLE: dict[tuple, str] = {}  # (spec, identity) -> why it runs in this process
_WARNED: set[tuple] = set()


def _key(spec: str, origin: registry.Origin) -> tuple:
    return (spec, origin.identity, origin.module, origin.file)


def why_in_process(spec: str) -> str | None:
    """None when ``spec`` runs in a worker; else why it runs in this process."""
    origin = registry.origin(spec)
    if origin.builtin:
        if origin.name == "format" and "pattern" in origin.options:
            return None if _settings["workers"] > 0 else "workers=0"
        return "built-in"
    if _settings["workers"] == 0:
        return "workers=0"
    module, qualname = origin.identity
    if origin.module is None or module is None or qualname is None:
        return "its module or name is unknown"
    if origin.module == "__main__":
        return "it was registered in __main__, which a worker does not import"
    if "<locals>" in qualname:
        return f"{qualname} is defined inside a function"
    return _UNAVAILABLE.get(_key(spec, origin))


def runs_in_worker(spec: str) -> bool:
    """Whether the reward ``spec`` ("name" or "name(k=v)") is scored in a worker process."""
    return why_in_process(spec) is None


def warn_in_process(spec: str, why: str) -> None:
    """Warns, once per reward, that a user reward runs in this process and why."""
    key = _key(spec, registry.origin(spec))
    if key in _WARNED:
        return
    _WARNED.add(key)
    log.warning(
        "reward %r runs in this process (%s): its deadline cannot stop it there. Define it "
        "at the top level of a module loaded with reward_modules / load_user_module to "
        "have it scored in a killable worker process",
        spec,
        why,
    )


def _request(spec: str, origin: registry.Origin, prompts, completions, fields) -> tuple:
    return ("call", spec, origin.identity, prompts, completions, fields)


def _unavailable(spec: str, why: str) -> Unavailable:
    _UNAVAILABLE[_key(spec, registry.origin(spec))] = why
    return Unavailable(why)


def _reply(message) -> Reply:
    kind = message[0] if isinstance(message, tuple) and message else None
    if kind in ("ok", "raised", "malformed"):
        return Reply(kind, message[1])
    return Reply("raised", RuntimeError(f"unexpected reply from the reward worker: {message!r}"))


def call_batch(spec: str, prompts, completions, fields, *, timeout_s: float) -> Reply:
    """The reward on the whole batch in one worker, which is killed past ``timeout_s``.

    The deadline counts from when the request is sent (a worker that is still
    starting is waited for first). Raises Unavailable when the reward cannot
    run in a worker.
    """
    pool = _pool()
    origin = registry.origin(spec)
    request = _encode(_request(spec, origin, prompts, completions, fields))
    worker = pool.acquire()
    if worker is None:
        raise Unavailable(f"no reward worker became free within {pool.startup_timeout_s}s")
    pool.ensure_loaded(worker, (origin.module, origin.file))
    try:
        worker.send(request)
        message = worker.recv(time.monotonic() + timeout_s)
    except _Died:
        pool.discard(worker)
        return Reply("died")
    if message is None:
        pool.discard(worker)
        return Reply("timeout")
    if message[0] == "unavailable":
        pool.release(worker)
        raise _unavailable(spec, message[1])
    pool.release(worker)
    return _reply(message)


def call_rows(
    spec: str, prompts, completions, fields, *, timeout_s: float, max_lost: int | None = None
) -> list[Reply]:
    """The reward on each completion alone, spread over the workers, each with its own deadline.

    A completion past ``timeout_s`` (from when its request is sent) or whose
    worker exits gets "timeout" / "died" and costs that worker (killed,
    replaced in the background). Once ``max_lost`` completions (default: the
    pool's size, at least 2) have cost a worker, the reward is taken to hang
    on much of the batch and the completions not yet tried get "skipped"; a
    call thus lasts about ``max_lost * timeout_s`` at most, less when the
    hanging completions run side by side.
    """
    pool = _pool()
    origin = registry.origin(spec)
    module = (origin.module, origin.file)
    if max_lost is None:
        max_lost = max(2, pool.size)
    n = len(completions)
    replies: list[Reply | None] = [None] * n
    pending = collections.deque(range(n))
    inflight: dict[_Worker, tuple[int, float]] = {}
    encoded: tuple[int, bytes] = (-1, b"")  # the next completion's request, pickled once
    lost = 0

    def row_request(i: int) -> bytes:
        row = {k: v[i : i + 1] for k, v in fields.items()}
        return _encode(_request(spec, origin, prompts[i : i + 1], completions[i : i + 1], row))

    def lose(worker, i, kind):
        nonlocal lost
        del inflight[worker]
        pool.discard(worker)
        replies[i] = Reply(kind)
        lost += 1

    try:
        while pending or inflight:
            while pending and lost < max_lost:
                i = pending[0]
                if encoded[0] != i:
                    try:
                        encoded = (i, row_request(i))
                    except Unavailable as e:
                        replies[pending.popleft()] = Reply("raised", RuntimeError(str(e)))
                        continue
                request = encoded[1]
                try:
                    worker = pool.acquire(block=not inflight)
                    if worker is not None:  # a new worker imported the module as it started
                        pool.ensure_loaded(worker, module)
                except Unavailable as e:
                    if inflight:
                        break
                    for i in pending:
                        replies[i] = Reply("raised", RuntimeError(str(e)))
                    pending.clear()
                    break
                if worker is None:
                    break
                pending.popleft()
                try:
                    worker.send(request)
                except _Died:
                    inflight[worker] = (i, 0.0)
                    lose(worker, i, "died")
                    continue
                inflight[worker] = (i, time.monotonic() + timeout_s)
            if lost >= max_lost:
                for i in pending:
                    replies[i] = Reply("skipped")
                pending.clear()
            if not inflight:
                continue
            wait = min(d for _, d in inflight.values()) - time.monotonic()
            if pending and lost < max_lost:
                wait = min(wait, _POLL_S)  # a worker may come free (or finish starting)
            with selectors.DefaultSelector() as sel:
                for worker in inflight:
                    sel.register(worker.fd, selectors.EVENT_READ, worker)
                ready = [key.data for key, _ in sel.select(max(0.0, wait))]
            for worker in ready:
                i, _ = inflight[worker]
                try:
                    message = worker.poll()
                except _Died:
                    lose(worker, i, "died")
                    continue
                if message is None:
                    continue
                del inflight[worker]
                if message[0] == "unavailable":  # cannot happen after the batch call did
                    pool.release(worker)
                    replies[i] = Reply("raised", RuntimeError(message[1]))
                    continue
                pool.release(worker)
                replies[i] = _reply(message)
            now = time.monotonic()
            for worker, (i, deadline) in list(inflight.items()):
                if now >= deadline:
                    lose(worker, i, "timeout")
    finally:
        for worker in list(inflight):  # only on an unexpected error: leave no worker busy
            pool.discard(worker)
    return [r if r is not None else Reply("skipped") for r in replies]
