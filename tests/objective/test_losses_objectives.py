"""Policy-gradient objectives beside the clipped surrogate: golden values, gradients, sharding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_config import apply_overrides
from helpers_jit import central_differences
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.core import sharding
from grpo_jax.objective import advantages, losses, policy_terms
from grpo_jax.run.config import ConfigError, GRPOConfig


def tiny():
    """Two rows, T = 2, eps = 0.2 on both sides.

    Row 0: A = +1, pi = (0.3, 0.2), ratios (1.1, 0.5), both tokens real.
    Row 1: A = -1, pi = (0.4, -), ratio 2 on its one real token.
    """
    logps = np.log([[0.3, 0.2], [0.4, 0.5]])
    old = logps - np.log([[1.1, 0.5], [2.0, 1.0]])
    adv = np.array([1.0, -1.0])
    mask = np.array([[1.0, 1.0], [1.0, 0.0]])
    return [jnp.asarray(x, jnp.float32) for x in (logps, old, adv, mask)]


def loss_and_grad(policy_loss, **kw):
    logps, old, adv, mask = tiny()
    objective = GRPOConfig(policy_loss=policy_loss, **kw)
    f = lambda lp: losses.grpo_loss(lp, old, adv, mask, objective)[0]
    loss, grad = jax.value_and_grad(f)(logps)
    return float(loss), np.asarray(grad)


@pytest.mark.slow  # The first compilation of the loss.
def test_clip_golden_and_dual_clip_binds():
    # Row 0: min(1.1, 1.1) = 1.1 and min(0.5, 0.8) = 0.5, mean 0.8.
    # Row 1: min(-2, -1.2) = -2. Loss = -(0.8 - 2) / 2 = 0.6.
    loss, grad = loss_and_grad("clip")
    np.testing.assert_allclose(loss, 0.6, rtol=1e-6)
    # d/dlogp of rho A is rho A, times -1/(|o_i| N): -1.1/4, -0.5/4, +2/2.
    np.testing.assert_allclose(grad, [[-0.275, -0.125], [1.0, 0.0]], rtol=1e-6)
    # Dual clip c = 1.5: row 1 becomes max(-2, 1.5 * -1) = -1.5, flat in rho.
    loss, grad = loss_and_grad("clip", dual_clip_c=1.5)
    np.testing.assert_allclose(loss, -(0.8 - 1.5) / 2, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.275, -0.125], [0.0, 0.0]], rtol=1e-6)
    # c = 3 does not bind (-2 > -3): the plain clip.
    np.testing.assert_allclose(loss_and_grad("clip", dual_clip_c=3.0)[0], 0.6, rtol=1e-6)


def test_cispo_golden():
    # sg(clip(rho)) A log pi: row 0 (1.1 ln 0.3 + 0.8 ln 0.2) / 2, row 1 -1.2 ln 0.4.
    loss, grad = loss_and_grad("cispo")
    row0 = (1.1 * math.log(0.3) + 0.8 * math.log(0.2)) / 2
    np.testing.assert_allclose(loss, -(row0 - 1.2 * math.log(0.4)) / 2, rtol=1e-6)
    # Gradient clip(rho) A / (|o_i| N) on every token, the clipped ones too (rows 0/1, t 0).
    np.testing.assert_allclose(grad, [[-1.1 / 4, -0.8 / 4], [1.2 / 2, 0.0]], rtol=1e-6)


def test_sapo_golden():
    s = lambda x: 1 / (1 + math.exp(-x))
    # tau = 1 for row 0: 4 s(0.1) and 4 s(-0.5); tau = 1.05 for row 1: -4 s(1.05) / 1.05.
    loss, grad = loss_and_grad("sapo")
    row0 = (4 * s(0.1) + 4 * s(-0.5)) / 2
    row1 = -4 * s(1.05 * 1.0) / 1.05
    np.testing.assert_allclose(loss, -(row0 + row1) / 2, rtol=1e-6)
    # d/dlogp f(rho) A = 4 s (1 - s) rho A.
    g = lambda tau, rho, a: 4 * s(tau * (rho - 1)) * (1 - s(tau * (rho - 1))) * rho * a
    want = [[-g(1, 1.1, 1) / 4, -g(1, 0.5, 1) / 4], [-g(1.05, 2.0, -1) / 2, 0.0]]
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    # f'(1) = 1: on-policy, SAPO's gradient is the clipped surrogate's.
    logps, _, adv, mask = tiny()
    for pl in ("sapo", "clip"):
        gr = jax.grad(
            lambda lp: losses.grpo_loss(lp, logps, adv, mask, GRPOConfig(policy_loss=pl))[0]
        )(logps)
        if pl == "sapo":
            g_sapo = gr
    np.testing.assert_allclose(g_sapo, gr, rtol=1e-6)


def test_gmpo_kl_is_each_rows_token_mean_and_an_empty_row_adds_none():
    """A sequence-level objective's KL term: per row, the mean over its real tokens (not their
    sum); a row without any adds 0 (not 0/0). At beta 0.1 the loss rises by beta times the
    mean over rows of those row means."""
    logps = jnp.asarray([[-1.0, -2.0, -0.5, -3.0], [-0.7, -1.0, -1.0, -1.0], [-2.0] * 4])
    ref = logps + jnp.asarray([[0.3, -0.2, 0.5, 9.0], [0.4, 9.0, 9.0, 9.0], [9.0] * 4])
    mask = jnp.asarray([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    adv = jnp.asarray([1.0, -0.5, 0.25])

    @jax.jit
    def both(logps, ref):
        f = lambda beta: losses.grpo_loss(
            logps,
            logps,
            adv,
            mask,
            GRPOConfig(beta=beta, policy_loss="gmpo"),
            ref_logps_NxT=ref,
        )[0]
        return f(0.0), f(0.1)

    plain, with_kl = both(logps, ref)
    d = np.asarray(ref - logps, np.float64)
    k3 = np.exp(d) - d - 1.0  # per token
    row_means = [k3[0, :3].mean(), k3[1, 0], 0.0]
    assert np.isfinite(float(with_kl))
    np.testing.assert_allclose(float(with_kl) - float(plain), 0.1 * np.mean(row_means), rtol=1e-5)


def test_gmpo_golden():
    # eps 0.4 in log space. Row 0 (A > 0): min(ln 1.1, 0.4) = ln 1.1, min(-ln 2, -0.4) = -ln 2:
    # exp((ln 1.1 - ln 2) / 2) = sqrt(0.55). Row 1 (A < 0): max(ln 2, 0.4) = ln 2, so -2.
    loss, grad = loss_and_grad("gmpo", epsilon_low=0.4, epsilon_high=0.4)
    np.testing.assert_allclose(loss, -(math.sqrt(0.55) - 2) / 2, rtol=1e-6)
    # d/dlogp_t of A exp(mean l) is A exp(mean l) / |o_i| where l_t is unclipped.
    r0 = math.sqrt(0.55)
    np.testing.assert_allclose(grad, [[-r0 / 4, -r0 / 4], [2 / 2, 0.0]], rtol=1e-6)
    # Tighter clip: row 0 token 0 is clipped at 0.05 (ln 1.1 = 0.0953) and loses its gradient.
    loss, grad = loss_and_grad("gmpo", epsilon_low=0.05, epsilon_high=0.05)
    r0 = math.exp((0.05 - math.log(2)) / 2)
    np.testing.assert_allclose(loss, -(r0 - 2) / 2, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, -r0 / 4], [1.0, 0.0]], rtol=1e-6)


def test_cov_by_hand_picks_the_top_token():
    # m = mean log pi = ln(0.3 * 0.2 * 0.4) / 3 = -1.2432; mean A = 1/3.
    # cov = (ln 0.3 - m)(2/3), (ln 0.2 - m)(2/3), (ln 0.4 - m)(-4/3) = 0.0261, -0.2441, -0.4359.
    logps, _, adv, mask = tiny()
    cov = np.asarray(policy_terms._cov_NxT(logps, adv[:, None], mask))
    m = math.log(0.3 * 0.2 * 0.4) / 3
    want = [(math.log(0.3) - m) * 2 / 3, (math.log(0.2) - m) * 2 / 3, (math.log(0.4) - m) * -4 / 3]
    np.testing.assert_allclose(cov[mask > 0], want, rtol=1e-5)
    assert cov[1, 1] == 0.0


def test_clip_cov_golden():
    # cov_frac 0.34 of 3 tokens: floor(1.02) = 1 token, the in-band one of highest cov,
    # token (0, 0). Its value stays (loss 0.6 as "clip"), its gradient is detached.
    loss, grad = loss_and_grad("clip_cov", cov_frac=0.34, cov_lb=0.0, cov_ub=1.0)
    np.testing.assert_allclose(loss, 0.6, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, -0.125], [1.0, 0.0]], rtol=1e-6)
    # Band [0.1, 1] holds no token: nothing picked, the plain clip.
    _, grad = loss_and_grad("clip_cov", cov_frac=0.34, cov_lb=0.1, cov_ub=1.0)
    np.testing.assert_allclose(grad, [[-0.275, -0.125], [1.0, 0.0]], rtol=1e-6)
    # A token the ratio clip binds is no candidate: with eps_high 0.05, token (0, 0)
    # (rho 1.1, A > 0) is clipped, so the pick moves to the next in band [-1, 1],
    # token (0, 1) (cov -0.244), and both of row 0's gradients are 0.
    loss, grad = loss_and_grad(
        "clip_cov", cov_frac=0.34, cov_lb=-1.0, cov_ub=1.0, epsilon_high=0.05
    )
    np.testing.assert_allclose(loss, -((1.05 + 0.5) / 2 - 2) / 2, rtol=1e-6)
    np.testing.assert_allclose(grad, [[0.0, 0.0], [1.0, 0.0]], rtol=1e-6)
    # Any cov_frac > 0 picks at least one token (the default 2e-4 of 3 tokens too).
    _, grad = loss_and_grad("clip_cov", cov_frac=2e-4, cov_lb=0.0, cov_ub=1.0)
    np.testing.assert_allclose(grad, [[0.0, -0.125], [1.0, 0.0]], rtol=1e-6)


def test_kl_cov_golden():
    # Token (0, 0) picked: 1.1 - 0.5 |ln 1.1|; others rho A unclipped (row 1: -2).
    loss, grad = loss_and_grad("kl_cov", cov_frac=0.34, kl_cov_coef=0.5)
    row0 = (1.1 - 0.5 * math.log(1.1) + 0.5) / 2
    np.testing.assert_allclose(loss, -(row0 - 2) / 2, rtol=1e-6)
    # d/dlogp (rho A - k |log rho|) = rho A - k sign(log rho) = 1.1 - 0.5.
    np.testing.assert_allclose(grad, [[-(1.1 - 0.5) / 4, -0.125], [1.0, 0.0]], rtol=1e-6)
    # floor(0.3 * 3) = 0, but any cov_frac > 0 picks at least one token ...
    loss_small, _ = loss_and_grad("kl_cov", cov_frac=0.3, kl_cov_coef=0.5)
    np.testing.assert_allclose(loss_small, loss, rtol=1e-6)
    # ... and cov_frac 0 none: no token penalised, no clip.
    loss, _ = loss_and_grad("kl_cov", cov_frac=0.0)
    np.testing.assert_allclose(loss, -((1.1 + 0.5) / 2 - 2) / 2, rtol=1e-6)


def test_kl_cov_penalty_has_no_gradient_where_the_policy_has_not_moved():
    # logp = old, A = (+1, -1), token mean over 3 tokens; cov picks token (1, 0) (cov 1.11).
    # |log rho| is minimal at log rho = 0: its gradient there is 0 (sign(0)), so the picked
    # token's gradient is -rho A / 3 = 1/3, not (1 + k) / 3.
    logps = jnp.array([[-0.5, -1.0], [-2.0, 0.0]])
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    adv = jnp.array([1.0, -1.0])
    kw = dict(policy_loss="kl_cov", cov_frac=0.34, kl_cov_coef=1.0, reduction="token_mean")
    f = lambda lp: losses.grpo_loss(lp, logps, adv, mask, GRPOConfig(**kw))[0]
    loss, grad = jax.value_and_grad(f)(logps)
    np.testing.assert_allclose(loss, -1 / 3, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-1 / 3, -1 / 3], [1 / 3, 0.0]], rtol=1e-6)


ON_POLICY_CASES = [
    (policy_loss, reduction)
    for policy_loss in losses.POLICY_LOSSES
    for reduction in (("grpo", "gspo") if policy_loss == "clip" else ("grpo",))
]


@pytest.mark.parametrize("eps", [0.2, 0.0])
@pytest.mark.parametrize("policy_loss, reduction", ON_POLICY_CASES)
def test_on_policy_gradient_is_the_policy_gradient(policy_loss, reduction, eps):
    # At rho = 1 every objective's gradient is that of A log pi_theta, -A_i / (|o_i| N) per
    # real token, even where rho = 1 sits on a kink: the clip's edge at eps = 0, or KL-Cov's
    # |log rho| (picked tokens, cov_frac 0.34). Clip-Cov's picks detach by design (frac 0).
    logps, _, adv, mask = tiny()
    kw = dict(epsilon_low=eps, epsilon_high=eps, cov_frac=0.0)
    if policy_loss == "kl_cov":
        kw = dict(cov_frac=0.34, kl_cov_coef=1.0)
    f = lambda lp: losses.grpo_loss(
        lp,
        logps,
        adv,
        mask,
        GRPOConfig(policy_loss=policy_loss, reduction=reduction, **kw),
    )[0]
    grad = jax.grad(f)(logps)
    want = -adv[:, None] * mask / mask.sum(1, keepdims=True) / 2
    np.testing.assert_allclose(grad, want, rtol=1e-6)


def random_batch(seed=0, n=6, t=5):
    rng = np.random.default_rng(seed)
    logps = rng.normal(-1.5, 0.5, (n, t))
    old = logps + rng.normal(0, 0.3, (n, t))
    ref = logps + rng.normal(0, 0.3, (n, t))
    adv = rng.normal(size=n)
    lengths = rng.integers(1, t + 1, n)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    return logps, old, ref, adv, mask


CASES = [
    ("clip", "grpo", dict(dual_clip_c=1.1)),
    ("clip", "gspo", dict(dual_clip_c=1.1)),
    ("cispo", "grpo", {}),
    ("cispo", "token_mean", {}),
    ("sapo", "grpo", {}),
    ("sapo", "dr_grpo", {}),
    ("gmpo", "grpo", {}),
    ("clip_cov", "grpo", dict(cov_frac=0.3, cov_lb=-10.0, cov_ub=10.0)),
    ("kl_cov", "token_mean", dict(cov_frac=0.3)),
]


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss, reduction, kw", CASES)
def test_gradient_matches_finite_differences(policy_loss, reduction, kw):
    logps, old, ref, adv, mask = random_batch()
    with jax.enable_x64(True):
        x = jnp.asarray(logps)
        # CISPO's weight sg(clip(rho)) is no function of log pi to differentiate: its
        # gradient is that of the loss with the ratio held at its value at x, which
        # moving pi_old along with pi_theta does.
        shift = (lambda lp: lp - x) if policy_loss == "cispo" else (lambda lp: 0.0)
        loss_at = lambda lp, o: losses.grpo_loss(
            lp,
            o,
            jnp.asarray(adv),
            jnp.asarray(mask),
            GRPOConfig(
                beta=0.1,
                epsilon_low=0.2,
                epsilon_high=0.28,
                reduction=reduction,
                policy_loss=policy_loss,
                **kw,
            ),
            ref_logps_NxT=jnp.asarray(ref),
        )[0]
        grad = np.asarray(jax.jit(jax.grad(lambda lp: loss_at(lp, jnp.asarray(old))))(x))
        f = jax.jit(lambda lp: loss_at(lp, jnp.asarray(old) + shift(lp)))
        if policy_loss == "clip_cov":
            # The picked tokens keep their value but no gradient: elsewhere the
            # gradient is the plain clip's.
            cov = policy_terms._cov_NxT(x, jnp.asarray(adv)[:, None], jnp.asarray(mask))
            # Candidates: in band, and not clipped by the ratio clip (eps 0.2 / 0.28).
            rho, a = np.exp(logps - old), adv[:, None]
            binds = np.where(a > 0, rho > 1.28, rho < 0.8)
            assert binds[mask > 0].any()  # the exclusion is exercised
            band = (
                (jnp.asarray(mask) > 0)
                & ~jnp.asarray(binds)
                & (cov >= kw["cov_lb"])
                & (cov <= kw["cov_ub"])
            )
            picked = np.asarray(
                policy_terms._top_by_rank(cov, band, jnp.asarray(mask), kw["cov_frac"])
            )
            assert picked.sum() == min(int(0.3 * mask.sum()), int(np.asarray(band).sum()))
            f_clip = jax.jit(
                lambda lp: losses.grpo_loss(
                    lp,
                    jnp.asarray(old),
                    jnp.asarray(adv),
                    jnp.asarray(mask),
                    GRPOConfig(beta=0.1, epsilon_low=0.2, epsilon_high=0.28),
                    ref_logps_NxT=jnp.asarray(ref),
                )[0]
            )
            kl_only = jax.grad(
                lambda lp: losses.grpo_loss(
                    lp,
                    lp,
                    jnp.zeros_like(jnp.asarray(adv)),
                    jnp.asarray(mask),
                    GRPOConfig(beta=0.1),
                    ref_logps_NxT=jnp.asarray(ref),
                )[0]
            )(x)
            picked_pg = np.where(picked, np.asarray(kl_only), 0.0)
            f = f_clip
        fd = central_differences(f, x)
    if policy_loss == "clip_cov":
        # On a picked token only the KL term's gradient is left.
        fd = np.where(picked, picked_pg, fd)
    np.testing.assert_allclose(grad, fd, atol=1e-6)
    assert np.all(grad[mask == 0] == 0), "padding must get no gradient"


def test_names_and_combinations_are_checked():
    logps, old, adv, mask = tiny()
    with pytest.raises(ValueError, match="policy_loss"):
        losses.grpo_loss(logps, old, adv, mask, GRPOConfig(policy_loss="ppo"))
    with pytest.raises(ValueError, match="gspo"):
        losses.grpo_loss(logps, old, adv, mask, GRPOConfig(policy_loss="cispo", reduction="gspo"))
    with pytest.raises(ValueError, match="gmpo"):
        losses.grpo_loss(
            logps,
            old,
            adv,
            mask,
            GRPOConfig(policy_loss="gmpo", reduction="token_mean"),
        )


def test_config_keys_are_validated():
    assert GRPOConfig().policy_loss == "clip" and GRPOConfig().dual_clip_c is None
    assert GRPOConfig.from_mapping({"policy_loss": "cispo"}).policy_loss == "cispo"
    with pytest.raises(ConfigError, match=r"grpo\.policy_loss.*'cispo'"):
        GRPOConfig(policy_loss="cisp")
    with pytest.raises(ConfigError, match=r"grpo\.dual_clip_c"):
        GRPOConfig(dual_clip_c=1.0)
    with pytest.raises(ConfigError, match=r"grpo\.sapo_tau_neg"):
        GRPOConfig(sapo_tau_neg=0.0)
    with pytest.raises(ConfigError, match=r"grpo\.cov_frac"):
        GRPOConfig(cov_frac=1.5)
    with pytest.raises(ConfigError, match=r"grpo\.cov_ub"):
        GRPOConfig(cov_lb=2.0, cov_ub=1.0)
    with pytest.raises(ConfigError, match=r"grpo\.reduction='gspo'"):
        GRPOConfig(policy_loss="sapo", reduction="gspo")
    with pytest.raises(ConfigError, match=r"grpo\.reduction='grpo'"):
        GRPOConfig(policy_loss="gmpo", reduction="dr_grpo")


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss, reduction, kw", CASES)
def test_jit_and_sharded_match_single_device(policy_loss, reduction, kw):
    logps, old, ref, adv, mask = random_batch(seed=6, n=16, t=7)
    args = [jnp.asarray(a, jnp.float32) for a in (logps, old, adv, mask, ref)]

    def loss_fn(lp, o, a, m, r):
        return losses.grpo_loss(
            lp,
            o,
            a,
            m,
            GRPOConfig(beta=0.04, reduction=reduction, policy_loss=policy_loss, **kw),
            ref_logps_NxT=r,
        )[0]

    eager = jax.value_and_grad(loss_fn)(*args)
    jitted = jax.jit(jax.value_and_grad(loss_fn))(*args)
    np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-6)
    np.testing.assert_allclose(jitted[1], eager[1], rtol=1e-6, atol=1e-9)

    mesh = sharding.make_mesh({"data": 4, "fsdp": 2})
    rows = NamedSharding(mesh, P(sharding.BATCH_AXES))
    rows2 = sharding.batch_sharding(mesh, 2)
    in_sh = (rows2, rows2, rows, rows2, rows2)
    placed = [jax.device_put(a, s) for a, s in zip(args, in_sh)]
    sharded = jax.jit(
        jax.value_and_grad(loss_fn),
        in_shardings=in_sh,
        out_shardings=(sharding.replicated(mesh), rows2),
    )
    loss, grad = sharded(*placed)
    assert len(placed[0].sharding.device_set) == 8
    np.testing.assert_allclose(loss, eager[0], rtol=1e-6)
    np.testing.assert_allclose(grad, eager[1], rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------
# Advantage estimators.


def test_reinforce_pp_by_hand():
    # Batch [1, 0 | 1, 1 | 0, 0]: groups 2 and 3 are constant and get 0. The
    # first group: batch mean 1/2, batch population std 1/2: A = (1 - 1/2) / (1/2 + eps).
    r = jnp.asarray([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    a = np.asarray(advantages.compute_advantages(r, estimator="reinforce_pp", eps=0.0))
    np.testing.assert_array_equal(a, [[1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])
    # Batch [3, 1 | 2, 0]: mean 1.5, deviations 1.5, -0.5, 0.5, -1.5, variance (2.25 * 2 +
    # 0.25 * 2) / 4 = 1.25. No group baseline: A = (r - 1.5) / sqrt(1.25).
    r = jnp.asarray([[3.0, 1.0], [2.0, 0.0]])
    a = advantages.compute_advantages(r, estimator="reinforce_pp", eps=0.0)
    np.testing.assert_allclose(a, [[1.5, -0.5], [0.5, -1.5]] / np.sqrt(1.25), rtol=1e-6)


def test_reinforce_pp_baseline_by_hand():
    # Group means 2 and 1: centred [1, -1 | 1, -1]; their batch std is 1.
    r = jnp.asarray([[3.0, 1.0], [2.0, 0.0]])
    a = advantages.compute_advantages(r, estimator="reinforce_pp_baseline", eps=0.0)
    np.testing.assert_allclose(a, [[1.0, -1.0], [1.0, -1.0]], rtol=1e-6)
    # A constant group adds 0 to the std: centred [0.5, -0.5 | 0, 0], std sqrt(0.5/4).
    r = jnp.asarray([[1.0, 0.0], [1.0, 1.0]])
    a = advantages.compute_advantages(r, estimator="reinforce_pp_baseline", eps=0.0)
    np.testing.assert_allclose(a, [[0.5, -0.5], [0.0, 0.0]] / np.sqrt(0.125), rtol=1e-6)


def test_passk_by_hand():
    # n = 4, k = 2.
    # c = 1: R = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2, sigma = 1/2; A+ = (1/2)/(1/2) = 1,
    #   A- = (1/2 - C(2,1)/C(3,1)) / (1/2) = (1/2 - 2/3) * 2 = -1/3.
    # c = 2: R = 1 - C(2,2)/C(4,2) = 5/6, sigma = sqrt(5)/6; A+ = (1/6)/sigma = 1/sqrt(5),
    #   A- = (1/6 - C(1,1)/C(3,1)) / sigma = -(1/6) / sigma = -1/sqrt(5).
    # c = 3: every pair holds a correct sample, R = 1, sigma = 0: all 0. c = 0 and c = 4: 0.
    r = jnp.asarray(
        [[1.0, 0, 0, 0], [0, 1, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], jnp.float32
    )
    a = np.asarray(advantages.compute_advantages(r, estimator="passk", eps=0.0, passk_k=2))
    s5 = 1 / np.sqrt(5)
    want = [[1, -1 / 3, -1 / 3, -1 / 3], [-s5, s5, -s5, s5], [0] * 4, [0] * 4, [0] * 4]
    np.testing.assert_allclose(a, want, rtol=1e-6)
    assert np.all(a[2:] == 0.0)


def test_passk_with_k_1_is_grpo_and_refuses_non_binary_rewards():
    r = jnp.asarray(np.random.default_rng(0).integers(0, 2, (6, 8)), jnp.float32)
    r = r.at[0, 3].set(jnp.nan)
    np.testing.assert_allclose(
        advantages.compute_advantages(r, estimator="passk", passk_k=1),
        advantages.compute_advantages(r, estimator="grpo"),
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="binary rewards"):
        advantages.compute_advantages(jnp.asarray([[0.5, 1.0]]), estimator="passk")
    with pytest.raises(ConfigError, match=r"grpo\.passk_k"):
        GRPOConfig(G=4, passk_k=5)
    with pytest.raises(ConfigError, match=r"grpo\.advantage_estimator.*'passk'"):
        GRPOConfig(advantage_estimator="pass@k")


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline", "passk"])
def test_new_estimators_jit_and_sharded_equal_single_device(estimator):
    rewards = jnp.asarray(np.random.default_rng(1).integers(0, 2, (16, 4)), jnp.float32)
    f = lambda r: advantages.compute_advantages(r, estimator=estimator, passk_k=2)
    want = f(rewards)
    np.testing.assert_allclose(jax.jit(f)(rewards), want, rtol=1e-6)
    mesh = sharding.make_mesh({"data": 8})
    g = jax.jit(
        f,
        in_shardings=sharding.batch_sharding(mesh),
        out_shardings=sharding.batch_sharding(mesh),
    )
    placed = jax.device_put(rewards, sharding.batch_sharding(mesh))
    assert len(placed.sharding.device_set) == 8
    np.testing.assert_allclose(g(placed), want, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        {"grpo.policy_loss": "cispo"},
        {"grpo.policy_loss": "gmpo"},
        {"grpo.policy_loss": "clip", "grpo.dual_clip_c": 3.0},
        {"grpo.advantage_estimator": "passk", "grpo.passk_k": 2},
        # The behaviour correction end to end: top-k sampling (q != pi_old), truncated
        # sequence weights, pi_old rescored by the update's own path.
        {
            "sampling.top_k": 4,
            "grpo.behavior_correction": "tis",
            "grpo.behavior_level": "sequence",
            "grpo.old_logps": "recompute",
        },
    ],
)
def test_each_objective_trains_from_the_shipped_config(tmp_path, overrides):
    """The command-line route: a locked shipped config takes the keys, and a run trains."""
    import io
    import json
    import math

    from configs.default import get_config
    from grpo_jax.run.train import train

    c = get_config("smoke")
    c.lock()
    run = {
        "warm_start.enabled": False,
        "eval.every": 0,
        "eval.num_samples": 0,
        "train.steps": 2,
        "rewards": "exact_match(tag=None):1.0",  # binary, as passk needs
    }
    apply_overrides(c, {**run, **overrides})
    train(c, tmp_path, stream=io.StringIO())
    saved = json.loads((tmp_path / "config.json").read_text())
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        assert saved[section][key] == value
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    losses_ = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses_) == 2 and all(math.isfinite(x) for x in losses_)
    if "sampling.top_k" in overrides:
        # Top-4 sampling renormalises: every sampled token's q exceeds its pi_old
        # probability, so the logged gap is positive on every step.
        for r in rows[1:]:
            assert r["behavior/abs_log_diff_mean"] > 0.0
            assert 0.0 <= r["behavior/frac_capped"] <= 1.0
