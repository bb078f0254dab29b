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
import functools
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from grpo_jax import checkpoint, distributed, rollout
from grpo_jax import sharding as sharding_lib
from grpo_jax.config import ConfigError
from grpo_jax.report import Reporter
from grpo_jax.run_summary import summarize

if TYPE_CHECKING:
    from grpo_jax.setup import Setup

__all__ = [
    "InFlight",
    "learner_and_sampler_devices",
    "run_loop",
    "sampled_version",
    "sampler_mesh",
]


def sampled_version(step: int, max_staleness: int) -> int:
    """v(s) = max(0, s - 1 - k): the parameter version that samples step ``step``'s batch."""
    return max(0, step - 1 - max_staleness)


# ---------------------------------------------------------------------------
# Placement: one mesh, or a sampler mesh beside the learner mesh.


def learner_and_sampler_devices(devices, sampler_devices: int):
    """Splits ``devices`` -> (learner devices, sampler devices).

    The sampler gets each process's first ``sampler_devices / process_count``
    devices, the learner the rest; both keep the processes in order, so a
    host's rows of a batch are the same block on both meshes (every host
    samples and scores the rows it trains on). 0: (all devices, []).
    """
    devices = list(devices)
    if not sampler_devices:
        return devices, []
    procs = sorted({d.process_index for d in devices})
    per, rest = divmod(sampler_devices, len(procs))
    where = "config key 'mesh.sampler_devices'"
    if rest:
        raise ConfigError(
            f"{where} = {sampler_devices} must be a multiple of the {len(procs)} processes "
            "(each process gives the sampler the same number of its devices)"
        )
    learner, sampler = [], []
    for p in procs:
        mine = [d for d in devices if d.process_index == p]
        if per >= len(mine):
            raise ConfigError(
                f"{where} = {sampler_devices} leaves no learner device: process {p} has "
                f"{len(mine)} devices in use (mesh.num_devices) and would give {per} of them to "
                "the sampler"
            )
        sampler += mine[:per]
        learner += mine[per:]
    return learner, sampler


def sampler_mesh(devices):
    """The sampler's mesh: rows split over all its devices, parameters replicated."""
    return sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, devices)


def _on_mesh(shardings, mesh):
    """The same partition specs on another mesh with the same axis names."""
    return jax.tree.map(lambda sh: jax.sharding.NamedSharding(mesh, sh.spec), shardings)


# ---------------------------------------------------------------------------
# Batches in flight.


@dataclasses.dataclass
class InFlight:
    """A batch sampled and scored ahead of its step.

    Attributes:
      step: the step that trains on it.
      version: the parameter version that sampled it (updates applied).
      batch: the RolloutBatch, on the learner mesh.
      host: its HostRollout.
      t_dispatch, t_sampled, t_done: ``perf_counter()`` when its sampling was
        dispatched, when the samples were ready, when its host work ended
        (0.0 for a batch restored from a checkpoint).
    """

    step: int
    version: int
    batch: rollout.RolloutBatch
    host: rollout.HostRollout
    t_dispatch: float = 0.0
    t_sampled: float = 0.0
    t_done: float = 0.0


_HOST_FIELDS = ("examples", "prompts_n", "completions", "metrics")
_HOST_INTS = ("completion_tokens", "sampled_tokens", "prompt_tokens")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


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
        host = {k: _jsonable(getattr(f.host, k)) for k in _HOST_FIELDS}
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


