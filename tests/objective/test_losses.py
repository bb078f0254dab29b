"""The GRPO objective: golden values, gradients, KL estimators, reductions, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_jit import central_differences
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.core import sharding
from grpo_jax.core.errors import ConfigError
from grpo_jax.objective import kl, losses
from grpo_jax.objective.config import REDUCTIONS, GRPOConfig

# The loss as one compiled program per shape and objective (its settings are static): called
# eagerly, each of its operations would compile on its own (docs/testing.md).
grpo_loss = jax.jit(losses.grpo_loss, static_argnums=4)


def seed_example():
    """The source document's worked example (docs/objective.md): G = 2, A = [-1, +1], T = 6."""
    new1, old1 = np.array([0.05, 0.07, 0.03]), np.array([0.15, 0.28, 0.36])
    logps = np.zeros((2, 6))
    old = np.zeros((2, 6))
    logps[0, :3], old[0, :3] = np.log(new1), np.log(old1)
    logps[1], old[1] = np.log(1 / 6), 0.0  # Six tokens with ratio 1/6.
    mask = np.zeros((2, 6))
    mask[0, :3], mask[1] = 1, 1
    adv = np.array([-1.0, 1.0])
    return (jnp.asarray(x, jnp.float32) for x in (logps, old, adv, mask))


def test_golden_seed_example_with_clipping():
    logps, old, adv, mask = seed_example()
    # Response 1 alone: every token sits on the flat side of the clip, -0.99 each.
    loss1, m1 = grpo_loss(
        logps[:1],
        old[:1],
        adv[:1],
        mask[:1],
        GRPOConfig(epsilon_low=0.01, epsilon_high=0.01),
    )
    np.testing.assert_allclose(loss1, 0.99, rtol=1e-6)
    assert float(m1["clip_frac_low"]) == 1.0
    loss2, _ = grpo_loss(
        logps[1:],
        old[1:],
        adv[1:],
        mask[1:],
        GRPOConfig(epsilon_low=0.01, epsilon_high=0.01),
    )
    np.testing.assert_allclose(loss2, -1 / 6, rtol=1e-6)
    loss, _ = grpo_loss(logps, old, adv, mask, GRPOConfig(epsilon_low=0.01, epsilon_high=0.01))
    np.testing.assert_allclose(loss, -(-0.99 + 1 / 6) / 2, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.4116666666, rtol=1e-6)


def test_golden_seed_example_without_clipping():
    logps, old, adv, mask = seed_example()
    off = GRPOConfig(epsilon_low=None, epsilon_high=None)
    loss1, _ = grpo_loss(logps[:1], old[:1], adv[:1], mask[:1], off)
    np.testing.assert_allclose(-loss1, -2 / 9, rtol=1e-6)
    loss, m = grpo_loss(logps, old, adv, mask, off)
    np.testing.assert_allclose(-loss, -1 / 36, rtol=1e-5)
    np.testing.assert_allclose(loss, 1 / 36, rtol=1e-5)
    assert float(m["clip_frac_low"]) == 0.0 and float(m["clip_frac_high"]) == 0.0


def random_batch(seed=0, n=6, t=5, beta_ref=True):
    rng = np.random.default_rng(seed)
    logps = rng.normal(-1.5, 0.5, (n, t))
    old = logps + rng.normal(0, 0.3, (n, t))
    ref = logps + rng.normal(0, 0.3, (n, t))
    adv = rng.normal(size=n)
    lengths = rng.integers(1, t + 1, n)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kl", sorted(kl.KL_ESTIMATORS))
def test_gradient_matches_finite_differences(reduction, kl):
    logps, old, ref, adv, mask = random_batch()
    with jax.enable_x64(True):
        f = lambda lp: grpo_loss(
            lp,
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(mask),
            GRPOConfig(
                beta=0.1, epsilon_low=0.2, epsilon_high=0.28, kl_estimator=kl, reduction=reduction
            ),
            ref_logps_NxT=jnp.asarray(ref),
        )[0]
        x = jnp.asarray(logps)
        grad = np.asarray(jax.jit(jax.grad(f))(x))
        fd = central_differences(f, x)
    np.testing.assert_allclose(grad, fd, atol=1e-6)
    assert np.all(grad[mask == 0] == 0), "padding must get no gradient"


