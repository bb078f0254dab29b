"""grpo_jax's objectives and advantage estimators against verl 0.9.1's own code.

verl (``verl.trainer.ppo.core_algos``, ``verl.trainer.ppo.rollout_corr_helper``) runs here in
torch float64 on the same random batches that grpo_jax sees in float64: padded masks (and an
empty row where the aggregation cares), advantages of both signs, ratios spread enough to hit
every clip. Each test compares the loss value and its gradient with respect to the current
log-probs (``jax.grad`` against torch autograd) to 1e-12. verl's configuration is built
explicitly from its own dataclasses (``ActorConfig``, ``PolicyLossConfig``, ``AlgoConfig``).

Where verl's definition differs from grpo_jax's, the comment at the test says exactly how,
and either both sides are configured to agree, or grpo_jax's result is mapped onto verl's
by the stated constants, or the comparison is restricted to the cases where the two must
agree; a separate ``test_difference_*`` shows each difference, so that the comment is
checked. The differences found:

Aggregation (verl's ``agg_loss`` modes against grpo_jax's reductions):
  * "token-mean" is grpo_jax's "token_mean" exactly.
  * "seq-mean-token-mean" is grpo_jax's "grpo" except that (a) each row's token mean divides
    by |o_i| + 1e-8, and (b) the mean over rows leaves out rows with no token (grpo_jax
    counts them in N).
  * "seq-mean-token-sum-norm" is grpo_jax's "dr_grpo" except for (b).
  * "token-sum" and "seq-mean-token-sum" have no grpo_jax counterpart.

Policy terms:
  * vanilla: verl always applies dual clip (clip_ratio_c, default 3, must be > 1); grpo_jax
    only with ``dual_clip_c``. grpo_jax's ``epsilon_low/high = None`` (no clip on that side)
    is verl's clip_ratio_low/high = a huge value (None there falls back to clip_ratio).
  * vanilla, cispo, sapo: verl clamps the token log-ratio to [-20, 20] before exp(), so a
    token beyond that has no gradient; grpo_jax does not clamp.
  * sapo: verl aggregates with "seq-mean-token-mean" whatever loss_agg_mode says.
  * geo_mean (GMPO): 1e-8 in both of its per-row denominators; otherwise equal.
  * gspo: verl clamps the sequence log-ratio at +10 (above: no gradient); verl's
    "token-mean" aggregation weighs rows by their length (grpo_jax's "gspo" reduction is
    always the mean over rows).
  * clip_cov: verl zeroes the picked tokens' loss (value and gradient), grpo_jax keeps their
    value and detaches their gradient; verl's band is strict (lb < cov < ub), grpo_jax's
    inclusive; verl picks at random among the candidates, grpo_jax the highest cov. Both
    leave PPO-clipped tokens out of the candidates and pick max(1, floor(frac * n_valid))
    tokens (grpo_jax took this from the comparison: it had picked floor(frac * n_valid),
    which is 0 below 5000 tokens at the default fraction, and had let clipped tokens use up
    picks).
  * clip_cov and gspo have no dual clip in verl; grpo_jax applies ``dual_clip_c`` to both
    when it is set. They are compared with it off.
  * kl_cov: defaults differ (verl ppo_kl_coef 0.1, grpo_jax kl_cov_coef 1.0). Otherwise
    equal, including at least one pick and the gradient at log rho = 0 (0 from the penalty).

Advantage estimators:
  * grpo: verl divides by the sample std (Bessel, G - 1) + eps with eps = 1e-6; grpo_jax by
    the population std + eps. With eps = 0 the two differ by exactly sqrt((G-1)/G). A group
    of equal rewards: verl turns the mean's rounding error into advantages (divided by its
    std + 1e-6), grpo_jax gives exactly 0. A NaN (unscored) reward makes verl's whole group
    NaN; grpo_jax leaves it out and gives it 0. A group of one response: verl r / (1 + eps),
    grpo_jax (which needs G >= 2) 0 for a group with one finite reward.
  * dr_grpo (verl's norm_adv_by_std_in_grpo=False) and rloo: equal.
  * reinforce_plus_plus and reinforce_plus_plus_baseline: verl whitens over tokens
    (``masked_whiten``): each row weighs by its length, the variance has Bessel's correction
    over the token count M, 1e-8 sits inside the square root and in the mean's denominator,
    and the mean of the group-centred rewards is subtracted again. grpo_jax works per row
    with the population std + eps outside the root. verl's reinforce_plus_plus gives a
    group of equal rewards r - mean_batch; grpo_jax gives it 0.
  * passk: verl's grpo_passk is another estimator (only the best response of a group gets
    r_max - r_second_max, over the sample std + eps); grpo_jax's is Chen et al.'s closed form.
    They agree on no group with a signal.
  * batch_std has no verl counterpart.

GAE (``compute_gae_advantage_return``) and the value loss (``compute_value_loss``):
  * the returns are equal on the model's tokens, multi-turn gaps included (verl skips a token
    of mask 0 in the recursion as grpo_jax does). Off the mask verl leaves the carried
    advantage (and the return computed from it), grpo_jax 0; the loss never reads them.
  * verl always whitens the advantages, with the sample variance (Bessel, over the M tokens)
    and 1e-8 in the mean's denominator; grpo_jax whitens only with ``grpo.whiten_advantages``,
    with the population variance. Both put 1e-8 inside the square root; grpo_jax's whitened
    advantages times sqrt((M - 1)/M) are verl's up to those 1e-8 terms.
  * the clipped value loss and its gradient are equal (token mean); the clip fraction is, but
    for verl's 1e-8 in its denominator.

Behaviour correction: ``behavior_weights`` equals ``compute_rollout_correction_weights`` at
both levels (tis against a float threshold C, mis against IcePop's "1/C_C"), with the same
+-20 clamp (grpo_jax compares log w with log C, verl w with C: the same but at the edge).
Given the same weights, grpo_loss equals compute_policy_loss_vanilla with
rollout_is_weights. For GMPO verl takes a row's weight as the geometric mean of
w + 1e-10 over its tokens (with the 1e-8 of the length), grpo_jax the arithmetic mean of
weights it requires to be constant along the row (level "sequence"): with such weights
verl's row weight is (w + 1e-10)^(|o|/(|o| + 1e-8)), and a masked row (w = 0) keeps a
weight of about 1e-10 in verl, exactly 0 in grpo_jax.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.objective import advantages, gae, losses
from grpo_jax.objective.config import GRPOConfig

torch = AlgoConfig = verl_algos = compute_rollout_correction_weights = None
ActorConfig = PolicyLossConfig = None


@pytest.fixture(scope="module", autouse=True)
def _verl():
    """Imports verl when these tests run: it pulls in torch and ray (about 4 s), which every
    xdist worker would otherwise pay while collecting this file."""
    global torch, AlgoConfig, verl_algos, compute_rollout_correction_weights
    global ActorConfig, PolicyLossConfig
    import torch
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos as verl_algos
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.workers.config import ActorConfig, PolicyLossConfig


TOL = dict(rtol=1e-12, atol=1e-12)
# verl's additive constant in masked_mean, seq-mean-token-mean, geo_mean and masked_whiten.
VERL_EPS = 1e-8
EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0
SEEDS = (0, 1, 2)
# The test compiles some forty small programs: XLA's backend optimisation would take most of
# the file's time and buys nothing at these sizes.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(autouse=True)
def float64():
    with jax.enable_x64(True):
        yield


# ---------------------------------------------------------------------------
# Batches and the two sides.


def random_batch(seed, n_rows=8, t=16, spread=0.8, empty_row=False):
    """Random log-probs with a padded mask and advantages of alternating sign.

    Log-ratios ~ N(0, spread), so ratios leave [1 - 0.2, 1 + 0.28] and pass 3 (dual clip).
    Padding holds junk log-probs, which both sides must ignore.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=n_rows)
    lengths[0] = t
    if empty_row:
        lengths[-1] = 0
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    old = np.log(rng.uniform(0.02, 0.98, size=(n_rows, t)))
    logps = old + rng.normal(0.0, spread, size=(n_rows, t))
    logps = np.where(mask > 0, logps, rng.normal(-3.0, 2.0, size=(n_rows, t)))
    adv = np.abs(rng.normal(0.0, 1.0, size=n_rows)) + 0.1
    adv = adv * np.where(np.arange(n_rows) % 2 == 0, 1.0, -1.0)
    return logps, old, adv, mask


