"""The run's state (grpo_jax/run/state.py): every part saves what it carries and a fresh
run's parts continue from it; the staleness wrapper saves its queue, or forwards to a
source that spends the bound itself; checkpoints of the earlier layout still read."""

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers_config import Console

from grpo_jax.core import sharding
from grpo_jax.core.batch import HostRollout, RolloutBatch
from grpo_jax.core.errors import ConfigError
from grpo_jax.data import DataIterator
from grpo_jax.learner import optimizer as optim_lib
from grpo_jax.rollout.scorer import Scorer
from grpo_jax.rollout.sources import InFlight
from grpo_jax.rollout.staleness import Staleness
from grpo_jax.run.config import HealthConfig, TeacherConfig, TrainConfig
from grpo_jax.run.report import Reporter
from grpo_jax.run.schedule import Schedule
from grpo_jax.run.state import RunState, saved_state


class _Source:
    """A source that holds nothing between steps, or (``carries``) a list of its own."""

    split = False

    def __init__(self, carries=False):
        self.spends_staleness = carries
        self.carried = ["row"] if carries else None

    def state_dict(self):
        return None if self.carried is None else {"partial": list(self.carried)}

    def state_arrays(self):
        return None

    def arrays_like(self, state):
        return None

    def load_state_dict(self, state, arrays=None):
        self.carried = list(state["partial"])


class _Writer:
    def __init__(self):
        self.truncated = []

    def truncate(self, step):
        self.truncated.append(step)


def _run_state(mesh, *, max_staleness=0, source=None):
    run = SimpleNamespace(
        train=TrainConfig(steps=10),
        health=HealthConfig(),
        eval=SimpleNamespace(every=0),
        checkpoint=SimpleNamespace(every=0),
        grpo=SimpleNamespace(mu=1, advantage_estimator="grpo"),
        teacher=TeacherConfig(),
    )
    params = {"w": jax.numpy.ones((2, 2))}
    tx, _ = optim_lib.make_optimizer(optim_lib.OptimConfig(), 10)
    iterator = DataIterator([{"prompt": str(i)} for i in range(10)], 2, seed=0)
    console = Console()
    said = console.said
    records = SimpleNamespace(writer=_Writer(), progress=console)
    return RunState(
        train=optim_lib.init_state(params, tx, mesh),
        iterator=iterator,
        scorer=Scorer((), correct_reward="exact_match", timeout_s=5.0),
        pipe=Staleness(source or _Source(), max_staleness, last=10, mesh=mesh),
        report=Reporter(run, records, iterator),
        schedule=Schedule(run, t_start=0.0, say=said.append),
    )


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def test_a_fresh_run_state_continues_from_what_every_part_saved(mesh):
    before = _run_state(mesh)
    rep = sharding.replicated(mesh)
    before.train = before.train.replace(
        step=jax.device_put(np.int32(6), rep), skipped_in_row=jax.device_put(np.int32(2), rep)
    )
    for _ in range(3):
        before.iterator.next()
    before.schedule.sampled(123)
    before.report.no_signal_run, before.report.records_through = 4, 6
    before.report.alarms.check(6, {"train/entropy": 0.5})
    meta, arrays = before.state_dict()
    assert arrays == {}  # nothing in flight at k = 0 around a source that carries nothing
    meta = json.loads(json.dumps(meta))  # as a checkpoint's JSON holds it
    assert sorted(meta) == [
        "counters",
        "data_iterator",
        "health",
        "report",
        "reward_moments",
        "schedule",
    ]

    after = _run_state(mesh)
    after.load_state_dict(meta, arrays)
    assert int(after.train.step) == 6
    assert int(after.train.skipped_in_row) == 0  # a resumed run gets fresh tries
    assert after.train.step.sharding == before.train.step.sharding
    assert after.iterator.next() == before.iterator.next()
    assert after.schedule.sampled_tokens == 123
    assert after.schedule.prior_seconds == meta["schedule"]["wall_seconds"]
    assert after.report.no_signal_run == 4
    assert after.report.records.writer.truncated == [6]  # the records after step 6 go
    assert after.report.alarms.state_dict() == before.report.alarms.state_dict()