def _restore_inflight(s: Setup, step: int) -> list[InFlight]:
    """The batches in flight when the checkpoint of ``step`` was saved ([] when none)."""
    info = s.checkpointer.restore_meta(step).get("inflight") or []
    if not info:
        return []
    rows = lambda ndim: sharding_lib.batch_sharding(s.mesh, ndim)
    like = {
        str(j): {
            name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=rows(len(shape)))
            for name, (shape, dtype) in item["shapes"].items()
        }
        for j, item in enumerate(info)
    }
    arrays = s.checkpointer.restore_inflight(step, like=like)
    queue = []
    for j, item in enumerate(info):
        h = item["host"]
        host = rollout.HostRollout(
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
        batch = rollout.RolloutBatch(**arrays[str(j)])
        queue.append(InFlight(item["step"], item["version"], batch, host))
    return queue


# ---------------------------------------------------------------------------
# Timing.


def _ready_at(tree) -> float:
    jax.block_until_ready(tree)
    return time.perf_counter()


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


class _Sampler:
    """Dispatches and finishes the sampling of one step's batch, on its mesh."""

    def __init__(self, s: Setup):
        self.s = s
        self.split = bool(s.run.mesh.sampler_devices)
        self.mesh = s.sampler_mesh if self.split else s.mesh
        if self.split:
            self.param_shardings = _on_mesh(s.param_shardings, self.mesh)
            from grpo_jax.update import rollout_batch_shardings

            self.batch_shardings = rollout_batch_shardings(s.mesh)

    def params(self, params):
        """The sampler's copy of ``params`` (a device-to-device copy on a split mesh).

        With several processes JAX moves arrays only between the same device
        sets, so the learner mesh first gathers each array onto every one of
        its devices; each process then copies its local copy onto its own
        sampler devices (no host round trip).
        """
        if not self.split:
            return params
        if jax.process_count() == 1:
            return jax.device_put(params, self.param_shardings)
        full = self._gather(params)

        def one(x, sh):
            if not sh.is_fully_replicated:
                raise ValueError(f"the sampler's parameters must be replicated, got {sh.spec}")
            local = x.addressable_data(0)
            parts = [jax.device_put(local, d) for d in sh.addressable_devices]
            return jax.make_array_from_single_device_arrays(x.shape, sh, parts)

        return jax.tree.map(one, full, self.param_shardings)

    @functools.cached_property
    def _gather(self):
        return jax.jit(lambda t: t, out_shardings=sharding_lib.replicated(self.s.mesh))

    def dispatch(self, params, step: int, version: int):
        k_sample, _ = jax.random.split(jax.random.fold_in(self.s.base_key, step))
        examples = self.s.iterator.next()  # this host's rows of the global batch
        d = rollout.dispatch_round(
            self.s, params, examples, k_sample, mesh=self.mesh, wait_params=False
        )
        return step, version, d

    def finish(self, pending) -> InFlight:
        step, version, d = pending
        rd = rollout.finish_round(self.s, d)
        batch, host = rollout.batch_from_round(self.s, rd)
        if self.split and jax.process_count() == 1:  # sampler devices -> learner devices
            batch = jax.device_put(batch, self.batch_shardings)
        elif self.split:  # several processes: each moves its own rows (the same block)
            N = batch.num_rows
            rows = distributed.local_rows(batch, self.s.rows_N)
            batch = distributed.global_batch(rows, self.s.mesh, N)
        return InFlight(
            step,
            version,
            batch,
            host,
            t_dispatch=d.t_params_ready,
            t_sampled=d.t_params_ready + rd.t_sample,
            t_done=time.perf_counter(),
        )


# ---------------------------------------------------------------------------
# The loop.


def run_loop(s: Setup, state, preempt, t_start: float, step_callback) -> dict:
    """``grpo_jax.train``'s loop for ``train.max_staleness`` >= 1 (module doc)."""
    from grpo_jax import train as train_lib

    run = s.run
    k = run.train.max_staleness
    last = run.train.steps
    evaluate_fn = functools.partial(train_lib.evaluate_policy, s)
    start = checkpoint.restore_or_init(s, state, evaluate=evaluate_fn, preempt=preempt)
    if start is None:
        return {"preempted": True, "step": 0}
    state, ref_params = start.state, start.ref_params
    report = Reporter(
        s,
        no_signal_run=start.no_signal_run,
        start_step=start.start_step,
        sampled_tokens=start.sampled_tokens,
        health_state=start.health_state,
    )
    sampler = _Sampler(s)
    queue = _restore_inflight(s, start.start_step) if start.resumed else []
    # Fill the pipeline: the batches of the first k steps come from the parameters
    # the run starts from (a fresh run: version 0 = v(s) for s <= k + 1).
    nxt = start.start_step + 1 + len(queue)
    while nxt <= min(start.start_step + k, last):
        params = sampler.params(state.params)
        queue.append(sampler.finish(sampler.dispatch(params, nxt, start.start_step)))
        nxt += 1

    def save(step):
        arrays, info = inflight_to_save(queue)
        train_lib._save(
            s, state, step, start=start, report=report, t_start=t_start, inflight=(arrays, info)
        )

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    timing = {}  # step -> (t_update, future of the update's end, the next batch's InFlight)

    def finalize(step):
        """Adds step ``step``'s update timings to its record (its update has ended)."""
        if step not in timing:
            return None
        t_update, done, nb = timing.pop(step)
        t_done = done.result()
        late = {"perf/update_s": t_done - t_update}
        if nb is not None:
            late["perf/overlap_host_s"] = _overlap(t_update, t_done, nb.t_sampled, nb.t_done)
            if sampler.split:
                late["perf/overlap_sample_s"] = _overlap(
                    t_update, t_done, nb.t_dispatch, nb.t_sampled
                )
        report.late[step] = late
        return t_done

    prev_done = None  # perf_counter() when the previous update ended
    t_prev_iter = None
    try:
        for step in range(start.start_step + 1, last + 1):
            if report.budget_spent():  # train.sampled_tokens_budget
                break
            t_iter = time.perf_counter()
            _, k_train = jax.random.split(jax.random.fold_in(s.base_key, step))
            cur = queue.pop(0)
            staleness = step - 1 - cur.version
            if cur.step != step or not 0 <= staleness <= k:
                raise RuntimeError(
                    f"step {step} was given the batch of step {cur.step}, sampled by parameter "
                    f"version {cur.version}: outside the staleness bound [0, {k}]"
                )
            pending, params_ready, sampler_wait = None, None, 0.0
            if step + k <= last:
                params = sampler.params(state.params)  # version step - 1
                t_req = time.perf_counter()
                # One mesh: the sampler reads the arrays the update then donates, so only a
                # split mesh's copy may be waited on here; on one mesh the parameters are
                # ready when the previous update ends.
                params_ready = pool.submit(_ready_at, params) if sampler.split else None
                pending = sampler.dispatch(params, step + k, step - 1)
            k_train = distributed.put(k_train, sharding_lib.replicated(s.mesh))
            t_update = time.perf_counter()
            state, dev_metrics = s.update(state, cur.batch, k_train, ref_params)
            done = pool.submit(_ready_at, dev_metrics)
            nb = None
            if pending is not None:
                nb = sampler.finish(pending)
                queue.append(nb)
            t_prev = finalize(step - 1)  # None when flushed already (or the first step)
            prev_done = prev_done if t_prev is None else t_prev
            if params_ready is not None:
                sampler_wait = max(0.0, params_ready.result() - t_req)
            elif pending is not None and prev_done is not None:
                sampler_wait = max(0.0, prev_done - t_req)
            learner_wait = 0.0 if prev_done is None else max(0.0, t_update - prev_done)
            timing[step] = (t_update, done, nb)
            host = dataclasses.replace(
                cur.host,
                metrics={
                    **cur.host.metrics,
                    "pipeline/staleness": float(staleness),
                    "pipeline/version": float(cur.version),
                    "perf/sampler_wait_s": sampler_wait,
                    "perf/learner_wait_s": learner_wait,
                    "perf/step_wall_s": 0.0 if t_prev_iter is None else t_iter - t_prev_iter,
                },
                # The record of the step before is finished now: its update has ended.
                t_params_ready=prev_done if prev_done is not None else time.perf_counter(),
            )
            t_prev_iter = t_iter
            report.step_done(step, dev_metrics, host, t_update)
            preempt.requested |= report.stop_requested

            do_eval, do_ckpt = report.due(step)
            if do_eval or do_ckpt or preempt.requested:
                prev_done = finalize(step)
                report.flush(
                    state,
                    functools.partial(evaluate_fn, state.params, step) if do_eval else None,
                )
                if do_ckpt or preempt.requested:
                    save(step)
                if preempt.requested:
                    return train_lib._stop(s, report, step)
            if step_callback is not None:
                step_callback(step)

        final_step = int(jax.device_get(state.step))
        ended_by = report.ended_by(final_step)
        finalize(final_step)
        after = report.flush(
            state,
            functools.partial(evaluate_fn, state.params, final_step),
            write_alone=not start.resumed,
        )
        if final_step > start.start_step or not start.resumed:
            save(final_step)
        s.checkpointer.wait()
    finally:
        pool.shutdown(wait=True)
    return summarize(
        run,
        s.workdir,
        start.before,
        after,
        start.warm_info,
        start.prior_seconds,
        t_start,
        final_step,
        s.progress,
        s.is_main,
        data_stats=s.data_stats,
        sampled_tokens=report.sampled_tokens,
        ended_by=ended_by,
    )
