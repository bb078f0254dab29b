"""Off-policy, pipelined rollouts with a staleness bound (``train.max_staleness`` = k >= 1).

Versions: parameter version v is the number of GRPO steps (updates) applied,
so the update of step s turns version s - 1 into version s, and the
on-policy loop (k = 0) samples step s's batch with version s - 1. With
k >= 1 the batch of step s is sampled by version

    v(s) = max(0, s - 1 - k),      staleness(s) = s - 1 - v(s)  in [0, k],

so step s's batch is dispatched for sampling at step s - k, right before the
update of step s - k, with the parameters that update starts from. At step s
the loop

  1. takes the batch of step s (sampled and scored earlier),
  2. dispatches the sampling of step s + k's batch with version s - 1 (on the
     one mesh, the same arrays the update reads; on a split mesh, a copy
     moved device to device onto the sampler mesh),
  3. dispatches the update of step s (it donates the train state),
  4. waits for step s + k's samples and does its host work (decode, rewards,
     advantages) while the devices run the update.

JAX dispatch is asynchronous, so in step 4 the host blocks only on the
samples: on one mesh the device runs the sampling, then the update, and the
host decodes and scores during the update; on a split mesh
(``mesh.sampler_devices``) the sampler devices sample while the learner
devices update. Every batch is sampled with the PRNG key of its own step
(``fold_in(key(seed), step)``) from the next prompts of the data iterator, so
a run is deterministic, and the batch of step s equals what the on-policy loop
would sample at step s with version v(s). The update takes the batch's
recorded log-probs as pi_old (the sampling policy: the PPO ratio is against
it), and ``grpo.behavior_correction`` / ``grpo.old_logps = "recompute"``
apply as in the on-policy loop (docs/objective.md §11).

A checkpoint at step s also holds the batches in flight (those of steps s + 1
.. s + k, already sampled, with the data iterator past their prompts), so a
resumed run continues exactly where an uninterrupted one would
(``checkpoint.save_run``'s ``inflight``).

Metrics per step: ``pipeline/staleness`` and ``pipeline/version`` of the batch
used; the update's ratio statistics (``train/ratio_*``, ``policy/*``) are
against the batch's sampling policy, i.e. the behaviour policy. Timings
(``perf/``, not part of exact-resume comparisons): ``perf/learner_wait_s``
(the learner idle between its previous update and this one),
``perf/sampler_wait_s`` (the sampler waiting for the parameters it samples
with), ``perf/update_s`` (dispatch to done), ``perf/overlap_host_s`` (host
work of the next batch during this update), ``perf/overlap_sample_s`` (split
mesh: sampling during this update) and ``perf/step_wall_s``. docs/pipeline.md
describes the design and its measurements.
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

__all__ = [
    "InFlight",
    "Staleness",
    "sampled_version",
]


def sampled_version(step: int, max_staleness: int) -> int:
    """v(s) = max(0, s - 1 - k): the parameter version that samples step ``step``'s batch."""
    return max(0, step - 1 - max_staleness)


# ---------------------------------------------------------------------------
# Batches in flight.


_HOST_FIELDS = ("examples", "prompts_n", "completions", "metrics")
_HOST_INTS = ("completion_tokens", "sampled_tokens", "prompt_tokens")


def inflight_to_save(queue: list[InFlight]):
    """-> (arrays to save as the checkpoint's "inflight" item, their JSON description).

    The JSON (in the checkpoint's meta) holds each batch's step, version,
    field shapes and dtypes, and this process's HostRollout (in a multi-host
    run, process 0's: the one that writes records and samples).
    """
    arrays, info = {}, []
    for j, f in enumerate(queue):
        fields = {x.name: getattr(f.batch, x.name) for x in dataclasses.fields(f.batch)}
        arrays[str(j)] = fields
        host = {k: jsonable(getattr(f.host, k)) for k in _HOST_FIELDS}
        host.update({k: int(getattr(f.host, k)) for k in _HOST_INTS})
        host["total_n"] = np.asarray(f.host.total_n, np.float64).tolist()
        info.append(
            {
                "step": f.step,
                "version": f.version,
                "shapes": {k: [list(v.shape), str(v.dtype)] for k, v in fields.items()},
                "host": host,
            }
        )
    return arrays, info


def restore_inflight(checkpointer, mesh, step: int) -> list[InFlight]:
    """The batches in flight when the checkpoint of ``step`` was saved ([] when none)."""
    info = checkpointer.restore_meta(step).get("inflight") or []
    if isinstance(info, dict):  # grpo_jax.rollout.partial's rows in flight
        raise ConfigError(
            f"the checkpoint of step {step} holds partial rollouts in flight: resume it with "
            "sampling.partial_rollouts = True"
        )
    if not info:
        return []
    rows = lambda ndim: sharding_lib.batch_sharding(mesh, ndim)
    like = {
        str(j): {
            name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=rows(len(shape)))
            for name, (shape, dtype) in item["shapes"].items()
        }
        for j, item in enumerate(info)
    }
    arrays = checkpointer.restore_inflight(step, like=like)
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

    def __init__(self, source: RolloutSource, k: int, *, last: int, queue=()):
        self.source, self.k = source, k
        self.last = last  # train.steps: no batch is sampled for a step past it
        self.queue: list[InFlight] = list(queue)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2) if k else None
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

    def to_save(self):
        """What a checkpoint saves of the batches in flight (None with k = 0)."""
        return inflight_to_save(self.queue) if self.k else None