def assert_hits_clips(logps, old, adv, mask, dual_c=DUAL_C):
    """The batch has real tokens on each clipped side, so agreement there is tested."""
    rho = np.exp(logps - old)
    real = mask > 0
    pos, neg = adv[:, None] > 0, adv[:, None] < 0
    assert (real & pos & (rho > 1 + EPS_HIGH)).any()
    assert (real & pos & (rho < 1 - EPS_LOW)).any()
    assert (real & neg & (rho < 1 - EPS_LOW)).any()
    assert (real & neg & (rho > dual_c)).any()
    assert (real & (rho > 1 - EPS_LOW) & (rho < 1 + EPS_HIGH)).any()


def actor_config(**kw):
    """The smallest ActorConfig verl accepts, with the given clip/SAPO/policy-loss options."""
    policy_keys = {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"}
    policy = PolicyLossConfig(**{k: kw.pop(k) for k in list(kw) if k in policy_keys})
    kw.setdefault("clip_ratio_low", EPS_LOW)
    kw.setdefault("clip_ratio_high", EPS_HIGH)
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=policy,
        **kw,
    )


def verl_loss_grad(name, logps, old, adv, mask, config, agg="token-mean", weights=None):
    """verl's registered policy loss ``name``: (loss, d loss / d log_prob), float64."""
    fn = verl_algos.get_policy_loss_fn(name)
    log_prob = torch.tensor(logps, dtype=torch.float64, requires_grad=True)
    m = torch.tensor(mask, dtype=torch.float64)
    loss, _ = fn(
        old_log_prob=torch.tensor(old, dtype=torch.float64),
        log_prob=log_prob,
        advantages=torch.tensor(adv, dtype=torch.float64)[:, None] * m,
        response_mask=m,
        loss_agg_mode=agg,
        config=config,
        rollout_is_weights=None if weights is None else torch.tensor(weights, dtype=torch.float64),
    )
    loss.backward()
    assert loss.dtype == torch.float64
    return loss.item(), log_prob.grad.numpy()


@functools.cache
def _jit_loss_grad(kw_items):
    objective = GRPOConfig(**dict(kw_items))

    def loss(lp, old, adv, mask, weights):
        return losses.grpo_loss(lp, old, adv, mask, objective, behavior_weights_NxT=weights)[0]

    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)


def jax_loss_grad(logps, old, adv, mask, behavior_weights_NxT=None, **kw):
    """grpo_loss and its gradient with respect to the current log-probs, float64.

    Jitted per option set (one compilation is far cheaper than eager op-by-op dispatch).
    """
    args = [jnp.asarray(x) for x in (logps, old, adv, mask)]
    weights = None if behavior_weights_NxT is None else jnp.asarray(behavior_weights_NxT)
    value, grad = _jit_loss_grad(tuple(sorted(kw.items())))(*args, weights)
    assert value.dtype == jnp.float64 and grad.dtype == jnp.float64
    return float(value), np.asarray(grad)


def _row_losses(lp, old, adv, mask, kw):
    """grpo_loss of each row alone (N = 1): the row's own term L_i of the objective."""
    objective = GRPOConfig(**kw)
    one = lambda l, o, a, m: losses.grpo_loss(l[None], o[None], a[None], m[None], objective)[0]
    return jax.vmap(one)(lp, old, adv, mask)


def _gmpo_as_verl(rows, adv, c):
    """verl's geo_mean row term from grpo_jax's, -A c (L / -A)^c (see test_gmpo); 0 if empty."""
    real = c > 0
    base = jnp.where(real, rows / -adv, 1.0)
    return jnp.where(real, -adv * c * base**c, 0.0)


@functools.cache
def _jit_rows_loss_grad(kw_items, gmpo_as_verl):
    kw = dict(kw_items)

    def loss(lp, old, adv, mask, weights):
        rows = _row_losses(lp, old, adv, mask, kw)
        if gmpo_as_verl:
            n_tokens = mask.sum(1)
            rows = _gmpo_as_verl(rows, adv, n_tokens / (n_tokens + VERL_EPS))
        return (weights * rows).sum()

    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)


def rows_loss_grad(logps, old, adv, mask, weights_N, gmpo_as_verl=False, **kw):
    """sum_i w_i L_i over grpo_jax's row losses L_i, and its gradient in the log-probs."""
    args = [jnp.asarray(x) for x in (logps, old, adv, mask, weights_N)]
    value, grad = _jit_rows_loss_grad(tuple(sorted(kw.items())), gmpo_as_verl)(*args)
    assert value.dtype == jnp.float64
    return float(value), np.asarray(grad)


def jax_as_seq_mean_token_mean(logps, old, adv, mask, **kw):
    """verl's "seq-mean-token-mean" written with grpo_jax's per-row losses L_i.

    verl: (1/N') sum_i c_i L_i, c_i = |o_i| / (|o_i| + 1e-8), N' = rows with a token.
    (grpo_jax's "grpo" reduction is (1/N) sum_i L_i; asserted below, so the row losses are
    those of the batched loss.)
    """
    n_tokens = mask.sum(1)
    c = n_tokens / (n_tokens + VERL_EPS)
    n_nonempty = float((n_tokens > 0).sum())
    if kw.get("reduction", "grpo") == "grpo":
        mean_of_rows = rows_loss_grad(logps, old, adv, mask, np.full(len(adv), 1 / len(adv)), **kw)
        assert_same(jax_loss_grad(logps, old, adv, mask, **kw), mean_of_rows)
    return rows_loss_grad(logps, old, adv, mask, c / n_nonempty, **kw)


def assert_same(jax_vg, verl_vg):
    np.testing.assert_allclose(jax_vg[0], verl_vg[0], **TOL)
    np.testing.assert_allclose(jax_vg[1], verl_vg[1], **TOL)


# ---------------------------------------------------------------------------
# Vanilla PPO clip (verl "vanilla") against grpo_jax "clip".
#
# verl's vanilla loss always applies dual clip with clip_ratio_c (default 3.0, asserted
# > 1), so grpo_jax runs with dual_clip_c = clip_ratio_c. Both clamp nothing else except
# verl's log-ratio clamp at +-20 (test_difference_log_ratio_clamp); the random batches keep
# |log rho| well below 20.


@pytest.mark.parametrize("seed", SEEDS)
def test_vanilla_token_mean(seed):
    batch = random_batch(seed)
    assert_hits_clips(*batch)
    config = actor_config(clip_ratio_c=DUAL_C)
    want = verl_loss_grad("vanilla", *batch, config, agg="token-mean")
    got = jax_loss_grad(
        *batch,
        reduction="token_mean",
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        dual_clip_c=DUAL_C,
    )
    assert_same(got, want)


