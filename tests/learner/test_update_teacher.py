"""The update with a teacher (on-policy distillation): weight 0 changes nothing, the student
as its own teacher adds nothing, and the teacher's metrics are its scoring's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_batches import rollout_batch
from helpers_jit import completion_logps

from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.models import create_model
from grpo_jax.objective import logprobs
from grpo_jax.objective.distill import TeacherConfig, full_reverse_kl
from grpo_jax.run.config import GRPOConfig, OptimConfig

pytestmark = pytest.mark.slow  # compiles the update several times

N, P, T, V = 8, 6, 5, 100


@pytest.fixture(scope="module")
def setup(tiny_policy, tiny_model_config, one_device_mesh):
    graphdef, params = tiny_policy
    rng = np.random.default_rng(0)
    pm = np.ones((N, P), bool)
    pm[:, :2] = False
    m = np.ones((N, T), bool)
    m[::2, 3:] = False
    rows = dict(
        prompt_tokens=rng.integers(4, V, (N, P)).astype(np.int32),
        prompt_mask=pm,
        tokens=rng.integers(4, V, (N, T)).astype(np.int32),
        mask=m,
    )
    batch = rollout_batch(graphdef, params, rows, rng.normal(size=N).astype(np.float32))
    other = nnx.split(create_model(tiny_model_config, seed=7, mesh=one_device_mesh))
    return graphdef, params, one_device_mesh, batch, rows, other


def _run(setup, *, grpo=None, teacher=None, frozen=None, teacher_graphdef=None, chunk=0):
    """One jitted update from a fresh state: (state, metrics) on the host."""
    graphdef, params, mesh, batch, _, _ = setup
    grpo = grpo or GRPOConfig(G=4)
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    state = optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    frozen_sh = None
    if teacher is not None:
        frozen_sh = jax.tree.map(lambda x: x.sharding, frozen)
    fn = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=grpo,
        minibatch_size=0,
        grad_accum=1,
        batch_shards=1,
        track_update=False,
        logits_chunk=chunk,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=frozen_sh,
        replicated=sharding.replicated(mesh),
        teacher=teacher,
        teacher_graphdef=teacher_graphdef,
    )
    state, metrics = fn(state, batch, jax.random.key(0), frozen)
    return jax.device_get(state), jax.device_get(metrics)


def _same_leaves(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_weight_zero_leaves_the_update_bit_identical(setup):
    _, _, _, _, _, (t_graphdef, t_params) = setup
    plain, m_plain = _run(setup)
    frozen = upd.FrozenModels(None, t_params)
    zero, m_zero = _run(
        setup, teacher=TeacherConfig("t", weight=0.0), frozen=frozen, teacher_graphdef=t_graphdef
    )
    _same_leaves(plain.params, zero.params)
    _same_leaves(plain.opt_state, zero.opt_state)
    assert m_zero.keys() == m_plain.keys()  # nothing scored: no teacher/* metrics
    for k, v in m_plain.items():
        np.testing.assert_array_equal(v, m_zero[k], err_msg=k)


def test_the_student_as_its_own_teacher_adds_nothing(setup):
    _, params, _, _, _, _ = setup
    grpo = GRPOConfig(G=4, old_logps="recompute")  # pi_old scored as the teacher is
    plain, _ = _run(setup, grpo=grpo)
    frozen = upd.FrozenModels(None, params)
    same, m = _run(setup, grpo=grpo, teacher=TeacherConfig("t"), frozen=frozen)
    assert m["teacher/kl"] == 0.0 and m["teacher/adv_share"] == 0.0
    # The term is exactly 0; the teacher's pass in the program moves XLA's fusion, so the
    # parameters agree to float32 rounding, not bit for bit.
    for x, y in zip(jax.tree.leaves(plain.params), jax.tree.leaves(same.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_a_teacher_moves_the_update_and_reports_its_kl(setup):
    graphdef, params, _, batch, rows, (t_graphdef, t_params) = setup
    plain, _ = _run(setup)
    frozen = upd.FrozenModels(None, t_params)
    on, m = _run(setup, teacher=TeacherConfig("t"), frozen=frozen, teacher_graphdef=t_graphdef)
    args = (rows["prompt_tokens"], rows["prompt_mask"], rows["tokens"], rows["mask"], 1.0)
    teacher_NxT = np.asarray(completion_logps(t_graphdef, t_params, *args))
    mask = rows["mask"].astype(np.float32)
    want = ((np.asarray(batch.old_logps_NxT) - teacher_NxT) * mask).sum() / mask.sum()
    np.testing.assert_allclose(m["teacher/kl"], want, rtol=1e-5)
    assert 0.0 < m["teacher/adv_share"] < 1.0
    moved = [
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(plain.params), jax.tree.leaves(on.params), strict=True)
    ]
    assert any(moved)


def test_the_reference_as_teacher_reuses_the_reference_scoring(setup):
    """beta > 0 with teacher.path = "reference": the teacher is the reference's arrays (no
    second copy), and its KL is the reference's k1 KL on the same tokens."""
    _, params, _, _, _, (_, t_params) = setup
    grpo = dataclasses.replace(GRPOConfig(G=4), beta=0.04, kl_estimator="k1")
    frozen = upd.FrozenModels(t_params, None)
    _, m = _run(setup, grpo=grpo, teacher=TeacherConfig("reference"), frozen=frozen)
    np.testing.assert_allclose(m["teacher/kl"], m["train/kl"], rtol=1e-5)


def _full_kl_by_logits(setup):
    """KL(pi_student || pi_teacher) per token from each model's whole logits [N, T, V]."""
    graphdef, params, _, _, rows, (t_graphdef, t_params) = setup
    args = (rows["prompt_tokens"], rows["prompt_mask"], rows["tokens"], rows["mask"])
    zs = logprobs.completion_logits(graphdef, params, *args)
    zt = logprobs.completion_logits(t_graphdef, t_params, *args)
    return np.asarray(full_reverse_kl(zs, zt, 1.0))


@pytest.mark.parametrize("chunk", [0, 1])
def test_the_full_kl_is_the_whole_logits_kl_chunked_or_not(setup, chunk):
    _, _, _, _, rows, (t_graphdef, t_params) = setup
    frozen = upd.FrozenModels(None, t_params)
    teacher = TeacherConfig("t", kl="full", weight=0.5)
    plain, _ = _run(setup, chunk=chunk)
    on, m = _run(setup, teacher=teacher, frozen=frozen, teacher_graphdef=t_graphdef, chunk=chunk)
    mask = rows["mask"].astype(np.float32)
    want = (_full_kl_by_logits(setup) * mask).sum() / mask.sum()
    np.testing.assert_allclose(m["teacher/kl"], want, rtol=1e-5)
    assert "teacher/adv_share" not in m  # a penalty, no advantage term
    moved = [
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(plain.params), jax.tree.leaves(on.params), strict=True)
    ]
    assert any(moved)


def test_the_full_kl_to_the_student_itself_is_zero_and_moves_nothing(setup):
    _, params, _, _, _, _ = setup
    plain, _ = _run(setup)
    teacher = TeacherConfig("t", kl="full")
    same, m = _run(setup, teacher=teacher, frozen=upd.FrozenModels(None, params))
    assert abs(m["teacher/kl"]) < 1e-6
    # The KL's gradient is 0 in exact arithmetic; Adam's first step (lr 1e-2, each
    # parameter moved by about lr) turns its float32 rounding into ~1e-6 differences.
    for x, y in zip(jax.tree.leaves(plain.params), jax.tree.leaves(same.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