def test_one_inner_step_equals_reinforce_with_group_baseline():
    """At rho = 1 and beta = 0, the clipped objective's gradient is REINFORCE's.

    The second source document's objective: J = (1/N) sum_i A_i (1/|o_i|) sum_t log pi(o_it),
    with A the group-relative advantage (the group mean as baseline).
    """
    logps, _, _, _, mask = random_batch(seed=1, n=8)
    rewards = np.random.default_rng(1).integers(0, 2, (2, 4)).astype(np.float32)
    from grpo_jax.objective.advantages import group_advantages

    adv = np.asarray(group_advantages(jnp.asarray(rewards))).reshape(-1)
    x = jnp.asarray(logps, jnp.float32)
    m = jnp.asarray(mask, jnp.float32)
    g_grpo = jax.jit(jax.grad(lambda lp: grpo_loss(lp, x, jnp.asarray(adv), m)[0]))(x)

    def reinforce(lp):
        per_seq = (lp * m).sum(1) / m.sum(1)
        return -(jnp.asarray(adv) * per_seq).mean()

    np.testing.assert_allclose(g_grpo, jax.jit(jax.grad(reinforce))(x), atol=1e-7)


@pytest.mark.parametrize(
    "name, value, grad",
    [
        ("k1", lambda lp, r: lp - r, lambda lp, r: np.ones_like(lp)),
        ("k2", lambda lp, r: 0.5 * (lp - r) ** 2, lambda lp, r: lp - r),
        ("k3", lambda lp, r: np.exp(r - lp) - (r - lp) - 1, lambda lp, r: 1 - np.exp(r - lp)),
        (
            "k3_seed",
            lambda lp, r: np.exp(lp - r) - (lp - r) - 1,
            lambda lp, r: np.exp(lp - r) - 1,
        ),
    ],
)
def test_kl_estimators_match_numpy(name, value, grad):
    rng = np.random.default_rng(2)
    lp, r = rng.normal(-2, 1, 50), rng.normal(-2, 1, 50)
    fn = kl.KL_ESTIMATORS[name]
    with jax.enable_x64(True):
        np.testing.assert_allclose(fn(jnp.asarray(lp), jnp.asarray(r)), value(lp, r), rtol=1e-12)
        g = jax.jit(jax.vmap(jax.grad(fn)))(jnp.asarray(lp), jnp.asarray(r))
    np.testing.assert_allclose(g, grad(lp, r), rtol=1e-10, atol=1e-12)
    if name != "k1":
        assert np.all(value(lp, r) >= 0)


@pytest.mark.slow
def test_k1_as_a_loss_has_zero_expected_gradient_but_k2_k3_pull_to_the_reference():
    """Gradients through log pi_theta at fixed on-policy samples, in expectation.

    k1: E[grad log pi_theta] = 0, no pull at all. k2: grad KL(pi_theta || pi_ref).
    k3: E[(1 - pi_ref/pi_theta) grad log pi_theta] = grad KL(pi_ref || pi_theta).
    """
    theta = jnp.array([0.5, -1.0, 2.0, 0.0, -0.3])
    ref_logits = jnp.array([0.0, 0.2, 0.1, -0.5, 1.0])
    ref_logp = jax.nn.log_softmax(ref_logits)
    samples = jax.random.categorical(jax.random.key(0), theta, shape=(400_000,))

    def sample_loss(th, est):
        lp = jax.nn.log_softmax(th)[samples]
        return kl.KL_ESTIMATORS[est](lp, ref_logp[samples]).mean()

    def kl_forward(th):  # KL(pi_theta || pi_ref)
        p = jax.nn.softmax(th)
        return (p * (jax.nn.log_softmax(th) - ref_logp)).sum()

    def kl_reverse(th):  # KL(pi_ref || pi_theta)
        return (jnp.exp(ref_logp) * (ref_logp - jax.nn.log_softmax(th))).sum()

    g_k1 = np.asarray(jax.grad(sample_loss)(theta, "k1"))
    assert np.abs(g_k1).max() < 0.01, g_k1  # Pure noise around zero.
    g_fwd = np.asarray(jax.grad(kl_forward)(theta))
    g_rev = np.asarray(jax.grad(kl_reverse)(theta))
    assert np.abs(g_fwd).max() > 0.2 and np.abs(g_rev).max() > 0.2
    np.testing.assert_allclose(jax.grad(sample_loss)(theta, "k2"), g_fwd, atol=0.02)
    np.testing.assert_allclose(jax.grad(sample_loss)(theta, "k3"), g_rev, atol=0.02)


