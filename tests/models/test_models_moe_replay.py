"""Routing replay on a tiny mixture of experts (top 4, both layers sparse), for Qwen3-MoE's
router (16 experts) and GPT-OSS's (32 experts; a softmax over the top 4 logits, biases,
clamped experts: with 16, its bfloat16 copy flipped no route on these tokens).

The rollout's routes come from a copy of the policy that routes differently: a bfloat16
sampling copy, or parameters changed by a small step. The first step of an update compares
the learner's log-probs with pi_old, computed in float32 under the rollout's routing. Without
replay the learner routes by itself, and the tokens whose experts differ (counted) move the
ratio exp(logp_new - logp_old) away from 1; with the rollout's routes replayed, the ratio is 1
to 1e-6, and the router still gets a gradient through the replayed experts' weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_models import left_padded_batch, random_model

from grpo_jax.models import create_model, family_config, positions_from_mask
from grpo_jax.models import moe as moe_lib

CFG = family_config(
    "qwen3_moe", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=32, moe_mlp_dim=16, num_experts=16, experts_per_token=4,
)  # fmt: skip
GPT_OSS = family_config(
    "gpt_oss", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=16, num_experts=32, experts_per_token=4, sliding_window=6,
)  # fmt: skip
CONFIGS = {"qwen3_moe": CFG, "gpt_oss": GPT_OSS}


def _logps(graphdef):
    """jit(params, tokens, mask, routes) -> (log-prob of each next token [B, T-1], routes)."""

    @jax.jit
    def f(params, tokens, mask, routes):
        model = nnx.merge(graphdef, params)
        x, used = model.routed_features(tokens, mask_BxT=mask, routes=routes)
        logp = jax.nn.log_softmax(model.logits(x)[:, :-1], axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], used

    return f


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def setup(request):
    cfg = CONFIGS[request.param]
    graphdef, params = nnx.split(random_model(cfg, seed=0))
    tokens, mask = left_padded_batch((16, 12, 9, 16), 16, cfg.vocab_size, seed=1)
    return graphdef, params, tokens, mask


def _rollout_routes(source, graphdef, params, tokens, mask):
    """The routes a rollout records when its copy of the policy is ``source``."""
    if source == "bfloat16 copy":
        cfg = nnx.merge(graphdef, params).config
        bf16 = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
        copy = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
        return _logps(nnx.graphdef(create_model(bf16)))(copy, tokens, mask, None)
    rng = np.random.default_rng(5)
    moved = jax.tree.map(lambda v: v + 1e-3 * rng.standard_normal(v.shape).astype(v.dtype), params)
    return _logps(graphdef)(moved, tokens, mask, None)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["bfloat16 copy", "small parameter change"])
def test_replayed_routes_give_ratio_one_and_without_replay_flips_move_it(source, setup):
    graphdef, params, tokens, mask = setup
    logps = _logps(graphdef)
    rollout_logp, rollout_routes = _rollout_routes(source, graphdef, params, tokens, mask)
    old_logp, _ = logps(params, tokens, mask, rollout_routes)  # pi_old under the rollout's routes
    own_logp, own_routes = logps(params, tokens, mask, None)
    replay_logp, replayed = logps(params, tokens, mask, rollout_routes)
    np.testing.assert_array_equal(replayed, rollout_routes)  # the given experts were used
    real = np.asarray(mask[:, 1:]) & np.asarray(mask[:, :-1])
    flipped = np.asarray(moe_lib.route_flips(own_routes, rollout_routes))  # [B, T, R]
    share = flipped.any(-1)[np.asarray(mask)].mean()
    assert 0.02 < share < 0.9, share  # some routes flip, not all
    ratio_without = np.exp(own_logp - old_logp)[real]
    ratio_with = np.exp(replay_logp - old_logp)[real]
    assert np.abs(ratio_without - 1).max() > 1e-3
    np.testing.assert_allclose(ratio_with, 1.0, atol=1e-6, rtol=0)
    # Against the rollout's own log-probs (its copy's numerics too), replay shrinks the mismatch
    # of the tokens whose routes flipped.
    flip_t = flipped.any(-1)[:, :-1] & real
    gap = lambda lp: np.abs(np.asarray(lp - rollout_logp))[flip_t].mean()
    assert gap(replay_logp) < 0.7 * gap(own_logp), (gap(replay_logp), gap(own_logp))


@pytest.mark.slow
def test_the_router_gets_a_gradient_through_replayed_routes(setup):
    """Replaying a pass's own routes changes nothing, gradients included; the router's
    gradient is not zero (it flows through the routing weights of the given experts)."""
    graphdef, params, tokens, mask = setup
    logps = _logps(graphdef)
    _, routes = logps(params, tokens, mask, None)
    real = mask[:, 1:] & mask[:, :-1]
    loss = lambda p, r: -jnp.sum(jnp.where(real, logps(p, tokens, mask, r)[0], 0.0))
    g_own = jax.grad(loss)(params, None)
    g_replay = jax.grad(loss)(params, routes)
    router = g_replay["layers"][0]["mlp"]["router"][...]
    assert np.abs(np.asarray(router)).max() > 1e-4
    for a, b in zip(jax.tree.leaves(g_own), jax.tree.leaves(g_replay)):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_cache_decoding_records_the_full_passes_routes(setup):
    """The routes a KV-cache decode reports, token by token, are those of the full forward pass
    over the whole sequence: what a sampler records is what the update replays."""
    graphdef, params, tokens, mask = setup
    model = nnx.merge(graphdef, params)
    _, full_routes = _logps(graphdef)(params, tokens, mask, None)
    positions = positions_from_mask(mask)
    P, S = 10, tokens.shape[1]

    @jax.jit
    def step(params, toks, pos, kv_mask, cache, index):
        return nnx.merge(graphdef, params).features_with_cache(
            toks, positions_BxT=pos, kv_mask_BxS=kv_mask, cache=cache, cache_index=index,
            routes_out=True,
        )  # fmt: skip

    cache = model.init_cache(tokens.shape[0], S)
    kv_mask = jnp.zeros_like(mask).at[:, :P].set(mask[:, :P])
    _, cache, routes = step(params, tokens[:, :P], positions[:, :P], kv_mask, cache, 0)
    got = [routes]
    for t in range(P, S):
        kv_mask = kv_mask.at[:, t].set(mask[:, t])
        _, cache, routes = step(
            params, tokens[:, t : t + 1], positions[:, t : t + 1], kv_mask, cache, t
        )
        got.append(routes)
    decoded = np.concatenate(got, axis=1)
    m = np.asarray(mask)
    assert decoded.shape == (4, S, 2, 4)
    np.testing.assert_array_equal(decoded[m], np.asarray(full_routes)[m])
