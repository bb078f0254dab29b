"""The training run's records: metrics one step late, warnings, health alarms, progress.

A :class:`Reporter` receives each step's device metrics (still on the device) and host
metrics right after the step's update is dispatched, and writes the step's record only
when the next step's sampling has waited for the update anyway, so the host never stalls
the device to read a number. With the record go the loud warnings (skipped non-finite
updates, a policy that moved too far, no reward variance), the non-finite stop, sample
completions and the health alarms (:class:`Alarms`). Which steps evaluate and checkpoint
is ``grpo_jax.run.schedule``'s. :class:`PulsedProgress` is the run's progress line.
docs/architecture.md, "Reporter".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING

import jax

from grpo_jax.core.errors import AlarmStop, NonFiniteError
from grpo_jax.run import health
from grpo_jax.run.health import describe_stop
from grpo_jax.run.writers import ProgressLine

if TYPE_CHECKING:
    from grpo_jax.core.batch import HostRollout
    from grpo_jax.run.config import RunConfig

log = logging.getLogger(__name__)


def _finite_or_none(x):
    return x if not isinstance(x, float) or math.isfinite(x) else None


# Seconds without a console line after which the progress line says the run goes on: no
# phase of a run (compiling, the warm start's first steps, an evaluation) is silent longer.
PULSE_S = 12.0


class PulsedProgress(ProgressLine):
    """The progress line, plus a line every ``pulse_s`` seconds of silence:
    "... still working (24 s since the last line)". A daemon thread checks once a second
    (:meth:`tick`) until :meth:`close`, or until the line is no longer referenced."""

    def __init__(self, total_steps: int, *, pulse_s: float = PULSE_S, **kwargs):
        super().__init__(total_steps, **kwargs)
        self.pulse_s = pulse_s
        self._lock = threading.Lock()
        self._last = time.monotonic()  # when the last line other than a pulse was printed
        self._pulses = 0  # pulses printed since then
        self._stop = threading.Event()
        if self.enabled and pulse_s > 0:
            ref = weakref.ref(self)
            stop = self._stop
            threading.Thread(
                target=_pulse, args=(ref, stop), name="progress-pulse", daemon=True
            ).start()

    def update(self, step, metrics) -> None:
        with self._lock:
            super().update(step, metrics)
            self._last, self._pulses = time.monotonic(), 0

    def message(self, text: str) -> None:
        with self._lock:
            super().message(text)
            self._last, self._pulses = time.monotonic(), 0

    def tick(self, now: float) -> None:
        """Prints a pulse when ``now`` is ``pulse_s`` seconds past the last line or pulse."""
        with self._lock:
            silent = now - self._last
            if silent < self.pulse_s * (self._pulses + 1):
                return
            self._pulses += 1
            super().message(f"  ... still working ({silent:.0f} s since the last line)")

    def close(self) -> None:
        self._stop.set()


def _pulse(ref, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        progress = ref()
        if progress is None:
            return
        progress.tick(time.monotonic())
        del progress


class Alarms:
    """The training-health alarms (``grpo_jax.run.health``, section ``health``; module doc).

    ``check(step, record)`` returns the alarms that fire at ``step``; their history and
    rearm steps carry across a restart (``state_dict``, with the alarms that stopped the
    run, if any), so a resumed run raises the alarms an uninterrupted one would.
    """

    def __init__(self, cfg, rewards_alone: bool = True):
        self.cfg = cfg  # the health section
        # False: a teacher's term or a critic moves the policy where no group's rewards
        # vary, and the zero-variance alarm would blame a run that learns.
        self.rewards_alone = rewards_alone
        self.stopped_by: list[health.Alarm] = []  # fired with health.stop_on_alarm
        self._recent = collections.deque([], health.history_needed(cfg))
        self._early: list[dict] = []  # the first records (early entropy level)
        self._evals: list[dict] = []  # the last two records with an evaluation
        self._seen: dict[str, int] = {}  # alarm name -> last step it was raised

    @property
    def stop_requested(self) -> bool:
        """Whether an alarm asked the run to stop (``health.stop_on_alarm``)."""
        return bool(self.stopped_by)

    def check(self, step: int, m: dict) -> list[health.Alarm]:
        """The alarms that fire at ``step`` (``m``: its record), by the rearm rule."""
        if not self.cfg.enabled:
            return []
        rec = {k: m[k] for k in (*health.KEYS, self.cfg.hack_check) if k in m}
        if not self.rewards_alone:
            rec.pop("rollout/frac_zero_var_groups", None)
        rec["step"] = step
        if len(self._early) < self.cfg.entropy_window:
            self._early.append(rec)
        if "eval/pass_at_1" in rec:
            self._evals = [*self._evals, rec][-2:]
        self._recent.append(rec)
        oldest = self._recent[0]["step"]
        kept = [r for r in self._early + self._evals if r["step"] < oldest]
        by_step = {r["step"]: r for r in kept}
        history = [by_step[k] for k in sorted(by_step)] + list(self._recent)
        fired = []
        for a in health.diagnose(history, self.cfg):
            last = self._seen.get(a.name)
            if last is None or step - last - 1 > self.cfg.rearm_steps:  # quiet steps
                fired.append(a)
            self._seen[a.name] = step
        return fired

    def stop_error(self, step: int) -> AlarmStop:
        """The error that ends a run stopped by an alarm, its checkpoint of ``step`` saved."""
        return AlarmStop(
            f"{describe_stop(self.stopped_by)} (health.stop_on_alarm); saved the checkpoint of "
            f"step {step}. A rerun refuses to resume past it: look at samples/alarm_*.txt, "
            "then rerun with --config.health.resume_after_stop=True to continue anyway"
        )

    def state_dict(self) -> dict:
        """The history and rearm steps as JSON (a checkpoint's ``meta["health"]``), with
        the alarms that stopped the run under "stopped_by"."""
        records = lambda rs: [{k: _finite_or_none(v) for k, v in r.items()} for r in rs]
        state = {
            "recent": records(self._recent),
            "early": records(self._early),
            "evals": records(self._evals),
            "seen": dict(self._seen),
        }
        if self.stopped_by:
            state["stopped_by"] = [dataclasses.asdict(a) for a in self.stopped_by]
        return state

    def load_state_dict(self, state: dict) -> None:
        self._recent = collections.deque(state.get("recent", []), health.history_needed(self.cfg))
        self._early = list(state.get("early", []))
        self._evals = list(state.get("evals", []))
        self._seen = dict(state.get("seen", {}))


class Reporter:
    """Writes each step's record one step late, with its warnings and alarms (module doc).

    ``records``: the run's ``setup.Records`` (writer, progress line, checkpointer);
    ``iterator``: the data iterator, whose epoch each record gives. Across a restart it
    carries the steps in a row without reward signal and the step its records reach
    (``state_dict``); ``alarms`` carries the health alarms'.
    """

    def __init__(self, run: RunConfig, records, iterator=None):
        self.run, self.records, self.iterator = run, records, iterator
        self.cfg = run.train
        self.no_signal_run = 0  # steps in a row with no reward variance
        # The last step whose update was applied, finite and moved the policy no more
        # than train.update_kl_warn: its checkpoint is one to go back to after a blow-up.
        self.last_healthy = 0
        self.records_through = 0  # the last step whose record is written
        self._pending = None  # (step, device metrics, host metrics, update call time, rollout)
        # Whether the advantages come from the group's rewards alone: not with a teacher's
        # per-token term or a critic's GAE, which move the policy where no rewards vary.
        self.rewards_alone = not (run.teacher.enabled or run.grpo.advantage_estimator == "gae")
        self.alarms = Alarms(run.health, self.rewards_alone)
        # step -> metrics known only once its update has ended (grpo_jax.rollout.staleness's
        # timings, given to step_done and flush): they join the step's record when it is
        # written.
        self._late: dict[int, dict] = {}

    def begin(self, start_step: int) -> None:
        """The run trains from step ``start_step + 1`` (its records reach ``start_step``)."""
        self.last_healthy = self.records_through = start_step
        if start_step < self.cfg.steps:
            # The first step waits for the sampler's and the update's compilation.
            self.message(
                f"GRPO from step {start_step + 1}: compiling the sampler and the update first"
            )

    def loud(self, text: str) -> None:
        """A warning in a banner on the progress line; logged instead where this process
        has no progress line (the other hosts), so a console shows it once, not twice."""
        progress = self.records.progress
        if not progress.enabled:
            log.warning(text)
            return
        bar = "!" * 78
        progress.message(f"{bar}\nWARNING: {text}\n{bar}")

    def message(self, text: str) -> None:
        self.records.progress.message(text)

    @property
    def stop_requested(self) -> bool:
        """Whether a health alarm asked the run to stop (``health.stop_on_alarm``)."""
        return self.alarms.stop_requested

    # -- across a restart ----------------------------------------------------------

    def state_dict(self) -> dict:
        return {"no_signal_run": self.no_signal_run, "records_through": self.records_through}

    def load_state_dict(self, state: dict) -> None:
        """Continues a run's records: those after the step they reached are dropped (the
        resumed run writes them again, exactly)."""
        self.no_signal_run = int(state.get("no_signal_run", 0))
        self.records_through = int(state["records_through"])
        self.records.writer.truncate(self.records_through)

    # -- records -----------------------------------------------------------------

    def write(self, step: int, metrics: dict) -> None:
        """Writes a record of ``step`` now (an evaluation of its own)."""
        self.records.writer.write(step, metrics)
        self.records_through = step

    def step_done(
        self,
        step: int,
        dev_metrics,
        host: HostRollout,
        t_update: float,
        *,
        sampled_tokens: int,
        late=None,
    ) -> None:
        """Queues ``step``'s record and writes the previous step's (its update is done).

        ``t_update``: ``perf_counter()`` when the update was called. The step's
        ``perf/time_train_s`` runs from then until the host saw the update done:
        the update itself (its compilation on the first step) plus at most the
        host work that overlapped it. ``sampled_tokens``: the completion tokens sampled
        so far, this step's included. ``late``: ``{step: metrics}`` of earlier steps known
        only now (their update has ended); they join those steps' records.
        """
        self._late.update(late or {})
        m = dict(host.metrics)
        m["rollout/sampled_tokens_total"] = float(sampled_tokens)
        train_tokens = (host.prompt_tokens + host.completion_tokens) * self.run.grpo.mu
        m["train/epoch"] = float(self.iterator.epoch)
        m["_train_tokens"] = float(train_tokens)
        if self._pending is not None:
            self._finish(self._pending, host.t_params_ready)
        self._pending = (step, dev_metrics, m, t_update, host)
        self._rollout_alarms(step, host)

    def flush(self, state, evaluate=None, *, write_alone: bool = True, late=None) -> dict | None:
        """Waits for the last update, runs ``evaluate()`` (if given) and writes the record now.

        The evaluation joins the last step's record; with no step pending it is
        written alone when ``write_alone``. ``late``: as for :meth:`step_done`.
        Returns the evaluation.
        """
        self._late.update(late or {})
        jax.block_until_ready(state.step)
        t_ready = time.perf_counter()
        extra = evaluate() if evaluate is not None else None
        if self._pending is not None:
            self._finish(self._pending, t_ready, extra)
            self._pending = None
        elif extra is not None and write_alone:
            self.write(int(jax.device_get(state.step)), extra)
        return extra

    def _finish(self, pending, t_ready: float, extra: dict | None = None) -> dict:
        step, dev, host, t_update, rollout = pending
        m = dict(host)
        m.update({k: float(v) for k, v in jax.device_get(dev).items()})
        m.update(extra or {})
        m.update(self._late.pop(step, {}))
        t_train = t_ready - t_update
        m["perf/time_train_s"] = t_train
        m["perf/train_tokens_per_s"] = m.pop("_train_tokens") / max(t_train, 1e-9)
        m["perf/step_s"] = m["perf/time_sample_s"] + m["perf/time_reward_s"] + t_train
        fired = self.alarms.check(step, m)
        m.update({f"alarms/{a.name}": 1.0 for a in fired})
        self.write(step, m)
        self.records.progress.update(step, m)
        for a in fired:
            self._report_alarm(a, rollout)
        self._update_alarms(step, m)
        return m

    # -- warnings ----------------------------------------------------------------

    def _update_alarms(self, step: int, m: dict) -> None:
        cfg = self.cfg
        kl = m.get("policy/kl_old_new", 0.0)
        if (
            m["train/skipped_updates"] == 0
            and math.isfinite(m["train/loss"])
            and math.isfinite(kl)
            and not (cfg.update_kl_warn and kl > cfg.update_kl_warn)
        ):
            self.last_healthy = step
        if m["train/skipped_updates"] > 0:
            self.loud(
                f"step {step}: {int(m['train/skipped_updates'])} update(s) had a "
                "non-finite loss or gradient and were skipped (parameters unchanged)"
            )
        if m["train/skipped_in_row"] >= cfg.max_nonfinite_in_row:
            raise NonFiniteError(
                f"stopping at step {step}: the last {int(m['train/skipped_in_row'])} updates "
                f"had a non-finite loss or gradient (train.max_nonfinite_in_row = "
                f"{cfg.max_nonfinite_in_row}); no non-finite update reached the parameters, "
                f"but steps after {self.last_healthy} were unhealthy. {self._way_back()}"
            )
        if cfg.update_kl_warn and kl > cfg.update_kl_warn:
            self.loud(
                f"step {step}: the policy moved too far in one step: KL(pi_old || pi_new) = "
                f"{kl:.4f} > train.update_kl_warn = {cfg.update_kl_warn} (ratios "
                f"{m['policy/ratio_min']:.2f}..{m['policy/ratio_max']:.2f}); lower "
                "optim.learning_rate or grpo.mu if this repeats"
            )

    def _report_alarm(self, alarm: health.Alarm, host: HostRollout) -> None:
        stop = self.alarms.cfg.stop_on_alarm
        self.loud(
            f"health alarm {alarm.name}: {alarm.message}"
            + (" (health.stop_on_alarm: saving a checkpoint and stopping)" if stop else "")
        )
        if stop:
            self.alarms.stopped_by.append(alarm)
        if host is not None:
            self.records.writer.write_samples(
                alarm.step,
                self._samples(host, max(self.cfg.num_samples_logged, 1)),
                name=f"alarm_{alarm.name}_step",
                header=f"health alarm {alarm.name}: {alarm.message}",
            )

    def _way_back(self) -> str:
        ck = self.records.checkpointer
        ck.wait()
        good = [k for k in ck.all_steps() if k <= self.last_healthy]
        if not good:
            return (
                "No checkpoint from before that is kept: start again with a lower "
                "optim.learning_rate (and check the rewards) in a new --workdir."
            )
        return (
            f"Checkpoint step {good[-1]} is the newest from before: rerun with "
            f"--config.checkpoint.resume_from={good[-1]} "
            "--config.checkpoint.allow_changed_config=True and a lower "
            "--config.optim.learning_rate (and check the rewards)."
        )

    def _rollout_alarms(self, step: int, host: HostRollout) -> None:
        cfg, m = self.cfg, host.metrics
        no_signal = self.rewards_alone and m["rollout/frac_zero_var_groups"] >= 1.0
        self.no_signal_run = self.no_signal_run + 1 if no_signal else 0
        n = self.no_signal_run
        if cfg.no_signal_steps and n and n % cfg.no_signal_steps == 0:
            self.loud(_no_signal_message(step, n, m))
        if cfg.samples_every and step % cfg.samples_every == 0 and cfg.num_samples_logged:
            self.records.writer.write_samples(step, self._samples(host, cfg.num_samples_logged))

    def _samples(self, host: HostRollout, n: int) -> list[dict]:
        """The first ``n`` rows of a rollout as prompt / completion / answer / reward."""
        G = self.run.grpo.G
        return [
            {
                "prompt": host.prompts_n[i],
                "completion": host.completions[i],
                "answer": host.examples[i // G].get("answer"),
                "reward": float(host.total_n[i]),
            }
            for i in range(min(n, len(host.completions)))
        ]


def _no_signal_message(step: int, n: int, m: dict) -> str:
    """Why no group has had reward variance for ``n`` steps: the policy (all or none of each
    group solved), or the rewards, when no completion of step ``step`` has one."""
    if m.get("rewards/unscored_frac", 0.0) < 1.0:
        return (
            f"step {step}: no group has had any reward variance for {n} steps "
            "in a row, so every advantage is 0 and GRPO is not learning. The policy "
            f"solves all or none of each group (pass rate {m['rollout/pass_rate']:.2f});"
            " warm-start longer, make the task easier or raise grpo.G / temperature"
        )
    failing = [
        k.split("/")[1]
        for k, v in m.items()
        if k.count("/") == 2 and k.endswith("/unscored_frac") and v >= 1.0
    ]
    return (
        f"step {step}: no group has had any reward variance for {n} steps in a row because "
        "no completion has a reward: every one is unscored (NaN), so every advantage is 0 and "
        f"GRPO is not learning. The rewards fail, not the policy: {', '.join(failing)} scored "
        "nothing this step (rewards/<name>/errors; the warnings above say why)"
    )