def test_per_token_logps_temperature():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (3, 8, 50)).astype(np.float32)
    tokens = rng.integers(0, 50, (3, 8))
    for temp in (1.0, 0.7):
        want = jax.nn.log_softmax(logits / temp, -1)
        want = np.take_along_axis(np.asarray(want), tokens[..., None], -1)[..., 0]
        got = losses.per_token_logps(jnp.asarray(logits), jnp.asarray(tokens), temperature=temp)
        np.testing.assert_allclose(got, want, atol=1e-5)
    # Without a temperature: 1.0, and bfloat16 logits are scored in float32.
    want = jax.nn.log_softmax(logits, -1)
    want = np.take_along_axis(np.asarray(want), tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        losses.per_token_logps(jnp.asarray(logits), jnp.asarray(tokens)), want, atol=1e-5
    )
    bf16 = losses.per_token_logps(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(tokens))
    assert bf16.dtype == jnp.float32
    np.testing.assert_allclose(bf16, want, atol=0.1)


def test_entropy_metric():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(losses.token_entropy(jnp.asarray(logits)), want, rtol=1e-5)
    mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    z = jnp.zeros((2, 3))
    _, m = grpo_loss(z, z, jnp.ones(2), jnp.asarray(mask), logits_NxTxV=jnp.asarray(logits))
    np.testing.assert_allclose(m["entropy"], (want * mask).sum() / mask.sum(), rtol=1e-5)


def test_reductions_by_hand():
    # Two rows, ratio 1 everywhere (no clipping), beta = 0: objective_t = A_i.
    z = jnp.zeros((2, 4))
    adv = jnp.array([1.0, -2.0])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], jnp.float32)
    get = lambda r, **kw: float(grpo_loss(z, z, adv, mask, GRPOConfig(reduction=r), **kw)[0])
    np.testing.assert_allclose(get("grpo"), -(1.0 + -2.0) / 2)
    np.testing.assert_allclose(get("token_mean"), -(3 * 1.0 - 2.0) / 4)
    np.testing.assert_allclose(get("dr_grpo"), -(3 * 1.0 - 2.0) / (2 * 4))
    np.testing.assert_allclose(get("dr_grpo", max_tokens=10), -(3 * 1.0 - 2.0) / (2 * 10))
    np.testing.assert_allclose(get("gspo"), -(1.0 - 2.0) / 2)


def test_gspo_clips_the_sequence_ratio():
    # Row 0: token log-ratios 0.3 and -0.1 -> s = exp(0.1); with eps 0.05 and A > 0 it clips.
    old = jnp.zeros((1, 2))
    lp = jnp.array([[0.3, -0.1]])
    loss, m = grpo_loss(
        lp,
        old,
        jnp.array([1.0]),
        jnp.ones((1, 2)),
        GRPOConfig(reduction="gspo", epsilon_low=0.05, epsilon_high=0.05),
    )
    np.testing.assert_allclose(loss, -1.05, rtol=1e-6)
    assert float(m["clip_frac_high"]) == 1.0
    np.testing.assert_allclose(m["ratio_mean"], np.exp(0.1), rtol=1e-6)


@pytest.mark.slow
def test_fully_masked_rows_give_no_nan():
    logps, old, ref, adv, mask = random_batch(seed=5)
    mask[2] = 0
    logps[2] = 50.0  # Garbage on padding must not leak.
    args = [jnp.asarray(a, jnp.float32) for a in (logps, old, adv, mask)]
    for reduction in REDUCTIONS:
        f = lambda lp: grpo_loss(
            lp,
            *args[1:],
            GRPOConfig(beta=0.1, reduction=reduction),
            ref_logps_NxT=jnp.asarray(ref, jnp.float32),
        )
        (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(args[0])
        assert np.isfinite(loss) and np.all(np.isfinite(g))
        assert all(np.isfinite(v) for v in metrics.values())
    z = jnp.zeros((2, 3))
    loss, metrics = grpo_loss(z, z, jnp.ones(2), z)
    assert float(loss) == 0.0 and all(np.isfinite(v) for v in metrics.values())


def test_an_empty_batch_reports_ratio_one_and_no_loss():
    # No real token: ratio_min and ratio_max report no movement (1.0), not +-inf or a fill.
    z = jnp.zeros((2, 3))
    rho_off = jnp.full((2, 3), 0.7)  # log-ratios on padding must not show
    loss, m = grpo_loss(rho_off, z, jnp.ones(2), z)
    assert float(loss) == 0.0
    assert float(m["ratio_min"]) == 1.0 and float(m["ratio_max"]) == 1.0
    assert float(m["clip_frac_low"]) == 0.0 and float(m["clip_frac_high"]) == 0.0


def test_beta_needs_reference_and_names_are_checked():
    z = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="beta > 0 needs ref_logps_NxT"):
        grpo_loss(z, z, jnp.ones(2), z + 1, GRPOConfig(beta=0.1))
    with pytest.raises(ConfigError, match="'grpo.reduction' = 'mean' is not one of"):
        GRPOConfig(reduction="mean")
    with pytest.raises(ConfigError, match="'grpo.kl_estimator' = 'k4' is not one of"):
        GRPOConfig(kl_estimator="k4")


