"""Behaviour-policy correction: weights by hand, the exact gradient by enumeration, recompute.

The sampler draws from q (pi_old after top-k / top-p / min-p, at the
sampler's precision) while the objective is an expectation under pi_old. The
tests check (1) ``behavior_weights`` against hand-computed values; (2) on a
toy policy small enough to enumerate, that the mean corrected gradient over
many sampled batches equals the exact gradient of the objective and the
uncorrected one does not; (3) that ``old_logps="recompute"`` makes the first
ratio 1 under bfloat16 compute where the sampler's own log-probs do not.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.objective import losses
from grpo_jax.rollout.rounds import RolloutBatch
from grpo_jax.run.config import ConfigError, GRPOConfig, OptimConfig
from grpo_jax.sampling import static as sampling

# ---------------------------------------------------------------------------
# The weights by hand.


def test_behavior_weights_golden_token_and_sequence():
    # Two rows; row 0 has three real tokens, row 1 two (its last is padding).
    old = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.0, -9.0]], np.float32)
    q = np.array([[-1.5, -1.0, -0.5], [-0.3, -3.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    # log w per token: [[0.5, -1.0, 0.0], [0.0, 2.0, (pad)]]
    w, m = losses.behavior_weights(old, q, mask, correction="tis", level="token", cap=2.0)
    want = np.array([[np.exp(0.5), np.exp(-1.0), 1.0], [1.0, 2.0, 0.0]])  # e^2 > 2: capped
    np.testing.assert_allclose(w, want, rtol=1e-6)
    assert m["behavior/frac_capped"] == pytest.approx(1 / 5)
    assert m["behavior/abs_log_diff_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.0 + 2.0) / 5)
    assert m["behavior/abs_log_diff_max"] == pytest.approx(2.0)

    # Masked IS: e^0.5 = 1.65 and e^-1 = 0.37 (< 1/2) and e^2 = 7.4 (> 2).
    w, m = losses.behavior_weights(old, q, mask, correction="mis", level="token", cap=2.0)
    want = np.array([[np.exp(0.5), 0.0, 1.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(w, want, rtol=1e-6)
    assert m["behavior/frac_masked"] == pytest.approx(2 / 5)

    # Sequence level: row sums of log w are -0.5 and 2.0.
    w, m = losses.behavior_weights(old, q, mask, correction="tis", level="sequence", cap=3.0)
    want = np.array([[np.exp(-0.5)] * 3, [3.0, 3.0, 0.0]])
    np.testing.assert_allclose(w, want, rtol=1e-6)
    assert m["behavior/frac_capped"] == pytest.approx(2 / 5)  # row 1's two tokens
    w, m = losses.behavior_weights(old, q, mask, correction="mis", level="sequence", cap=3.0)
    np.testing.assert_allclose(w, [[np.exp(-0.5)] * 3, [0.0, 0.0, 0.0]], rtol=1e-6)
    assert m["behavior/frac_masked"] == pytest.approx(2 / 5)

    # "none": the mask itself (no correction), and the metrics still report the gap.
    w, m = losses.behavior_weights(old, q, mask, correction="none", level="token", cap=2.0)
    np.testing.assert_array_equal(w, mask)
    assert m["behavior/abs_log_diff_max"] == pytest.approx(2.0)


def test_a_weight_exactly_at_the_cap_is_kept():
    # The band is closed: 1/C <= w <= C keeps w (mis) and tis caps only w > C.
    log_c = float(jnp.log(jnp.asarray(2.0, jnp.float32)))  # the log the weights compare with
    old = np.array([[log_c, -log_c, 0.0]], np.float32)
    q = np.zeros((1, 3), np.float32)  # w = 2, 1/2, 1
    mask = np.ones((1, 3), np.float32)
    w, m = losses.behavior_weights(old, q, mask, correction="mis", level="token", cap=2.0)
    np.testing.assert_allclose(w, [[2.0, 0.5, 1.0]], rtol=1e-6)
    assert float(m["behavior/frac_masked"]) == 0.0
    w, m = losses.behavior_weights(old, q, mask, correction="tis", level="token", cap=2.0)
    np.testing.assert_allclose(w, [[2.0, 0.5, 1.0]], rtol=1e-6)
    assert float(m["behavior/frac_capped"]) == 0.0


def test_behavior_weights_survive_huge_sequence_log_ratios():
    old = np.zeros((1, 64), np.float32)
    q = np.full((1, 64), -5.0, np.float32)  # sum log w = 320: exp overflows float32
    seq = dict(level="sequence", cap=2.0)
    w, _ = losses.behavior_weights(old, q, np.ones((1, 64)), correction="tis", **seq)
    np.testing.assert_array_equal(w, 2.0)
    w, _ = losses.behavior_weights(old, q, np.ones((1, 64)), correction="mis", **seq)
    np.testing.assert_array_equal(w, 0.0)
    w, _ = losses.behavior_weights(q, old, np.ones((1, 64)), correction="tis", **seq)
    assert np.all(np.isfinite(w)) and np.all(w >= 0)


@pytest.mark.slow
def test_weights_multiply_the_policy_term_only():
    rng = np.random.default_rng(0)
    n, t = 6, 5
    logps = jnp.asarray(rng.normal(-1.0, 0.3, (n, t)))
    old = logps + jnp.asarray(rng.normal(0, 0.1, (n, t)))
    ref = logps + jnp.asarray(rng.normal(0, 0.1, (n, t)))
    adv = jnp.asarray(rng.normal(size=n))
    mask = jnp.asarray(rng.random((n, t)) < 0.8, jnp.float32)
    w = jnp.asarray(rng.uniform(0.2, 2.0, (n, t)))
    kw = dict(ref_logps_NxT=ref)
    objective = GRPOConfig(beta=0.3, reduction="token_mean")
    got, _ = losses.grpo_loss(logps, old, adv, mask, objective, behavior_weights_NxT=w, **kw)
    plain_pg, _ = losses.grpo_loss(
        logps, old, adv, mask * w, GRPOConfig(beta=0.0, reduction="token_mean")
    )
    kl_only, _ = losses.grpo_loss(logps, old, adv * 0, mask, objective, **kw)
    # token_mean over mask: sum(w * s * mask) / sum(mask) - beta * mean KL.
    scale = (mask * w).sum() / mask.sum()
    np.testing.assert_allclose(got, plain_pg * scale + kl_only, rtol=1e-5)


def test_config_rejects_token_weights_for_sequence_objectives():
    with pytest.raises(ConfigError, match="behavior_level='sequence'"):
        GRPOConfig(G=4, reduction="gspo", behavior_correction="tis")
    GRPOConfig(G=4, reduction="gspo", behavior_correction="tis", behavior_level="sequence")
    with pytest.raises(ConfigError, match="behavior_correction"):
        GRPOConfig(G=4, behavior_correction="is")
    with pytest.raises(ConfigError, match="behavior_cap"):
        GRPOConfig(G=4, behavior_cap=1.0)
    with pytest.raises(ConfigError, match="old_logps"):
        GRPOConfig(G=4, old_logps="trainer")


# ---------------------------------------------------------------------------
# The exact gradient by enumeration on a toy policy.
#
# A bigram policy over V tokens: theta[prev, next] are the logits of the next
# token given the previous one (row V is the start). Sequences have T tokens,
# all real. The objective is J(theta) = sum_y pi_theta(y) R(y). Sampling goes
# through the library's own ``sample_step`` with top-k or top-p, and the loss
# is ``grpo_loss`` (advantage R, "dr_grpo" with max_tokens 1: minus the sum
# over tokens, averaged over rows), whose gradient at theta = theta_old is
# -(1/N) sum_n sum_t w_nt R_n grad log pi(y_nt).
#
# Importance weights cannot recover what q never samples, so R is 0 on
# sequences outside q's support: then E_q[(pi/q) R grad log pi] = grad J
# exactly with sequence weights (and with token weights when T = 1), while the
# uncorrected E_q[R grad log pi] is off by q's renormalisation.

V_TOY = 5


def _toy_theta():
    return jnp.asarray(np.random.default_rng(3).normal(0, 1.0, (V_TOY + 1, V_TOY)), jnp.float32)


def _seq_logps(theta, seqs_NxT):
    prev_NxT = jnp.concatenate([jnp.full((seqs_NxT.shape[0], 1), V_TOY), seqs_NxT[:, :-1]], axis=1)
    logp_NxTxV = jax.nn.log_softmax(theta[prev_NxT], axis=-1)
    return jnp.take_along_axis(logp_NxTxV, seqs_NxT[..., None], axis=-1)[..., 0]


def _sample(theta, n, t, key, **filters):
    """n sequences of t tokens from q; (seqs, full logps, behaviour logps)."""
    prev = jnp.full((n,), V_TOY)
    seqs, full, beh = [], [], []
    for k in jax.random.split(key, t):
        tok, lp, bq = sampling.sample_step(theta[prev], k, **filters)
        seqs.append(tok), full.append(lp), beh.append(bq)
        prev = tok
    return jnp.stack(seqs, 1), jnp.stack(full, 1), jnp.stack(beh, 1)


def _support(theta, seqs_MxT, **filters):
    """1 where every token of the sequence is a candidate of q at its step."""
    prev = jnp.full((seqs_MxT.shape[0],), V_TOY)
    ok = jnp.ones(seqs_MxT.shape[0], bool)
    for i in range(seqs_MxT.shape[1]):
        cand, ids = sampling.candidates(theta[prev], **filters)
        logits_V = cand if ids is None else None
        if ids is not None:
            kept = jnp.zeros((seqs_MxT.shape[0], V_TOY), bool)
            kept = kept.at[jnp.arange(seqs_MxT.shape[0])[:, None], ids].set(jnp.isfinite(cand))
        else:
            kept = jnp.isfinite(logits_V)
        ok &= kept[jnp.arange(seqs_MxT.shape[0]), seqs_MxT[:, i]]
        prev = seqs_MxT[:, i]
    return ok


def _toy_reward(seqs_MxT, support_M):
    table = np.random.default_rng(7).normal(0, 1.0, (V_TOY,) * seqs_MxT.shape[1])
    r = jnp.asarray(table)[tuple(seqs_MxT[:, i] for i in range(seqs_MxT.shape[1]))]
    return jnp.where(support_M, r, 0.0)


def _draws(theta, t, filters, n=200_000):
    """n sequences drawn from q with their rewards, shared by every correction's estimate:
    (seqs, full logps, behaviour logps, rewards, mask)."""
    # Each program compiled once (jitted), not op by op: the rows are many, the shapes few.
    sample = jax.jit(lambda th, key: _sample(th, n, t, key, **filters))
    seqs, full, beh = sample(theta, jax.random.key(11))
    # The same reward as _exact's enumeration gives each sequence (a table over sequences).
    reward_fn = jax.jit(lambda th, s: _toy_reward(s, _support(th, s, **filters)))
    rewards = reward_fn(theta, seqs).astype(theta.dtype)
    mask = jnp.ones(seqs.shape, theta.dtype)
    return seqs, full.astype(theta.dtype), beh.astype(theta.dtype), rewards, mask


def _estimates(theta, draws, correction, level):
    """Per-sample gradients of -loss (one row each) and the batch loss's gradient."""
    seqs, full, beh, rewards, mask = draws
    n = seqs.shape[0]
    w, _ = losses.behavior_weights(full, beh, mask, correction=correction, level=level, cap=1e6)

    def neg_loss(th, rows_seqs, rows_old, rows_adv, rows_mask, rows_w):
        loss, _ = losses.grpo_loss(
            _seq_logps(th, rows_seqs),
            rows_old,
            rows_adv,
            rows_mask,
            GRPOConfig(reduction="dr_grpo"),
            max_tokens=1,
            behavior_weights_NxT=None if correction == "none" else rows_w,
        )
        return -loss

    batch_grad = jax.jit(jax.grad(neg_loss))(theta, seqs, full, rewards, mask, w)
    # Per-sample gradients (a batch of one row each) for the standard error.
    one = jax.jit(
        jax.vmap(
            jax.grad(
                lambda th, s, o, a, m, ww: neg_loss(
                    th, s[None], o[None], a[None], m[None], ww[None]
                )
            ),
            in_axes=(None, 0, 0, 0, 0, 0),
        )
    )
    per = jnp.concatenate(
        [
            one(theta, *(x[i : i + 20_000] for x in (seqs, full, rewards, mask, w)))
            for i in range(0, n, 20_000)
        ]
    )
    return batch_grad, per.mean(0), per.std(0) / np.sqrt(n)


