"""Bounded staleness around any rollout source (``train.max_staleness`` = k; k = 0 is on-policy).

The batch of step s is sampled by parameter version v(s) = max(0, s - 1 - k) (updates
applied), so staleness(s) = s - 1 - v(s) is in [0, k]: with k >= 1 it is dispatched at step
s - k, right before that step's update, and its host work (decoding, rewards) runs while the
devices update, on one mesh or beside a split sampler mesh (``mesh.sampler_devices``). The
batches in flight go into every checkpoint, so a resumed run continues exactly. Metrics:
``pipeline/staleness`` and ``pipeline/version``, and timings under ``perf/`` (the waits,
the update, the overlaps). docs/pipeline.md describes the design and its measurements.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from grpo_jax.core import batch as batch_lib
from grpo_jax.core import sharding as sharding_lib
from grpo_jax.core.batch import jsonable
from grpo_jax.core.errors import ConfigError
from grpo_jax.rollout.sources import InFlight, RolloutSource

__all__ = ["Staleness", "queue_from_state", "queue_state", "sampled_version"]


def sampled_version(step: int, max_staleness: int) -> int:
    """v(s) = max(0, s - 1 - k): the parameter version that samples step ``step``'s batch."""
    return max(0, step - 1 - max_staleness)


# ---------------------------------------------------------------------------
# Batches in flight.


_HOST_FIELDS = ("examples", "prompts_n", "completions", "metrics")
_HOST_INTS = ("completion_tokens", "sampled_tokens", "prompt_tokens")


def _fields(batch) -> dict:
    """The batch's arrays by field name (a field left None, routes without replay, has none)."""
    fields = ((x.name, getattr(batch, x.name)) for x in dataclasses.fields(batch))
    return {name: v for name, v in fields if v is not None}


def queue_state(queue: list[InFlight]) -> list[dict]:
    """The JSON of the batches in ``queue`` (a checkpoint's ``meta["inflight"]``): each
    batch's step, version, field shapes and dtypes, and this process's HostRollout (in a
    multi-host run, process 0's: the one that writes records and samples)."""
    info = []
    for f in queue:
        host = {k: jsonable(getattr(f.host, k)) for k in _HOST_FIELDS}
        host.update({k: int(getattr(f.host, k)) for k in _HOST_INTS})
        host["total_n"] = np.asarray(f.host.total_n, np.float64).tolist()
        shapes = {k: [list(v.shape), str(v.dtype)] for k, v in _fields(f.batch).items()}
        info.append({"step": f.step, "version": f.version, "shapes": shapes, "host": host})
    return info


def queue_from_state(info: list[dict], arrays: dict) -> list[InFlight]:
    """The batches :func:`queue_state` described, with their arrays read back."""
    queue = []
    for j, item in enumerate(info):
        h = item["host"]
        host = batch_lib.HostRollout(
            examples=list(h["examples"]),
            prompts_n=list(h["prompts_n"]),
            completions=list(h["completions"]),
            total_n=np.asarray(h["total_n"], np.float32),
            metrics={k: float(v) for k, v in h["metrics"].items()},
            completion_tokens=h["completion_tokens"],
            sampled_tokens=h["sampled_tokens"],
            prompt_tokens=h["prompt_tokens"],
            t_params_ready=0.0,
        )
        batch = batch_lib.RolloutBatch(**arrays[str(j)])
        queue.append(InFlight(item["step"], item["version"], batch, host))
    return queue


# ---------------------------------------------------------------------------
# Timing.


def _ready_at(tree) -> float:
    jax.block_until_ready(tree)
    return time.perf_counter()


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


# ---------------------------------------------------------------------------
# The wrapper.