def test_the_loss_takes_the_runs_grpo_config_as_a_static_argument():
    """grpo_loss reads every objective setting of the run's GRPOConfig (one config, each
    default stated once); the config is hashable, so jit takes it as a static argument and
    compiles once per config."""
    grpo = GRPOConfig(
        G=4,
        beta=0.04,
        epsilon_low=0.1,
        epsilon_high=0.28,
        kl_estimator="k2",
        reduction="token_mean",
        temperature=0.7,
        policy_loss="cispo",
        dual_clip_c=3.0,
        sapo_tau_pos=0.9,
        sapo_tau_neg=1.2,
        cov_frac=0.01,
        cov_lb=0.5,
        cov_ub=4.0,
        kl_cov_coef=0.3,
        behavior_correction="tis",
        behavior_level="sequence",
        behavior_cap=3.0,
    )
    assert grpo == dataclasses.replace(grpo)
    assert hash(grpo) == hash(dataclasses.replace(grpo))
    with pytest.raises(dataclasses.FrozenInstanceError):
        grpo.beta = 0.0  # type: ignore[misc]
    logps, old, ref, adv, mask = (jnp.asarray(a, jnp.float32) for a in random_batch(seed=2))
    jitted = jax.jit(losses.grpo_loss, static_argnames="objective")
    got, _ = jitted(logps, old, adv, mask, objective=grpo, ref_logps_NxT=ref)
    want, _ = grpo_loss(logps, old, adv, mask, grpo, ref_logps_NxT=ref)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Each setting the loss reads moves the loss: none is left at a default of its own.
    for name, other in [
        ("beta", 0.3),
        ("epsilon_low", 0.01),
        ("epsilon_high", 0.01),
        ("kl_estimator", "k3"),
        ("reduction", "grpo"),
        ("policy_loss", "clip"),
    ]:
        moved, _ = grpo_loss(
            logps, old, adv, mask, dataclasses.replace(grpo, **{name: other}), ref_logps_NxT=ref
        )
        assert float(moved) != float(want), name


def _loss_fn(logps, old, adv, mask, ref):
    return grpo_loss(logps, old, adv, mask, GRPOConfig(beta=0.04), ref_logps_NxT=ref)


@pytest.mark.slow
def test_jit_and_sharded_match_single_device():
    logps, old, ref, adv, mask = random_batch(seed=6, n=16, t=7)
    args = [jnp.asarray(a, jnp.float32) for a in (logps, old, adv, mask, ref)]
    eager_loss, eager_m = _loss_fn(*args)
    jit_loss, jit_m = jax.jit(_loss_fn)(*args)
    np.testing.assert_allclose(jit_loss, eager_loss, rtol=1e-6)

    assert len(jax.devices()) == 8
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2})
    rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
    rows2 = sharding.batch_sharding(mesh, 2)
    in_sh = (rows2, rows2, rows, rows2, rows2)
    placed = [jax.device_put(a, s) for a, s in zip(args, in_sh)]
    sharded = jax.jit(
        jax.value_and_grad(lambda lp, *r: _loss_fn(lp, *r)[0]),
        in_shardings=in_sh,
        out_shardings=(sharding.replicated(mesh), rows2),
    )
    loss, grad = sharded(*placed)
    assert len(placed[0].sharding.device_set) == 8
    want_loss, want_grad = jax.value_and_grad(lambda lp, *r: _loss_fn(lp, *r)[0])(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-9)
    for k in eager_m:
        np.testing.assert_allclose(jit_m[k], eager_m[k], rtol=1e-6)