@pytest.mark.parametrize("seed", SEEDS)
def test_vanilla_seq_mean_token_mean_is_grpo_reduction(seed):
    # verl's "seq-mean-token-mean" against grpo_jax's "grpo" reduction, through the row
    # losses and verl's two constants (jax_as_seq_mean_token_mean); the batch has an empty row.
    batch = random_batch(seed, empty_row=True)
    assert_hits_clips(*batch)
    kw = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, dual_clip_c=DUAL_C)
    want = verl_loss_grad("vanilla", *batch, actor_config(), agg="seq-mean-token-mean")
    assert_same(jax_as_seq_mean_token_mean(*batch, reduction="grpo", **kw), want)


@pytest.mark.parametrize("seed", SEEDS)
def test_vanilla_seq_mean_token_sum_norm_is_dr_grpo(seed):
    # verl's "seq-mean-token-sum-norm" divides by N' (rows with a token) * T, grpo_jax's
    # "dr_grpo" by N * T: with one empty row verl = grpo_jax * N / (N - 1).
    batch = random_batch(seed, empty_row=True)
    n_rows = batch[3].shape[0]
    kw = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, dual_clip_c=DUAL_C)
    want = verl_loss_grad("vanilla", *batch, actor_config(), agg="seq-mean-token-sum-norm")
    value, grad = jax_loss_grad(*batch, reduction="dr_grpo", **kw)
    scale = n_rows / (n_rows - 1)
    assert_same((value * scale, grad * scale), want)


def test_difference_seq_mean_aggregation():
    # (a) A one-token row: verl divides its token sum by 1 + 1e-8.
    logps, old, adv, mask = (np.array([[x]]) for x in (-0.5, -0.7, 1.0, 1.0))
    adv = adv[0]
    config = actor_config()
    verl_value, _ = verl_loss_grad("vanilla", logps, old, adv, mask, config, "seq-mean-token-mean")
    kw = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, dual_clip_c=DUAL_C)
    jax_value, _ = jax_loss_grad(logps, old, adv, mask, reduction="grpo", **kw)
    np.testing.assert_allclose(jax_value, -np.exp(0.2), rtol=1e-15)
    np.testing.assert_allclose(verl_value, jax_value / (1 + VERL_EPS), rtol=1e-15)
    assert abs(verl_value / jax_value - 1) > 5e-9
    # (b) An empty row: verl's mean is over the rows with a token, grpo_jax's over all N.
    batch = random_batch(0, n_rows=4, empty_row=True)
    verl_value, _ = verl_loss_grad("vanilla", *batch, config, "seq-mean-token-sum-norm")
    jax_value, _ = jax_loss_grad(*batch, reduction="dr_grpo", **kw)
    np.testing.assert_allclose(verl_value, jax_value * 4 / 3, **TOL)
    assert abs(verl_value - jax_value) > 1e-3


def test_difference_dual_clip_always_on_in_verl():
    # grpo_jax without dual clip and without an upper clip is verl with clip_ratio_c and
    # clip_ratio_high huge (verl cannot switch either off); with verl's default c = 3 the two
    # differ exactly on the tokens with A < 0 and rho > 3.
    batch = random_batch(0)
    logps, old, adv, mask = batch
    off = jax_loss_grad(*batch, reduction="token_mean", epsilon_low=EPS_LOW, epsilon_high=None)
    huge = actor_config(clip_ratio_c=1e9, clip_ratio_high=1e9)
    assert_same(off, verl_loss_grad("vanilla", *batch, huge))
    default = verl_loss_grad("vanilla", *batch, actor_config(clip_ratio_high=1e9))
    bound = (mask > 0) & (adv[:, None] < 0) & (np.exp(logps - old) > DUAL_C)
    assert bound.any()
    np.testing.assert_array_equal(default[1][bound], 0.0)
    assert (off[1][bound] != 0).all()
    np.testing.assert_allclose(default[1][~bound], off[1][~bound], **TOL)


@pytest.mark.parametrize("name", ["vanilla", "cispo", "sapo"])
def test_difference_log_ratio_clamp(name):
    # verl clamps log(pi / pi_old) to [-20, 20] before exp() in vanilla, cispo and sapo: a
    # token beyond has a constant ratio (no gradient through it). grpo_jax does not clamp.
    # Row 0: A > 0, log rho = -25 (unclipped side of the PPO min: rho A, gradient rho A).
    # Row 1: A < 0, log rho = +25 (unclipped side without dual clip and upper clip).
    old = np.log(np.array([[0.5], [1e-12]]))
    logps = old + np.array([[-25.0], [25.0]])
    adv, mask = np.array([1.0, -1.0]), np.ones((2, 1))
    config = actor_config(clip_ratio_c=1e9, clip_ratio_high=1e9)
    verl_value, verl_grad = verl_loss_grad(name, logps, old, adv, mask, config)
    kw = dict(epsilon_high=None, policy_loss={"vanilla": "clip"}.get(name, name))
    jax_value, jax_grad = jax_loss_grad(logps, old, adv, mask, reduction="token_mean", **kw)
    if name == "vanilla":
        np.testing.assert_allclose(verl_value, (-np.exp(-20) + np.exp(20)) / 2, rtol=1e-12)
        np.testing.assert_allclose(jax_value, (-np.exp(-25) + np.exp(25)) / 2, rtol=1e-12)
        np.testing.assert_array_equal(verl_grad, 0.0)
        np.testing.assert_allclose(
            jax_grad[:, 0], np.array([-np.exp(-25), np.exp(25)]) / 2, rtol=1e-12
        )
    elif name == "cispo":
        # The gradient is clip(rho) A d log pi: clip(rho) = 0.8 in row 0 on both sides;
        # in row 1 (no upper clip) verl's clamped e^20 against e^25.
        np.testing.assert_allclose(verl_grad[:, 0], [-0.8 / 2, np.exp(20) / 2], rtol=1e-12)
        np.testing.assert_allclose(jax_grad[:, 0], [-0.8 / 2, np.exp(25) / 2], rtol=1e-12)
    else:
        # sapo: in row 0 grpo_jax's gate still has a (tiny) slope, verl's none; in row 1 the
        # gate is saturated on both sides.
        assert verl_grad[0, 0] == 0.0 and jax_grad[0, 0] < 0.0
        np.testing.assert_array_equal(verl_grad[1], jax_grad[1])


# ---------------------------------------------------------------------------
# CISPO: same definition (detached clipped IS weight times A log pi), same clip bounds.


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo(seed):
    batch = random_batch(seed, empty_row=True)
    assert_hits_clips(*batch)
    kw = dict(policy_loss="cispo", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)
    config = actor_config()
    want = verl_loss_grad("cispo", *batch, config, agg="token-mean")
    assert_same(jax_loss_grad(*batch, reduction="token_mean", **kw), want)
    want = verl_loss_grad("cispo", *batch, config, agg="seq-mean-token-mean")
    assert_same(jax_as_seq_mean_token_mean(*batch, reduction="grpo", **kw), want)


# ---------------------------------------------------------------------------
# SAPO: same gate and temperatures (tau_pos if A > 0 else tau_neg). verl always aggregates
# with "seq-mean-token-mean", whatever loss_agg_mode says.


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo(seed):
    batch = random_batch(seed, empty_row=True)
    config = actor_config(tau_pos=1.3, tau_neg=2.1)
    want = verl_loss_grad("sapo", *batch, config, agg="seq-mean-token-mean")
    kw = dict(policy_loss="sapo", sapo_tau_pos=1.3, sapo_tau_neg=2.1)
    assert_same(jax_as_seq_mean_token_mean(*batch, reduction="grpo", **kw), want)