def _exact(theta, t, filters):
    all_seqs = jnp.asarray(list(itertools.product(range(V_TOY), repeat=t)))

    @jax.jit  # one program, not the enumeration's operations compiled one by one
    def grad(theta):
        rewards = _toy_reward(all_seqs, _support(theta, all_seqs, **filters))
        return jax.grad(lambda th: (jnp.exp(_seq_logps(th, all_seqs).sum(1)) * rewards).sum())(
            theta
        )

    return grad(theta)


@pytest.mark.slow
@pytest.mark.parametrize(
    "t, filters, level",
    [
        (2, dict(top_k=3), "sequence"),
        (2, dict(top_p=0.7), "sequence"),
        (1, dict(top_k=2), "token"),
        (3, dict(min_p=0.15), "sequence"),
    ],
)
def test_corrected_gradient_matches_enumeration_and_uncorrected_does_not(t, filters, level):
    with jax.enable_x64(True):  # float64 gradients: sums over 200k rows stay exact
        _check_corrected_gradient(t, filters, level)


def _check_corrected_gradient(t, filters, level):
    theta = _toy_theta().astype(jnp.float64)
    exact = np.asarray(_exact(theta, t, filters))
    draws = _draws(theta, t, filters)
    for correction in ("tis", "mis"):  # cap 1e6: no weight is cut, both are plain IS
        batch_grad, mean, se = map(np.asarray, _estimates(theta, draws, correction, level))
        # The batch loss's gradient is the mean of the per-row ones ...
        np.testing.assert_allclose(batch_grad, mean, rtol=1e-6, atol=1e-9)
        # ... and within sampling error of the exact gradient, component by component.
        z = np.abs(mean - exact) / np.maximum(se, 1e-7)
        assert z.max() < 5.0, (correction, z.max(), mean, exact)
    _, mean, se = map(np.asarray, _estimates(theta, draws, "none", level))
    z = np.abs(mean - exact) / np.maximum(se, 1e-7)
    assert z.max() > 20.0, z.max()  # visibly biased