def test_a_part_the_checkpoint_holds_nothing_of_starts_afresh(mesh):
    rs = _run_state(mesh)
    rs.load_state_dict({"counters": {"step": 3}, "step": 3}, {})
    assert int(rs.train.step) == 3
    assert rs.schedule.sampled_tokens == 0 and rs.iterator.position == 0
    assert rs.report.records.writer.truncated == [3]  # the earlier layout's step


def test_the_earlier_layouts_top_level_keys_are_read():
    earlier = {"step": 8, "no_signal_run": 2, "sampled_tokens": 99, "wall_seconds": 1.5}
    assert saved_state(earlier, "report") == {"no_signal_run": 2, "records_through": 8}
    assert saved_state(earlier, "schedule") == {"sampled_tokens": 99, "wall_seconds": 1.5}
    assert saved_state(earlier, "health") is None
    own = {**earlier, "schedule": {"sampled_tokens": 5, "wall_seconds": 0.0}}
    assert saved_state(own, "schedule") == own["schedule"]


def _in_flight(step, version, mesh):
    n, p, t = 2, 3, 4
    batch = RolloutBatch(
        prompt_tokens_NxP=np.full((n, p), step, np.int32),
        prompt_mask_NxP=np.ones((n, p), bool),
        tokens_NxT=np.arange(n * t, dtype=np.int32).reshape(n, t) + step,
        mask_NxT=np.ones((n, t), bool),
        old_logps_NxT=np.full((n, t), -0.5, np.float32),
        behavior_logps_NxT=np.full((n, t), -0.5, np.float32),
        rewards_N=np.array([0.0, 1.0], np.float32),
        advantages_N=np.array([-1.0, 1.0], np.float32),
        weights_N=np.ones(n, np.float32),
        group_ids_N=np.zeros(n, np.int32),
    )
    host = HostRollout(
        examples=[{"prompt": "q"}],
        prompts_n=["q", "q"],
        completions=["a", "b"],
        total_n=np.array([0.0, 1.0], np.float32),
        metrics={"rollout/pass_rate": 0.5},
        completion_tokens=8,
        sampled_tokens=8,
        prompt_tokens=6,
        t_params_ready=0.0,
    )
    return InFlight(step, version, batch, host)


def test_the_wrapper_saves_its_queue_and_reads_it_back_laid_out(mesh):
    pipe = Staleness(_Source(), 2, last=10, mesh=mesh)
    pipe.queue = [_in_flight(5, 3, mesh), _in_flight(6, 4, mesh)]
    state = json.loads(json.dumps(pipe.state_dict()))
    assert [(x["step"], x["version"]) for x in state] == [(5, 3), (6, 4)]
    arrays = pipe.state_arrays()
    fresh = Staleness(_Source(), 2, last=10, mesh=mesh)
    like = fresh.arrays_like(state)
    assert like["1"]["tokens_NxT"].sharding == sharding.batch_sharding(mesh, 2)
    fresh.load_state_dict(state, jax.tree.map(jax.numpy.asarray, arrays))
    assert [(f.step, f.version) for f in fresh.queue] == [(5, 3), (6, 4)]
    np.testing.assert_array_equal(fresh.queue[1].batch.tokens_NxT, pipe.queue[1].batch.tokens_NxT)
    assert fresh.queue[0].host.completions == ["a", "b"]
    with pytest.raises(ConfigError, match="partial rollouts in flight"):
        fresh.arrays_like({"partial": {"groups": []}})


def test_a_source_that_spends_the_bound_runs_at_k0_and_its_state_is_forwarded(mesh):
    source = _Source(carries=True)
    pipe = Staleness(source, 2, last=10, mesh=mesh)
    assert pipe.k == 0
    assert pipe.state_dict() == {"partial": ["row"]}
    fresh = _Source(carries=True)
    Staleness(fresh, 2, last=10, mesh=mesh).load_state_dict({"partial": ["a", "b"]})
    assert fresh.carried == ["a", "b"]
    assert Staleness(_Source(), 1, last=10, mesh=mesh).k == 1