def test_difference_sapo_ignores_loss_agg_mode():
    batch = random_batch(1)
    config = actor_config()
    token_mean = verl_loss_grad("sapo", *batch, config, agg="token-mean")
    seq_mean = verl_loss_grad("sapo", *batch, config, agg="seq-mean-token-mean")
    assert_same(token_mean, seq_mean)
    jax_token_mean, _ = jax_loss_grad(*batch, reduction="token_mean", policy_loss="sapo")
    assert abs(jax_token_mean - token_mean[0]) > 1e-3


# ---------------------------------------------------------------------------
# GMPO (verl "geo_mean"): the same sign-aware min on the log-ratio clipped to
# [-eps_low, eps_high], the same mean over all N rows. verl adds 1e-8 to |o_i| in both of
# its per-row divisions: with m_i = (1/|o_i|) sum_t l_t and c_i = |o_i| / (|o_i| + 1e-8),
# verl's row term is -A_i c_i exp(c_i m_i), grpo_jax's L_i = -A_i exp(m_i), so verl's is
# -A_i c_i (L_i / -A_i)^c_i, written below with grpo_jax's row losses.


@pytest.mark.parametrize("seed", SEEDS)
def test_gmpo(seed):
    logps, old, adv, mask = random_batch(seed, empty_row=True)
    assert_hits_clips(logps, old, adv, mask)
    config = actor_config(clip_ratio_low=0.4, clip_ratio_high=0.3)
    want = verl_loss_grad("geo_mean", logps, old, adv, mask, config)
    kw = dict(policy_loss="gmpo", reduction="grpo", epsilon_low=0.4, epsilon_high=0.3)
    mean_n = np.full(len(adv), 1 / len(adv))
    assert_same(rows_loss_grad(logps, old, adv, mask, mean_n, gmpo_as_verl=True, **kw), want)
    # Without the constants, grpo_jax's batched loss is its row losses' mean.
    batched = jax_loss_grad(logps, old, adv, mask, **kw)
    assert_same(batched, rows_loss_grad(logps, old, adv, mask, mean_n, **kw))


def test_difference_gmpo_constant():
    # One token, A = 1, log rho = 0.1 (inside the clip): grpo_jax -e^0.1, verl
    # -c e^(0.1 c) with c = 1 / (1 + 1e-8).
    logps, old, mask = np.array([[-1.0]]), np.array([[-1.1]]), np.ones((1, 1))
    adv = np.array([1.0])
    want, _ = verl_loss_grad("geo_mean", logps, old, adv, mask, actor_config(clip_ratio=0.4))
    got, _ = jax_loss_grad(logps, old, adv, mask, policy_loss="gmpo", epsilon_low=0.4)
    c = 1 / (1 + VERL_EPS)
    np.testing.assert_allclose(got, -np.exp(0.1), rtol=1e-14)
    np.testing.assert_allclose(want, -c * np.exp(0.1 * c), rtol=1e-14)
    assert abs(want - got) > 1e-9


# ---------------------------------------------------------------------------
# GSPO: verl's token-level ratio sg(s_i) pi / sg(pi) has s_i's value and the gradient
# s_i d log pi_t; with "seq-mean-token-mean" each row's term is the clipped sequence
# surrogate, as in grpo_jax's "gspo" reduction (mean over the rows with a token). verl
# clamps log s_i at +10 (test_difference_gspo); here |log s_i| stays small.


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo(seed):
    batch = random_batch(seed, n_rows=12, empty_row=True, spread=0.25)
    config = actor_config(clip_ratio_low=0.03, clip_ratio_high=0.04)
    want = verl_loss_grad("gspo", *batch, config, agg="seq-mean-token-mean")
    kw = dict(reduction="gspo", epsilon_low=0.03, epsilon_high=0.04)
    got = jax_as_seq_mean_token_mean(*batch, **kw)
    assert_same(got, want)
    # The rows are spread across both clips and the inside.
    logps, old, adv, mask = batch
    n = np.maximum(mask.sum(1), 1)
    s = np.exp(((logps - old) * mask).sum(1) / n)
    assert ((s > 1.04) & (adv > 0)).any() and ((s < 0.97) & (adv < 0)).any()
    assert ((s > 0.97) & (s < 1.04) & (mask.sum(1) > 0)).any()
    # grpo_jax's batched "gspo" loss divides by N' already: it equals the rows' sum / N'.
    n_nonempty = (mask.sum(1) > 0).sum()
    rows_mean = rows_loss_grad(*batch, np.full(len(adv), 1 / n_nonempty), **kw)
    assert_same(jax_loss_grad(*batch, **kw), rows_mean)


def test_difference_gspo():
    # (a) verl clamps the sequence log-ratio at +10: a row with A < 0 and log s = 11 is on
    # the unclipped side (-A s grows with s) and keeps its gradient in grpo_jax only.
    logps, old = np.array([[-1.0, -2.0]]), np.array([[-12.0, -13.0]])
    adv, mask = np.array([-1.0]), np.ones((1, 2))
    config = actor_config()
    verl_value, verl_grad = verl_loss_grad("gspo", logps, old, adv, mask, config, "token-mean")
    jax_value, jax_grad = jax_loss_grad(logps, old, adv, mask, reduction="gspo")
    np.testing.assert_allclose(verl_value, np.exp(10), rtol=1e-12)
    np.testing.assert_array_equal(verl_grad, 0.0)
    np.testing.assert_allclose(jax_value, np.exp(11), rtol=1e-12)
    np.testing.assert_allclose(jax_grad, np.full((1, 2), np.exp(11) / 2), rtol=1e-12)
    # (b) With verl's "token-mean" the rows weigh by their length: sum_i |o_i| L_i / M.
    batch = random_batch(2, spread=0.05)
    mask = batch[3]
    want = verl_loss_grad("gspo", *batch, config, agg="token-mean")
    assert_same(rows_loss_grad(*batch, mask.sum(1) / mask.sum(), reduction="gspo"), want)
    batched, _ = jax_loss_grad(*batch, reduction="gspo")
    assert abs(batched - want[0]) > 1e-4


# ---------------------------------------------------------------------------
# KL-Cov: the same covariance over the valid tokens (means without verl's 1e-8), the same
# top-k by covariance (torch.topk; no ties in random data), the same penalty
# -A rho + k |log rho| on the picked tokens and no ratio clip, the same k =
# max(1, floor(frac * M)) (test_cov_picks_at_least_one_token for frac * M < 1). Defaults
# differ (verl ppo_kl_coef 0.1, grpo_jax kl_cov_coef 1.0): set explicitly.


def test_difference_cov_defaults():
    # verl's and grpo_jax's defaults: the same fractions, a different KL-Cov coefficient.
    verl_defaults = PolicyLossConfig()
    jax_defaults = GRPOConfig()
    assert verl_defaults.clip_cov_ratio == jax_defaults.cov_frac == 2e-4
    assert verl_defaults.kl_cov_ratio == jax_defaults.cov_frac
    assert (verl_defaults.clip_cov_lb, verl_defaults.clip_cov_ub) == (1.0, 5.0)
    assert (jax_defaults.cov_lb, jax_defaults.cov_ub) == (1.0, 5.0)
    assert verl_defaults.ppo_kl_coef == 0.1 and jax_defaults.kl_cov_coef == 1.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("frac", [0.05, 0.3])