# ---------------------------------------------------------------------------
# old_logps = "recompute" under bfloat16 compute.


@pytest.mark.slow
def test_recompute_makes_the_first_ratio_one_under_bfloat16(tiny_model_config, one_device_mesh):
    from flax import nnx

    from grpo_jax.models import create_model

    cfg = tiny_model_config.replace(dtype="bfloat16", num_layers=2)
    mesh = one_device_mesh
    graphdef, params = nnx.split(create_model(cfg, seed=1, mesh=mesh))
    G, B, P, T = 4, 2, 8, 12
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, cfg.vocab_size, (B, P)).astype(np.int32)
    out = sampling.generate(
        graphdef,
        params,
        prompts,
        np.ones((B, P), bool),
        jax.random.key(0),
        sampling.SamplingConfig(max_new_tokens=T, top_k=20),
        num_samples=G,
    )
    n = B * G
    batch = RolloutBatch(
        prompt_tokens_NxP=out.prompt_tokens,
        prompt_mask_NxP=out.prompt_mask,
        tokens_NxT=out.tokens,
        mask_NxT=out.mask,
        old_logps_NxT=out.logps,
        behavior_logps_NxT=out.behavior_logps,
        rewards_N=np.zeros(n, np.float32),
        advantages_N=rng.normal(size=n).astype(np.float32),
        weights_N=np.ones(n, np.float32),
        group_ids_N=np.repeat(np.arange(B, dtype=np.int32), G),
    )
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-3), 10)

    def first_ratios(old_logps, correction="none"):
        grpo = GRPOConfig(G=G, old_logps=old_logps, behavior_correction=correction)
        state = optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
        fn = upd.jit_update(
            graphdef=graphdef,
            tx=tx,
            schedule=schedule,
            grpo=grpo,
            minibatch_size=0,
            grad_accum=1,
            batch_shards=1,
            track_update=False,
            state_shardings=jax.tree.map(lambda x: x.sharding, state),
            batch_shardings=upd.rollout_batch_shardings(mesh),
            ref_shardings=None,
            replicated=sharding.replicated(mesh),
        )
        return jax.device_get(fn(state, batch, jax.random.key(0), None)[1])

    sampler = first_ratios("sampler")
    recomputed = first_ratios("recompute", "tis")
    # The sampler's bf16 decode-with-cache and the update's bf16 full forward
    # round differently: the first ratio is visibly not 1 ...
    gap = max(abs(sampler["train/ratio_max"] - 1), abs(sampler["train/ratio_min"] - 1))
    assert gap > 1e-4, sampler
    # ... while pi_old rescored on the update's own path gives 1 to float32 rounding.
    assert abs(recomputed["train/ratio_max"] - 1) < 1e-6, recomputed
    assert abs(recomputed["train/ratio_min"] - 1) < 1e-6, recomputed
    # The top-k truncation and the precision gap both show in the behaviour metrics.
    assert recomputed["behavior/abs_log_diff_max"] > 0
    assert 0 <= recomputed["behavior/frac_capped"] <= 1


