"""The packed update (train.packing = "on") against the padded one: the plan, the loss and
its gradient for every reduction, policy loss and KL estimator, the scoring passes, the step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_batches import grouped_batch, rollout_batch
from helpers_jit import completion_logps

from grpo_jax.core import sharding
from grpo_jax.learner import accumulate, optimizer, packing, step, terms
from grpo_jax.learner import update as upd
from grpo_jax.run.config import GRPOConfig, OptimConfig

B, G, P, T, V = 2, 4, 6, 5, 100
N = B * G


def _rows(rng):
    """Grouped rows with ragged prompts and completions: lengths 5, 3 and 1, one empty."""
    rows = grouped_batch(rng, B, G, P, T, V)
    rows["mask"][5, 1:] = False
    rows["mask"][7, :] = False
    return rows


@pytest.fixture(scope="module")
def setup(tiny_policy):
    """(graphdef, params, ref_params, batch): pi_old and the reference moved off the policy,
    so the ratios leave 1, both clip sides bind and the KL term has a gradient; row 2 has
    weight 0."""
    graphdef, params = tiny_policy
    rng = np.random.default_rng(3)
    rows = _rows(rng)
    weights = np.ones(N, np.float32)
    weights[2] = 0.0
    batch = rollout_batch(graphdef, params, rows, rng.normal(size=N).astype(np.float32), weights)
    noise = 0.3 * rng.standard_normal(batch.old_logps_NxT.shape).astype(np.float32)
    old = (batch.old_logps_NxT + noise) * rows["mask"]
    batch = batch.replace(old_logps_NxT=old, behavior_logps_NxT=old - 0.1 * rows["mask"])
    ref = jax.tree.map(lambda x: x + 0.05 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), params)
    return graphdef, params, ref, jax.tree.map(jnp.asarray, batch)


def _settings(two_level=True, tokens=0, shards=1, minibatches=1, default_rows=N, row=0):
    return packing.PackSettings(
        row_slots=row,
        group_size=G,
        shards=shards,
        num_minibatches=minibatches,
        microbatch_tokens=tokens,
        default_rows=default_rows,
        two_level=two_level,
    )


def _plan(batch, s):
    masks = (batch.prompt_mask_NxP, batch.mask_NxT, batch.weights_N)
    return packing.plan_packs(*(np.asarray(x) for x in masks), s)


# ---------------------------------------------------------------------------
# The plan.


def test_the_plan_scores_every_loss_token_once_and_restarts_positions(setup):
    *_, batch = setup
    mask = np.asarray(batch.mask_NxT) & (np.asarray(batch.weights_N) > 0)[:, None]
    for s in (_settings(), _settings(two_level=False), _settings(tokens=P + T), _settings(row=64)):
        packs, stats = _plan(batch, s)
        dst = np.asarray(packs.head_dst_SxM).reshape(-1)
        dst = dst[dst < N * T]
        assert sorted(dst) == sorted(np.flatnonzero(mask.reshape(-1)))  # each exactly once
        assert stats["tokens"] <= stats["slots"]
        ids, pos = np.asarray(packs.id_RxL), np.asarray(packs.pos_RxL)
        starts = (ids > 0) & (np.diff(ids, prepend=0, axis=-1) != 0)
        assert (pos[starts] == 0).all()  # each sequence starts at position 0
        assert int(np.asarray(packs.count).sum()) == mask.sum()
    # Two levels put a group's prompt in once for several of its completions.
    two, _ = _plan(batch, _settings())
    one, _ = _plan(batch, _settings(two_level=False))
    prompt_slots = lambda p: int(
        ((np.asarray(p.id_RxL) > 0) & (np.asarray(p.src_RxL) < N * P)).sum()
    )
    assert prompt_slots(two) < prompt_slots(one)
    # Rows long enough for a whole group: its prompt once.
    whole, _ = _plan(batch, _settings(row=P + G * T))
    assert prompt_slots(whole) == int(np.asarray(batch.prompt_mask_NxP)[::G].sum())
    with pytest.raises(ValueError, match="do not hold"):
        _plan(batch, _settings(row=P + T - 1))


def test_a_small_token_budget_gives_more_micro_batches_and_a_power_of_two_count(setup):
    *_, batch = setup
    _, one = _plan(batch, _settings())
    packs, many = _plan(batch, _settings(tokens=P + T))
    assert one["micro_batches"] == 1 and many["micro_batches"] > 1
    k = many["compiled_micro_batches"]
    assert k >= many["micro_batches"] and k & (k - 1) == 0
    assert packs.src_RxL.shape[:2] == (1, k)


def test_a_scored_row_without_a_prompt_is_refused(setup):
    *_, batch = setup
    pmask = np.asarray(batch.prompt_mask_NxP).copy()
    pmask[0] = False
    with pytest.raises(ValueError, match="empty prompt"):
        packing.plan_packs(
            pmask, np.asarray(batch.mask_NxT), np.asarray(batch.weights_N), _settings()
        )


# ---------------------------------------------------------------------------
# The loss and its gradient: packed equals padded, float32, 1e-5 relative.

_GRADS = {}


def _loss_and_grads(setup, grpo, packs):
    """(loss, gradient) of the whole batch as one minibatch: padded (``packs`` None, one
    micro-batch) or packed (the plan's micro-batches)."""
    graphdef, params, ref, batch = setup
    key = (grpo, packs is None)
    if key not in _GRADS:

        @jax.jit
        def fn(params, ref, batch, packs):
            plan = step.StepPlan(
                graphdef=graphdef, base_graphdef=None, tx=None, schedule=None, objective=grpo,
                logits_chunk=0, grad_accum=1, batch_shards=1, g_full=G, g_micro=G,
                lora_dropout=0.0, packs=packs,
            )  # fmt: skip
            prepared, _ = terms.prepare_batch(plan, None, batch, ref, grpo.old_logps)
            k = jax.random.key(0)
            if packs is None:
                loss, _, grads = accumulate.accumulate(
                    plan, terms.make_grad_fn(plan), params, None, prepared, k
                )
            else:
                grad_fn = terms.make_grad_fn(plan, terms.packed_loss)
                first = jax.tree.map(lambda x: x[0], packs)
                loss, _, grads = accumulate.packed_accumulate(
                    plan, grad_fn, params, None, prepared, first, k
                )
            return loss, grads

        _GRADS[key] = fn
    return _GRADS[key](params, ref, batch, packs)


def _assert_same_loss_and_grads(a, b):
    (l0, g0), (l1, g1) = a, b
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    assert float(jnp.abs(l0)) > 1e-3  # a live loss
    for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        scale = float(jnp.max(jnp.abs(x)))
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5 * scale)