def test_kl_cov(seed, frac):
    batch = random_batch(seed, empty_row=True)
    n_valid = batch[3].sum()
    assert int(frac * n_valid) >= 1
    config = actor_config(kl_cov_ratio=frac, ppo_kl_coef=0.7)
    want = verl_loss_grad("kl_cov", *batch, config, agg="token-mean")
    kw = dict(policy_loss="kl_cov", cov_frac=frac, kl_cov_coef=0.7, reduction="token_mean")
    got = jax_loss_grad(*batch, **kw)
    assert_same(got, want)
    # The penalty binds: the result is not plain rho A.
    assert frac * n_valid % 1 > 0.05
    plain = jax_loss_grad(*batch, policy_loss="kl_cov", cov_frac=0.0, reduction="token_mean")
    assert abs(plain[0] - got[0]) > 1e-6


# On-policy (log rho = 0 on every token, as in a run's first minibatch) the objectives sit on
# their kinks: KL-Cov's |log rho| (torch's abs has derivative 0 there) and, with epsilon 0,
# the clip's edges (torch's clamp passes the gradient on its closed range, and its min/max
# split a tie evenly). Random batches never hit them; these compare the gradient there.


@pytest.mark.parametrize("seed", SEEDS)
def test_on_policy_kinks(seed):
    logps, _, adv, mask = random_batch(seed, empty_row=True)
    batch = (logps, logps.copy(), adv, mask)
    config = actor_config(kl_cov_ratio=0.3, ppo_kl_coef=0.7)
    want = verl_loss_grad("kl_cov", *batch, config, agg="token-mean")
    kw = dict(policy_loss="kl_cov", cov_frac=0.3, kl_cov_coef=0.7, reduction="token_mean")
    assert_same(jax_loss_grad(*batch, **kw), want)
    config = actor_config(clip_ratio_low=0.0, clip_ratio_high=0.0, clip_ratio_c=DUAL_C)
    want = verl_loss_grad("vanilla", *batch, config, agg="token-mean")
    kw = dict(epsilon_low=0.0, epsilon_high=0.0, dual_clip_c=DUAL_C, reduction="token_mean")
    assert_same(jax_loss_grad(*batch, **kw), want)
    want = verl_loss_grad("geo_mean", *batch, config)
    kw = dict(policy_loss="gmpo", reduction="grpo", epsilon_low=0.0, epsilon_high=0.0)
    mean_n = np.full(len(adv), 1 / len(adv))
    assert_same(rows_loss_grad(*batch, mean_n, gmpo_as_verl=True, **kw), want)


# ---------------------------------------------------------------------------
# Clip-Cov. verl and grpo_jax pick tokens by the same centred cross product, but:
#   1. verl zeroes a picked token's loss (value and gradient); grpo_jax keeps the value
#      and detaches the gradient. Gradients agree; verl's value is grpo_jax's plus
#      (sum of the clipped surrogate over the picked tokens) / M.
#   2. The band: verl lb < cov < ub, grpo_jax lb <= cov <= ub.
#   3. verl draws the picked tokens at random among the candidates (torch.randperm);
#      grpo_jax takes those of highest cov.
# Both leave tokens the PPO clip already binds out of the candidates and pick
# max(1, floor(frac * M)) tokens. With frac = 1 every candidate is picked on both sides
# (no draw), which leaves 1: it does not change the gradient, and the value is mapped by it.


def _cov(logps, adv, mask):
    real = mask > 0
    adv_nxt = np.broadcast_to(adv[:, None], mask.shape)
    return (adv_nxt - adv_nxt[real].mean()) * (logps - logps[real].mean())


@pytest.mark.parametrize("seed", SEEDS)
def test_clip_cov_every_candidate(seed):
    logps, old, adv, mask = batch = random_batch(seed, empty_row=True)
    lb, ub = 0.3, 2.0
    config = actor_config(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
    want = verl_loss_grad("clip_cov", *batch, config, agg="token-mean")
    kw = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, reduction="token_mean")
    got = jax_loss_grad(*batch, policy_loss="clip_cov", cov_frac=1.0, cov_lb=lb, cov_ub=ub, **kw)
    np.testing.assert_allclose(got[1], want[1], **TOL)
    # verl's picks: in-band real tokens the PPO clip does not bind.
    rho = np.exp(logps - old)
    clipped = np.where(adv[:, None] > 0, rho > 1 + EPS_HIGH, rho < 1 - EPS_LOW)
    cov = _cov(logps, adv, mask)
    band = (mask > 0) & (cov > lb) & (cov < ub)
    picked = band & ~clipped
    assert picked.sum() >= 2 and (band & clipped).any()
    # Their clipped-surrogate sum, from grpo_jax: "clip" over just those tokens.
    picked_loss, _ = jax_loss_grad(logps, old, adv, picked.astype(float), **kw)
    np.testing.assert_allclose(want[0], got[0] - picked_loss * picked.sum() / mask.sum(), **TOL)
    # The picks matter: without them the gradient differs exactly there.
    plain = jax_loss_grad(*batch, policy_loss="clip", **kw)
    np.testing.assert_array_equal(got[1][picked], 0.0)
    assert (plain[1][picked] != 0).all()
    np.testing.assert_allclose(plain[1][~picked], got[1][~picked], **TOL)


def _two_rows(logps, rho=((1.0, 1.0), (1.0, 1.0))):
    """Rows with A = +1 and -1 (so A - mean A = +-1) and the given log-probs and ratios."""
    logps = np.array(logps, dtype=np.float64)
    return logps, logps - np.log(np.array(rho)), np.array([1.0, -1.0]), np.ones((2, 2))


def _zero_grad_tokens(grad):
    return {tuple(int(i) for i in ix) for ix in np.argwhere(grad == 0.0)}


def _detached(grad, plain_grad):
    """Tokens whose gradient a pick removed: 0 here, not 0 under the plain clip."""
    return {tuple(int(i) for i in ix) for ix in np.argwhere((grad == 0.0) & (plain_grad != 0.0))}


def test_cov_picks_at_least_one_token():
    # Mean log-prob -1; cov = [[1.5, -0.5], [0.25, 0.75]]: one token in the band [1, 5],
    # (0, 0), where rho = 1.1 (inside the PPO clip). M = 4 and frac 2e-4: floor(8e-4) = 0,
    # and both pick max(1, 0) = 1 token.
    batch = _two_rows([[0.5, -1.5], [-1.25, -1.75]], rho=((1.1, 1.0), (1.0, 1.0)))
    np.testing.assert_array_equal(_cov(batch[0], batch[2], batch[3]), [[1.5, -0.5], [0.25, 0.75]])
    config = actor_config(clip_cov_ratio=2e-4, kl_cov_ratio=2e-4, ppo_kl_coef=1.0)
    _, verl_grad = verl_loss_grad("clip_cov", *batch, config)
    _, jax_grad = jax_loss_grad(*batch, policy_loss="clip_cov", reduction="token_mean")
    assert _zero_grad_tokens(verl_grad) == _zero_grad_tokens(jax_grad) == {(0, 0)}
    np.testing.assert_allclose(jax_grad, verl_grad, **TOL)
    # KL-Cov: both penalise the top token, (0, 0): its gradient is (-rho A + k) / M with
    # k = 1, not -rho A / M.
    _, verl_grad = verl_loss_grad("kl_cov", *batch, config)
    _, jax_grad = jax_loss_grad(*batch, policy_loss="kl_cov", reduction="token_mean")
    plain = np.array([[-1.1, -1.0], [1.0, 1.0]]) / 4
    np.testing.assert_allclose(verl_grad, plain + [[1 / 4, 0], [0, 0]], **TOL)
    np.testing.assert_allclose(jax_grad, verl_grad, **TOL)


