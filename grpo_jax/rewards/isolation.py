"""Worker processes for user reward functions: a deadline that can always be enforced.

Python cannot stop a thread, and a reward stuck in C code holding the interpreter lock stops
the whole process; so rewards registered by user code run in a pool of long-lived worker
processes (:mod:`grpo_jax.rewards.worker_pool`), and a request past its deadline costs its
worker, which is killed and replaced in the background. :func:`runs_in_worker` says which
rewards run where. docs/rewards.md, "Where a reward runs", has the rules, how a worker finds
a user reward, and what this means for one.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import selectors
import threading
import time

import grpo_jax.rewards.registry as registry
from grpo_jax.rewards.worker_pool import Died, Pool, Unavailable, Worker, encode

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often a waiting dispatcher looks for a worker that became free

DEFAULT_WORKERS = 2
DEFAULT_STARTUP_TIMEOUT_S = 120.0
WORKERS_ENV = "GRPO_JAX_REWARD_WORKERS"  # the pool's size when set (0: all in process)


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
_POOL: Pool | None = None
_POOL_LOCK = threading.Lock()
_ATEXIT = False


def _pool() -> Pool:
    global _POOL, _ATEXIT
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = Pool(_settings["workers"], _settings["startup_timeout_s"])
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
    request = encode(_request(spec, origin, prompts, completions, fields))
    worker = pool.acquire()
    if worker is None:
        raise Unavailable(f"no reward worker became free within {pool.startup_timeout_s}s")
    pool.ensure_loaded(worker, (origin.module, origin.file))
    try:
        worker.send(request)
        message = worker.recv(time.monotonic() + timeout_s)
    except Died:
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
    if max_lost is None:
        max_lost = max(2, pool.size)
    call = _RowCall(pool, spec, (prompts, completions, fields), timeout_s, max_lost)
    try:
        while call.pending or call.inflight:
            call.send()
            if call.lost >= max_lost:
                for i in call.pending:
                    call.replies[i] = Reply("skipped")
                call.pending.clear()
            if call.inflight:
                call.receive()
    finally:
        for worker in list(call.inflight):  # only on an unexpected error: leave no worker busy
            pool.discard(worker)
    return [r if r is not None else Reply("skipped") for r in call.replies]


class _RowCall:
    """One :func:`call_rows`: the completions not yet sent (``pending``), those in flight
    (``inflight``: worker -> (row, deadline)), the replies so far and the workers lost."""

    def __init__(self, pool: Pool, spec: str, args, timeout_s: float, max_lost: int):
        self.pool, self.spec, self.args = pool, spec, args
        self.timeout_s, self.max_lost = timeout_s, max_lost
        self.origin = registry.origin(spec)
        self.module = (self.origin.module, self.origin.file)
        n = len(args[1])
        self.replies: list[Reply | None] = [None] * n
        self.pending = collections.deque(range(n))
        self.inflight: dict[Worker, tuple[int, float]] = {}
        self.lost = 0
        self._encoded: tuple[int, bytes] = (-1, b"")  # the next row's request, pickled once

    def _request(self, i: int) -> bytes:
        """Row ``i``'s request, pickled; raises Unavailable when it cannot be."""
        if self._encoded[0] != i:
            prompts, completions, fields = self.args
            one = slice(i, i + 1)
            row = {k: v[one] for k, v in fields.items()}
            request = _request(self.spec, self.origin, prompts[one], completions[one], row)
            self._encoded = (i, encode(request))
        return self._encoded[1]

    def _lose(self, worker: Worker, i: int, kind: str) -> None:
        del self.inflight[worker]
        self.pool.discard(worker)
        self.replies[i] = Reply(kind)
        self.lost += 1

    def send(self) -> None:
        """Sends pending rows to idle workers, until none is idle (waiting for one only when
        no row is in flight) or ``max_lost`` workers were lost."""
        while self.pending and self.lost < self.max_lost:
            i = self.pending[0]
            try:
                request = self._request(i)
            except Unavailable as e:
                self.replies[self.pending.popleft()] = Reply("raised", RuntimeError(str(e)))
                continue
            try:
                worker = self.pool.acquire(block=not self.inflight)
                if worker is not None:  # a new worker imported the module as it started
                    self.pool.ensure_loaded(worker, self.module)
            except Unavailable as e:
                if not self.inflight:
                    for j in self.pending:
                        self.replies[j] = Reply("raised", RuntimeError(str(e)))
                    self.pending.clear()
                return
            if worker is None:
                return
            self.pending.popleft()
            try:
                worker.send(request)
            except Died:
                self.inflight[worker] = (i, 0.0)
                self._lose(worker, i, "died")
                continue
            self.inflight[worker] = (i, time.monotonic() + self.timeout_s)

    def receive(self) -> None:
        """Waits for a reply until the first deadline (or a short poll while rows wait for a
        worker), records what came, and gives up the rows past their deadline."""
        wait = min(d for _, d in self.inflight.values()) - time.monotonic()
        if self.pending and self.lost < self.max_lost:
            wait = min(wait, _POLL_S)  # a worker may come free (or finish starting)
        with selectors.DefaultSelector() as sel:
            for worker in self.inflight:
                sel.register(worker.fd, selectors.EVENT_READ, worker)
            ready = [key.data for key, _ in sel.select(max(0.0, wait))]
        for worker in ready:
            i, _ = self.inflight[worker]
            try:
                message = worker.poll()
            except Died:
                self._lose(worker, i, "died")
                continue
            if message is None:
                continue
            del self.inflight[worker]
            self.pool.release(worker)
            if message[0] == "unavailable":  # cannot happen after the batch call did
                self.replies[i] = Reply("raised", RuntimeError(message[1]))
            else:
                self.replies[i] = _reply(message)
        now = time.monotonic()
        for worker, (i, deadline) in list(self.inflight.items()):
            if now >= deadline:
                self._lose(worker, i, "timeout")