# ---------------------------------------------------------------------------
# The corrected update: sharded over 8 devices equals one device.


@pytest.mark.slow
@pytest.mark.parametrize("correction, level", [("tis", "sequence"), ("mis", "token")])
def test_corrected_update_sharded_equals_one_device(
    tiny_policy, tiny_model_config, one_device_mesh, correction, level
):
    from helpers_batches import rollout_batch

    graphdef, params = tiny_policy
    n, p, t, v = 16, 6, 5, tiny_model_config.vocab_size
    rng = np.random.default_rng(4)
    mask = np.ones((n, t), bool)
    mask[::3, 3:] = False
    rows = dict(
        prompt_tokens=rng.integers(4, v, (n, p)).astype(np.int32),
        prompt_mask=np.ones((n, p), bool),
        tokens=rng.integers(4, v, (n, t)).astype(np.int32),
        mask=mask,
    )
    batch = rollout_batch(graphdef, params, rows, rng.normal(size=n).astype(np.float32))
    # A behaviour distribution off pi_old by up to ~0.7 nats per token: some
    # weights leave [1/C, C] for C = 1.5.
    noise = rng.normal(0, 0.3, (n, t)).astype(np.float32) * mask
    batch = batch.replace(behavior_logps_NxT=np.asarray(batch.old_logps_NxT) + noise)
    grpo = GRPOConfig(
        G=4,
        behavior_correction=correction,
        behavior_level=level,
        behavior_cap=1.5,
        old_logps="recompute",
        mu=2,
    )
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)

    def run(mesh, shards):
        from grpo_jax.models import param_shardings

        # A copy: the update donates its state, and ``params`` is a session fixture.
        placed = jax.device_put(
            jax.tree.map(jnp.copy, params), param_shardings(params, mesh, "fsdp")
        )
        state = optimizer.init_state(placed, tx, mesh)
        fn = upd.jit_update(
            graphdef=graphdef,
            tx=tx,
            schedule=schedule,
            grpo=grpo,
            minibatch_size=0,  # (minibatches draw rows from every shard: the same
            grad_accum=1,  # rows only when the whole batch is one minibatch)
            batch_shards=shards,
            track_update=True,
            state_shardings=jax.tree.map(lambda x: x.sharding, state),
            batch_shardings=upd.rollout_batch_shardings(mesh),
            ref_shardings=None,
            replicated=sharding.replicated(mesh),
        )
        b = jax.device_put(batch, upd.rollout_batch_shardings(mesh))
        return jax.device_get(fn(state, b, jax.random.key(0), None))

    one_state, one = run(one_device_mesh, 1)
    eight_state, eight = run(sharding.make_mesh({"data": 4, "fsdp": 2}), 4)
    cut = "behavior/frac_capped" if correction == "tis" else "behavior/frac_masked"
    assert 0 < one[cut] < 1, one  # the correction binds on some tokens, not all
    for k in one:
        np.testing.assert_allclose(eight[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(one_state.params), jax.tree.leaves(eight_state.params)):
        # The metrics above (loss, grad_norm) agree to 1e-5; Adam's g / sqrt(v)
        # amplifies reduction-order rounding in near-zero gradient entries, so the
        # parameters after two steps of lr 1e-2 agree to 0.5% of one step.
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)