def test_difference_clip_cov_band_edges():
    # Mean "log-prob" 0 (so that verl's 1e-8 in its mean's denominator changes nothing):
    # cov = 1.0 exactly on two tokens, the lower edge of the band. frac = 1 picks every
    # candidate; grpo_jax's band includes the edge, verl's does not.
    batch = _two_rows([[1.0, 0.0], [-1.0, 0.0]])
    np.testing.assert_array_equal(_cov(batch[0], batch[2], batch[3]), [[1.0, 0.0], [1.0, 0.0]])
    config = actor_config(clip_cov_ratio=1.0)
    _, verl_grad = verl_loss_grad("clip_cov", *batch, config)
    _, jax_grad = jax_loss_grad(
        *batch, policy_loss="clip_cov", cov_frac=1.0, reduction="token_mean"
    )
    assert _zero_grad_tokens(jax_grad) == {(0, 0), (1, 0)}
    assert _zero_grad_tokens(verl_grad) == set()


def test_clip_cov_skips_ppo_clipped_tokens():
    # cov = [[2, 0], [1.5, 0.5]] (mean log-prob -1). Token (0, 0) has the highest cov but
    # A = +1 and rho = e^0.5 > 1.28: PPO's clip binds (its gradient is 0 anyway). With k = 1
    # (frac 0.25 of M = 4) both pick the next candidate, (1, 0).
    batch = _two_rows([[1.0, -1.0], [-2.5, -1.5]], rho=((np.exp(0.5), 1.0), (1.0, 1.0)))
    np.testing.assert_array_equal(_cov(batch[0], batch[2], batch[3]), [[2.0, 0.0], [1.5, 0.5]])
    config = actor_config(clip_cov_ratio=0.25)
    _, verl_grad = verl_loss_grad("clip_cov", *batch, config)
    kw = dict(policy_loss="clip_cov", cov_frac=0.25, reduction="token_mean")
    _, jax_grad = jax_loss_grad(*batch, epsilon_high=EPS_HIGH, **kw)
    assert _zero_grad_tokens(jax_grad) == _zero_grad_tokens(verl_grad) == {(0, 0), (1, 0)}
    np.testing.assert_allclose(jax_grad, verl_grad, **TOL)


def test_difference_clip_cov_random_draw():
    # More candidates than picks: verl's choice follows torch's random state, grpo_jax's is
    # the highest cov.
    logps, old, adv, mask = batch = random_batch(3, spread=0.05)
    lb, ub = 0.2, 5.0
    cov = _cov(logps, adv, mask)
    band = (mask > 0) & (cov > lb) & (cov < ub)
    assert band.sum() >= 6
    frac = 1.5 / mask.sum()  # one pick
    config = actor_config(clip_cov_ratio=frac, clip_cov_lb=lb, clip_cov_ub=ub)
    kw = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, reduction="token_mean")
    _, plain = jax_loss_grad(*batch, policy_loss="clip", **kw)
    drawn = set()
    for seed in range(8):
        torch.manual_seed(seed)
        _, verl_grad = verl_loss_grad("clip_cov", *batch, config)
        drawn.add(frozenset(_detached(verl_grad, plain)))
    assert len(drawn) > 1 and all(len(d) == 1 for d in drawn)
    kw.update(policy_loss="clip_cov", cov_frac=frac, cov_lb=lb, cov_ub=ub)
    _, jax_grad = jax_loss_grad(*batch, **kw)
    top = np.unravel_index(np.argmax(np.where(band, cov, -np.inf)), cov.shape)
    assert _detached(jax_grad, plain) == {tuple(int(i) for i in top)}


# ---------------------------------------------------------------------------
# Advantage estimators. verl takes token-level rewards (the outcome on the last real
# token), a response mask and the group index; it returns the advantage on every real token.


def verl_advantages(fn, rewards_bxg, lengths=None, **kw):
    b, g = rewards_bxg.shape
    t = 6
    lengths = np.full(b * g, t) if lengths is None else np.asarray(lengths)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    token_rewards = np.zeros((b * g, t))
    token_rewards[np.arange(b * g), lengths - 1] = rewards_bxg.reshape(-1)
    dtype = torch.float32 if rewards_bxg.dtype == np.float32 else torch.float64
    adv, _ = fn(
        token_level_rewards=torch.tensor(token_rewards, dtype=dtype),
        response_mask=torch.tensor(mask, dtype=dtype),
        index=np.repeat(np.arange(b), g),
        config=AlgoConfig(gamma=1.0),
        **kw,
    )
    adv = adv.numpy()
    # One advantage per row, on every real token, 0 on padding.
    np.testing.assert_array_equal(adv, adv[:, :1] * mask)
    return adv[:, 0].reshape(b, g)


def random_rewards(seed, b=4, g=5):
    return np.random.default_rng(seed).normal(0.3, 1.0, size=(b, g))


_jit_advantages = jax.jit(
    advantages.compute_advantages,
    static_argnames=("estimator", "eps", "passk_k"),
    compiler_options=FAST_COMPILE,
)


def jax_advantages(rewards, estimator, eps=0.0, **kw):
    out = _jit_advantages(jnp.asarray(rewards), estimator=estimator, eps=eps, **kw)
    assert out.dtype == rewards.dtype
    return np.asarray(out)


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_advantages(seed):
    # verl: (r - mean) / (sample std + eps); grpo_jax: (r - mean) / (population std + eps).
    # At eps = 0 on both sides: verl = grpo_jax * sqrt((G - 1) / G).
    rewards = random_rewards(seed)
    g = rewards.shape[1]
    want = verl_advantages(verl_algos.compute_grpo_outcome_advantage, rewards, epsilon=0.0)
    got = jax_advantages(rewards, "grpo") * np.sqrt((g - 1) / g)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_and_rloo_advantages(seed):
    rewards = random_rewards(seed)
    lengths = np.random.default_rng(seed).integers(1, 7, size=rewards.size)  # padding: no effect
    fn = verl_algos.compute_grpo_outcome_advantage
    want = verl_advantages(fn, rewards, lengths, norm_adv_by_std_in_grpo=False)
    np.testing.assert_allclose(jax_advantages(rewards, "dr_grpo"), want, **TOL)
    want = verl_advantages(verl_algos.compute_rloo_outcome_advantage, rewards, lengths)
    np.testing.assert_allclose(jax_advantages(rewards, "rloo"), want, **TOL)


def test_difference_grpo_std_and_constant_group():
    # Rewards [0, 1]: population std 0.5, sample std 0.7071. verl's default eps is 1e-6.
    rewards = np.array([[0.0, 1.0]])
    verl = verl_advantages(verl_algos.compute_grpo_outcome_advantage, rewards)
    np.testing.assert_allclose(verl, np.array([[-0.5, 0.5]]) / (np.sqrt(0.5) + 1e-6), rtol=1e-15)
    np.testing.assert_allclose(
        jax_advantages(rewards, "grpo", eps=1e-6), np.array([[-0.5, 0.5]]) / (0.5 + 1e-6), **TOL
    )
    # Eight float32 rewards of 0.1: verl turns the mean's rounding error into advantages
    # (-7.4e-9 / (8e-9 + 1e-6)); grpo_jax gives exactly 0.
    rewards = np.full((1, 8), 0.1, np.float32)
    verl = verl_advantages(verl_algos.compute_grpo_outcome_advantage, rewards)
    assert np.abs(verl).min() > 5e-3
    np.testing.assert_array_equal(jax_advantages(rewards, "grpo", eps=1e-6), 0.0)
    # An unscored (NaN) reward: verl's group statistics become NaN for every member;
    # grpo_jax leaves it out of them and gives it 0.
    rewards = np.array([[np.nan, 1.0, 0.0]])
    assert np.isnan(verl_advantages(verl_algos.compute_grpo_outcome_advantage, rewards)).all()
    got = jax_advantages(rewards, "grpo", eps=1e-6)
    np.testing.assert_allclose(got, np.array([[0.0, 0.5, -0.5]]) / (0.5 + 1e-6), **TOL)
    # A group of one response: verl uses mean 0 and std 1, so r / (1 + eps), with 1 + eps
    # rounded to float32 (verl keeps that std as a float32 tensor). grpo_jax needs G >= 2;
    # a group with one finite reward gets 0.
    verl = verl_advantages(verl_algos.compute_grpo_outcome_advantage, np.array([[0.7]]))
    np.testing.assert_allclose(verl, [[0.7 / float(np.float32(1) + np.float32(1e-6))]], rtol=1e-15)
    np.testing.assert_array_equal(jax_advantages(np.array([[0.7, np.nan]]), "grpo")[0], 0.0)