class Staleness:
    """Bounded staleness k around a rollout source (k = 0 is on-policy; module doc).

    Per step the loop calls :meth:`take` (the step's batch; with k >= 1 it
    also submits step s + k's with the parameters the update starts from),
    dispatches the update, then :meth:`settle` (step s + k's host work while
    the update runs, and the step's pipeline metrics). Timings that are known
    only once an update has ended come back from :meth:`settle` and
    :meth:`finish_step` as ``{step: metrics}`` for the reporter. With k = 0
    nothing is added to a step's record: the on-policy loop's records.
    A context manager: leaving it stops its timing threads.
    """

    def __init__(self, source: RolloutSource, max_staleness: int, *, last: int, mesh):
        self.source = source
        # A source that spends the bound itself (partial rollouts, on the rows it carries
        # between steps) has each batch sampled at its own step.
        self.k = 0 if source.spends_staleness else max_staleness
        self.last = last  # train.steps: no batch is sampled for a step past it
        self.mesh = mesh  # the learner's: where the batches in flight live
        self.queue: list[InFlight] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2) if self.k else None
        # step -> (t_update, future of the update's end, the next batch's InFlight)
        self._timing = {}
        self._prev_done = None  # perf_counter() when the previous update ended
        self._t_prev_iter = None
        self._cur = None  # (the batch taken, perf_counter() at take)
        self._submitted = None  # (its step, perf_counter() at submit, its params' readiness)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def fill(self, start_step: int, params) -> None:
        """The batches of the first k steps after ``start_step`` (those not restored):
        all sampled by the parameters the run starts from (a fresh run: version 0 =
        v(s) for s <= k + 1)."""
        nxt = start_step + 1 + len(self.queue)
        while nxt <= min(start_step + self.k, self.last):
            self.source.submit(nxt, self.source.params(params), start_step)
            self.queue.append(self.source.take(nxt))
            nxt += 1

    def take(self, step: int, params) -> InFlight:
        """Step ``step``'s batch; ``params`` (version step - 1) sample step + k's."""
        if not self.k:
            self.source.submit(step, params, step - 1)
            self._cur = (self.source.take(step), None)
            return self._cur[0]
        t_iter = time.perf_counter()
        cur = self.queue.pop(0)
        staleness = step - 1 - cur.version
        if cur.step != step or not 0 <= staleness <= self.k:
            raise RuntimeError(
                f"step {step} was given the batch of step {cur.step}, sampled by parameter "
                f"version {cur.version}: outside the staleness bound [0, {self.k}]"
            )
        self._cur, self._submitted = (cur, t_iter), None
        if step + self.k <= self.last:
            p = self.source.params(params)  # version step - 1
            t_req = time.perf_counter()
            # One mesh: the sampler reads the arrays the update then donates, so only a
            # split mesh's copy may be waited on here; on one mesh the parameters are
            # ready when the previous update ends.
            ready = self.pool.submit(_ready_at, p) if self.source.split else None
            self.source.submit(step + self.k, p, step - 1)
            self._submitted = (step + self.k, t_req, ready)
        return cur

    def settle(self, step: int, t_update: float, dev_metrics):
        """After the update of ``step`` is dispatched -> (its batch's HostRollout, late
        metrics). With k >= 1 the HostRollout comes with the ``pipeline/*`` metrics and
        the waits, and the next batch's host work is done here, during the update.
        """
        (cur, t_iter), late = self._cur, {}
        host = cur.host
        if not self.k:
            return host, {}
        done = self.pool.submit(_ready_at, dev_metrics)
        nb, sampler_wait = None, 0.0
        if self._submitted is not None:
            nstep, t_req, ready = self._submitted
            nb = self.source.take(nstep)
            self.queue.append(nb)
        t_prev = self._finalize(step - 1, late)  # None when flushed already (or step 1)
        self._prev_done = self._prev_done if t_prev is None else t_prev
        if self._submitted is not None:
            if ready is not None:
                sampler_wait = max(0.0, ready.result() - t_req)
            elif self._prev_done is not None:
                sampler_wait = max(0.0, self._prev_done - t_req)
        prev_done = self._prev_done
        learner_wait = 0.0 if prev_done is None else max(0.0, t_update - prev_done)
        self._timing[step] = (t_update, done, nb)
        t_prev_iter, self._t_prev_iter = self._t_prev_iter, t_iter
        host = dataclasses.replace(
            host,
            metrics={
                **host.metrics,
                "pipeline/staleness": float(step - 1 - cur.version),
                "pipeline/version": float(cur.version),
                "perf/sampler_wait_s": sampler_wait,
                "perf/learner_wait_s": learner_wait,
                "perf/step_wall_s": 0.0 if t_prev_iter is None else t_iter - t_prev_iter,
            },
            # The record of the step before is finished now: its update has ended.
            t_params_ready=prev_done if prev_done is not None else time.perf_counter(),
        )
        return host, late

    def finish_step(self, step: int) -> dict[int, dict]:
        """Waits for the update of ``step`` -> its late metrics (before its record is
        written early: an evaluation, a checkpoint, the end)."""
        late = {}
        t_done = self._finalize(step, late)
        self._prev_done = self._prev_done if t_done is None else t_done
        return late

    def _finalize(self, step: int, late: dict):
        """Adds step ``step``'s update timings to ``late`` (its update has ended)."""
        if step not in self._timing:
            return None
        t_update, done, nb = self._timing.pop(step)
        t_done = done.result()
        m = {"perf/update_s": t_done - t_update}
        if nb is not None:
            m["perf/overlap_host_s"] = _overlap(t_update, t_done, nb.t_sampled, nb.t_done)
            if self.source.split:
                m["perf/overlap_sample_s"] = _overlap(t_update, t_done, nb.t_dispatch, nb.t_sampled)
        late[step] = m
        return t_done

    # -- checkpoints: the batches in flight (grpo_jax.run.state.Stateful) --------------

    def state_dict(self):
        """k >= 1: the batches queued (:func:`queue_state`); else the source's own."""
        return queue_state(self.queue) if self.k else self.source.state_dict()

    def state_arrays(self):
        if not self.k:
            return self.source.state_arrays()
        return {str(j): _fields(f.batch) for j, f in enumerate(self.queue)}

    def arrays_like(self, state):
        """What to read a checkpoint's batches in flight into (None: it holds none)."""
        if not self.k:
            return self.source.arrays_like(state)
        if isinstance(state, dict):  # grpo_jax.rollout.partial's rows in flight
            raise ConfigError(
                "the checkpoint holds partial rollouts in flight: resume it with "
                "sampling.partial_rollouts = True"
            )
        if not state:
            return None
        rows = lambda ndim: sharding_lib.batch_sharding(self.mesh, ndim)
        return {
            str(j): {
                name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=rows(len(shape)))
                for name, (shape, dtype) in item["shapes"].items()
            }
            for j, item in enumerate(state)
        }

    def load_state_dict(self, state, arrays=None) -> None:
        """Continues with the batches in flight when the checkpoint was saved (``arrays``:
        as :meth:`arrays_like` asked, read back); :meth:`fill` samples the rest."""
        if not self.k:
            self.source.load_state_dict(state, arrays)
        elif state and arrays is not None:
            self.queue = queue_from_state(state, arrays)