OBJECTIVES = [
    dict(),
    dict(reduction="token_mean"),
    dict(reduction="dr_grpo"),
    dict(reduction="gspo"),
    dict(policy_loss="cispo"),
    dict(policy_loss="sapo"),
    dict(policy_loss="gmpo"),
    dict(policy_loss="clip_cov", cov_frac=0.2),
    dict(policy_loss="kl_cov", cov_frac=0.2),
    dict(kl_estimator="k1"),
    dict(kl_estimator="k2"),
    dict(kl_estimator="k3_seed"),
    dict(behavior_correction="tis"),
    dict(reduction="gspo", behavior_correction="mis", behavior_level="sequence"),
]


def _id(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


# Three plans a configuration, each compiled: seconds each on a CPU.
@pytest.mark.slow
@pytest.mark.parametrize("objective", OBJECTIVES, ids=[_id(kw) for kw in OBJECTIVES])
def test_packed_loss_and_gradient_equal_the_padded(setup, objective):
    """Each objective on four plans: two levels in one micro-batch, one level in one, two
    levels in micro-batches of one row (several, the count rounded up with empty ones: the
    reductions divide by the minibatch's counts; Clip-Cov and KL-Cov take two passes), and
    rows of a whole group (its prompt once)."""
    *_, batch = setup
    grpo = GRPOConfig(G=G, beta=0.1, **objective)
    padded = _loss_and_grads(setup, grpo, None)
    plans = (
        _settings(),
        _settings(two_level=False),
        _settings(tokens=P + T),
        _settings(row=P + G * T),
    )
    for s in plans:
        packs, _ = _plan(batch, s)
        _assert_same_loss_and_grads(padded, _loss_and_grads(setup, grpo, packs))


# ---------------------------------------------------------------------------
# The scoring passes: pi_old recomputed, the reference, track_update.


@pytest.mark.parametrize("shards,minibatches", [(1, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_packed_scoring_pass_equals_the_padded_log_probs(setup, shards, minibatches):
    """The whole batch scored packed (the reference's and pi_old's pass) equals its padded
    log-probs at every loss token, over minibatches and batch shards too."""
    graphdef, params, ref, batch = setup
    s = _settings(tokens=2 * (P + T), shards=shards, minibatches=minibatches)
    packs, _ = _plan(batch, s)
    plan = step.StepPlan(
        graphdef=graphdef, base_graphdef=None, tx=None, schedule=None, objective=GRPOConfig(G=G),
        logits_chunk=0, grad_accum=1, batch_shards=shards, g_full=G, g_micro=G,
        lora_dropout=0.0, packs=packs,
    )  # fmt: skip
    got = jax.jit(lambda p, b, k: dataclasses.replace(plan, packs=k).logps(p, b, G))(
        ref, batch, packs
    )
    want = completion_logps(
        graphdef, ref, batch.prompt_tokens_NxP, batch.prompt_mask_NxP, batch.tokens_NxT,
        batch.mask_NxT, 1.0,
    )  # fmt: skip
    loss_mask = np.asarray(batch.mask_NxT) & (np.asarray(batch.weights_N) > 0)[:, None]
    np.testing.assert_allclose(np.asarray(got)[loss_mask], np.asarray(want)[loss_mask], rtol=1e-5)
    assert (np.asarray(got)[~loss_mask] == 0).all()


# ---------------------------------------------------------------------------
# The whole step.


@pytest.mark.slow
def test_the_packed_step_equals_the_padded_step(setup, one_device_mesh):
    """mu = 2 passes over two minibatches, the reference, pi_old recomputed and the policy's
    movement tracked: the packed update (micro-batches of one packed row) moves the
    parameters as the padded one and reports the same metrics."""
    graphdef, params, ref, batch = setup
    mesh = one_device_mesh
    grpo = GRPOConfig(G=G, mu=2, beta=0.1, old_logps="recompute")
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    state = lambda: optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    kw = dict(
        graphdef=graphdef, tx=tx, schedule=schedule, grpo=grpo, minibatch_size=N // 2,
        grad_accum=1, batch_shards=1, track_update=True,
        state_shardings=jax.tree.map(lambda x: x.sharding, state()),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=jax.tree.map(lambda x: x.sharding, params),
        replicated=sharding.replicated(mesh),
    )  # fmt: skip
    padded = jax.device_get(upd.jit_update(**kw)(state(), batch, jax.random.key(0), ref))
    s = _settings(tokens=P + T, minibatches=2, default_rows=N // 2)
    packed_fn = packing.jit_packed_update(settings=s, **kw)
    packed = jax.device_get(packed_fn(state(), batch, jax.random.key(0), ref))
    (a, ma), (b, mb) = padded, packed
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=3e-5, rtol=1e-5)
    for k in (
        "train/loss",
        "train/kl",
        "train/entropy",
        "train/clip_frac_low",
        "policy/kl_old_new",
    ):
        np.testing.assert_allclose(mb[k], ma[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert 0 < mb["perf/pack_fill"] <= 1 and mb["perf/pack_micro_batches"] > 2


# ---------------------------------------------------------------------------
# The settings.


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"train.packing": "yes"}, "train.packing"),
        ({"train.microbatch_tokens": 64}, "'train.microbatch_tokens' = 64 needs train.packing"),
        ({"train.packing": "on", "train.microbatch_tokens": -1}, "train.microbatch_tokens"),
        ({"train.pack_row_tokens": 64}, "'train.pack_row_tokens' = 64 needs train.packing"),
        # The smoke config's prompt buckets reach 32; 6 new tokens.
        ({"train.packing": "on", "train.pack_row_tokens": 37}, "at least .* = 38"),
    ],
)
def test_bad_packing_settings_name_the_key(overrides, message):
    from helpers_config import run_config

    from grpo_jax.run.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        run_config(**overrides)