def verl_whitening(x_n, n_tokens_each):
    """The mean and scale of verl's masked_whiten for a row value x_i on |o_i| real tokens.

    Over the M = sum |o_i| real tokens: mean = sum / (M + 1e-8),
    var = sum((x - mean)^2) / (M + 1e-8) * M / (M - 1) (Bessel's correction over tokens),
    scale = sqrt(var + 1e-8); verl's output is (x_i - mean) / scale.
    """
    m = n_tokens_each.sum()
    mean = (n_tokens_each * x_n).sum() / (m + VERL_EPS)
    var = (n_tokens_each * (x_n - mean) ** 2).sum() / (m + VERL_EPS) * m / (m - 1)
    return mean, np.sqrt(var + VERL_EPS)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_advantages(seed):
    # REINFORCE++: both whiten the rewards over the batch. grpo_jax (eps = 0):
    # A = (r - mu) / s with the population mean and std over rows. verl: (r - mean_v) / scale_v
    # from masked_whiten over tokens (verl_whitening); with every row of length L (no padding)
    # its statistics are of the row values, so verl = (s A + mu - mean_v) / scale_v.
    rewards = random_rewards(seed)
    fn = verl_algos.compute_reinforce_plus_plus_outcome_advantage
    want = verl_advantages(fn, rewards).reshape(-1)
    got = jax_advantages(rewards, "reinforce_pp").reshape(-1)
    r = rewards.reshape(-1)
    mu, s = r.mean(), r.std()
    n_tokens = np.full(r.size, 6.0)
    mean_v, scale_v = verl_whitening(r, n_tokens)
    np.testing.assert_allclose((s * got + mu - mean_v) / scale_v, want, **TOL)
    # The constants matter at this tolerance: Bessel's factor alone does not map one on
    # the other.
    m = n_tokens.sum()
    assert np.abs(got * np.sqrt((m - 1) / m) - want).max() > 1e-11


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_advantages(seed):
    # REINFORCE++-baseline: both centre on the group mean, c = r - mean_group (grpo_jax's
    # dr_grpo advantages, = verl's with norm_adv_by_std_in_grpo=False), then scale over the
    # batch. grpo_jax (eps = 0): A = c / s_c, s_c = sqrt(mean(c^2)), the batch mean of c (0 up
    # to rounding) not subtracted. verl: masked_whiten of c over tokens, which subtracts it
    # again: verl = (s_c A - mean_v) / scale_v.
    rewards = random_rewards(seed)
    fn = verl_algos.compute_reinforce_plus_plus_baseline_outcome_advantage
    want = verl_advantages(fn, rewards).reshape(-1)
    got = jax_advantages(rewards, "reinforce_pp_baseline").reshape(-1)
    c = jax_advantages(rewards, "dr_grpo").reshape(-1)
    s_c = np.sqrt((c**2).mean())
    mean_v, scale_v = verl_whitening(c, np.full(c.size, 6.0))
    np.testing.assert_allclose((s_c * got - mean_v) / scale_v, want, **TOL)


def test_difference_reinforce_pp_token_weighting_and_constant_group():
    # With rows of different lengths verl's whitening weighs each row by its length |o_i|;
    # grpo_jax's weighs every row the same.
    rewards = random_rewards(7, b=2, g=3)
    lengths = np.array([1, 6, 2, 5, 3, 4])
    r = rewards.reshape(-1)
    fn = verl_algos.compute_reinforce_plus_plus_outcome_advantage
    want = verl_advantages(fn, rewards, lengths).reshape(-1)
    mean_v, scale_v = verl_whitening(r, lengths.astype(float))
    np.testing.assert_allclose((r - mean_v) / scale_v, want, **TOL)
    got = jax_advantages(rewards, "reinforce_pp").reshape(-1)
    mean_1, scale_1 = verl_whitening(r, np.ones(r.size))  # the rows weighing the same
    assert np.abs((r.std() * got + r.mean() - mean_1) / scale_1 - want).max() > 1e-2
    # Baseline variant: verl also subtracts the token-weighted mean of c, which padding
    # makes non-zero, so verl's groups no longer sum to 0; grpo_jax's do.
    fn = verl_algos.compute_reinforce_plus_plus_baseline_outcome_advantage
    want = verl_advantages(fn, rewards, lengths).reshape(-1)
    c = jax_advantages(rewards, "dr_grpo").reshape(-1)
    mean_v, scale_v = verl_whitening(c, lengths.astype(float))
    np.testing.assert_allclose((c - mean_v) / scale_v, want, **TOL)
    assert np.abs(want.reshape(2, 3).sum(1)).max() > 1e-3
    got = jax_advantages(rewards, "reinforce_pp_baseline", eps=1e-6).reshape(2, 3)
    np.testing.assert_allclose(got.sum(1), 0.0, atol=1e-12)
    # A group of equal rewards: verl gives it r - mean_batch (whitened), grpo_jax 0.
    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 3.0]])
    want = verl_advantages(verl_algos.compute_reinforce_plus_plus_outcome_advantage, rewards)
    assert np.abs(want[0]).min() > 0.1
    np.testing.assert_array_equal(jax_advantages(rewards, "reinforce_pp", eps=1e-6)[0], 0.0)


def test_difference_passk():
    # verl's grpo_passk: only a group's best response gets r_max - r_second_max, divided by
    # the sample std + 1e-6; grpo_jax's passk is Chen et al.'s closed form over k-subsets.
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    want = verl_advantages(verl_algos.compute_grpo_passk_outcome_advantage, rewards)
    np.testing.assert_allclose(want, [[1 / (0.5 + 1e-6), 0, 0, 0], [0, 0, 0, 0]], rtol=1e-15)
    # grpo_jax, k = 2. Group 1: n = 4, c = 1: R = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2,
    # A_correct = (1/2)/(1/2) = 1, A_wrong = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3.
    # Group 2: c = 2: R = 1 - 1/6 = 5/6, sigma = sqrt(5)/6, A_correct = (1/6)/sigma,
    # A_wrong = (1/6 - 1/3)/sigma.
    got = jax_advantages(rewards, "passk", passk_k=2)
    sigma = np.sqrt(5) / 6
    golden = [[1, -1 / 3, -1 / 3, -1 / 3], [1 / 6 / sigma] * 2 + [-1 / 6 / sigma] * 2]
    np.testing.assert_allclose(got, golden, **TOL)


# ---------------------------------------------------------------------------
# Behaviour correction. verl's log_ratio is old_log_prob - rollout_log_prob, grpo_jax's
# behavior_weights takes (old, behavior); both clamp the (summed) log weight to +-20.
# tis with cap C is verl's float threshold C; mis with cap C is IcePop's "1/C_C" string.


def behavior_batch(seed, n_rows=8, t=10, spread=0.6):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=n_rows)
    lengths[0] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    old = np.log(rng.uniform(0.05, 0.95, size=(n_rows, t)))
    behavior = old - rng.normal(0.0, spread, size=(n_rows, t)) * mask
    return old, behavior, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_behavior_weights(seed, level, correction):
    old, behavior, mask = behavior_batch(seed, spread=0.6 if level == "token" else 0.4)
    cap = 1.7
    threshold = cap if correction == "tis" else f"{1 / cap}_{cap}"
    want, _ = compute_rollout_correction_weights(
        torch.tensor(old - behavior), torch.tensor(mask), level, threshold
    )
    want = want.numpy()
    got, _ = losses.behavior_weights(
        jnp.asarray(old),
        jnp.asarray(behavior),
        jnp.asarray(mask),
        correction=correction,
        level=level,
        cap=cap,
    )
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), want, **TOL)
    # Both regimes occur: weights cut (capped or masked) and weights kept as they are.
    raw = (
        np.exp(old - behavior)
        if level == "token"
        else np.exp(((old - behavior) * mask).sum(1))[:, None]
    )
    raw = np.broadcast_to(raw, mask.shape)
    kept = (mask > 0) & (raw < cap) & (raw > 1 / cap)
    assert kept.any() and ((mask > 0) & ~kept).any()
    np.testing.assert_array_equal(want[mask == 0], 0.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_loss_with_behavior_weights(seed, level):
    # The weights multiply the per-token policy term after dual clip on both sides.
    logps, old, adv, mask = batch = random_batch(seed)
    rng = np.random.default_rng(100 + seed)
    behavior = old - rng.normal(0.0, 0.5 if level == "token" else 0.15, size=old.shape) * mask
    weights, _ = compute_rollout_correction_weights(
        torch.tensor(old - behavior), torch.tensor(mask), level, "0.5_2.0"
    )
    weights = weights.numpy()
    assert (weights[mask > 0] == 0).any() and (weights[mask > 0] > 0).any()
    want = verl_loss_grad("vanilla", *batch, actor_config(), weights=weights)
    kw = dict(epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, dual_clip_c=DUAL_C)
    got = jax_loss_grad(
        *batch, reduction="token_mean", behavior_weights_NxT=jnp.asarray(weights), **kw
    )
    assert_same(got, want)
    unweighted = jax_loss_grad(*batch, reduction="token_mean", **kw)
    assert abs(unweighted[0] - got[0]) > 1e-6


@pytest.mark.parametrize("seed", SEEDS)
def test_gmpo_with_sequence_behavior_weights(seed):
    # Sequence-level IcePop weights; rows whose weight is masked keep verl's ~1e-10.
    logps, old, adv, mask = batch = random_batch(seed, empty_row=True)
    rng = np.random.default_rng(200 + seed)
    behavior = old - rng.normal(0.0, 0.3, size=old.shape) * mask
    weights, _ = compute_rollout_correction_weights(
        torch.tensor(old - behavior), torch.tensor(mask), "sequence", "0.5_2.0"
    )
    weights = weights.numpy()
    w_n = weights[:, 0]
    assert (w_n[:-1] == 0).any() and (w_n > 0).any()
    config = actor_config(clip_ratio_low=0.4, clip_ratio_high=0.3)
    want = verl_loss_grad("geo_mean", *batch, config, weights=weights)
    kw = dict(policy_loss="gmpo", reduction="grpo", epsilon_low=0.4, epsilon_high=0.3)
    n_tokens = mask.sum(1)
    verl_w_n = np.where(n_tokens > 0, (w_n + 1e-10) ** (n_tokens / (n_tokens + VERL_EPS)), 0.0)
    got = rows_loss_grad(*batch, verl_w_n / len(adv), gmpo_as_verl=True, **kw)
    assert_same(got, want)
    # grpo_jax's own weighted loss: its row losses times w, a masked row exactly 0.
    weighted = jax_loss_grad(*batch, behavior_weights_NxT=weights, **kw)
    assert_same(weighted, rows_loss_grad(*batch, w_n / len(adv), **kw))


# ---------------------------------------------------------------------------
# GAE and the value loss against verl's (module doc).


def gae_batch(seed, n_rows=6, t=12):
    """Rewards, values and masks: padded rows, multi-turn gaps, one row of a single token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=n_rows)
    lengths[0] = 1
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    for n in range(1, n_rows, 2):  # an environment's stretch inside the row
        if lengths[n] > 3:
            mask[n, 1 : lengths[n] - 1] *= rng.random(lengths[n] - 2) < 0.5
    return rng.normal(size=n_rows), rng.normal(size=(n_rows, t)), mask


def verl_gae(rewards, values, mask, gamma, lam):
    token_rewards = np.zeros_like(values)
    last = values.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
    token_rewards[np.arange(len(rewards)), last] = rewards
    adv, ret = verl_algos.compute_gae_advantage_return(
        torch.tensor(token_rewards), torch.tensor(values), torch.tensor(mask), gamma, lam
    )
    return adv.numpy(), ret.numpy()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae(seed, gamma, lam):
    rewards, values, mask = gae_batch(seed)
    want_adv, want_ret = verl_gae(rewards, values, mask, gamma, lam)
    adv, ret = gae.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    np.testing.assert_allclose(np.asarray(ret), want_ret * mask, **TOL)
    m = mask.sum()
    white = np.asarray(gae.whiten(adv, jnp.asarray(mask))) * np.sqrt((m - 1) / m)
    np.testing.assert_allclose(white, want_adv * mask, rtol=1e-7, atol=1e-7)


def test_difference_gae_off_the_mask_and_whitening():
    rewards, values, mask = gae_batch(0)
    want_adv, want_ret = verl_gae(rewards, values, mask, 1.0, 1.0)
    adv, ret = gae.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 1.0, 1.0)
    gaps = (mask == 0) & (np.cumsum(mask[:, ::-1], axis=1)[:, ::-1] > 0)
    assert gaps.any()
    assert np.all(np.asarray(ret)[gaps] == 0) and np.all(want_ret[gaps] != 0)
    m = mask.sum()
    white = np.asarray(gae.whiten(adv, jnp.asarray(mask)))
    # Without the Bessel factor the two differ by sqrt(M / (M - 1)), far beyond rounding.
    assert np.abs(white - want_adv * mask).max() > 1e-3
    np.testing.assert_allclose(white * np.sqrt((m - 1) / m), want_adv * mask, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss(seed):
    rng = np.random.default_rng(seed)
    _, old, mask = gae_batch(seed)
    vpreds = old + rng.normal(scale=0.5, size=old.shape)
    returns = old + rng.normal(size=old.shape)
    tv = torch.tensor(vpreds, requires_grad=True)
    want, want_frac = verl_algos.compute_value_loss(
        tv, torch.tensor(returns), torch.tensor(old), torch.tensor(mask), 0.2
    )
    want.backward()
    (loss, metrics), grad = jax.value_and_grad(gae.value_loss, has_aux=True)(
        jnp.asarray(vpreds), jnp.asarray(old), jnp.asarray(returns), jnp.asarray(mask), 0.2
    )
    assert 0.05 < float(metrics["value_clip_frac"]) < 0.95
    np.testing.assert_allclose(loss, want.item(), **TOL)
    # verl's clip fraction is a masked_mean, whose denominator is M + 1e-8.
    m = mask.sum()
    frac = float(metrics["value_clip_frac"]) * m / (m + VERL_EPS)
    np.testing.assert_allclose(frac, float(want_frac), **TOL)
    np.testing.assert_allclose(grad, tv.grad.numpy(), **TOL)
