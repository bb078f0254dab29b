"""Routing replay in training (``grpo.router_replay = "rollout"``, docs/moe.md).

The sampler (the static engine or the paged one) records each position's experts; the
update replays them in the policy's passes. The rollout comes from a copy of a tiny mixture
(16 experts, top 4) whose parameters moved by a step of 1e-3 (a sampler one version
behind): its routers pick other experts than the policy's at some tokens. pi_old is the
policy under the rollout's routes. The first update's ratio is then 1 to 1e-6 in float32
with replay, and away from 1 without (the flipped tokens, counted by
``moe/route_flip_frac``); on single-turn rows and on multi-turn transcripts, whose
observation tokens' experts are replayed as well.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_episodes import EOS, PROMPTS, _envs, decode, encode_obs
from helpers_jit import completion_logps

from grpo_jax.core import sharding
from grpo_jax.core.batch import RolloutBatch, batch_spec, rollout_batch_shardings
from grpo_jax.learner import optimizer, replay
from grpo_jax.learner import update as upd
from grpo_jax.models import create_model, family_config
from grpo_jax.models import moe as moe_lib
from grpo_jax.rollout import episodes
from grpo_jax.run.config import GRPOConfig, OptimConfig
from grpo_jax.sampling import paged
from grpo_jax.sampling.static import SamplingConfig, generate, pad_prompts

CFG = family_config(
    "qwen3_moe", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=32, moe_mlp_dim=16, num_experts=16, experts_per_token=4,
)  # fmt: skip
B, G, T = 4, 4, 8
SAMPLING = SamplingConfig(max_new_tokens=T, prompt_buckets=(8,), record_routes=True)


def _prompts():
    rng = np.random.default_rng(1)
    tokens = rng.integers(4, CFG.vocab_size, (B, 8)).astype(np.int32)
    mask = np.ones((B, 8), bool)
    mask[0, :3] = False
    mask[2, :1] = False
    return tokens, mask


def _moved(params):
    rng = np.random.default_rng(5)
    return jax.tree.map(lambda v: v + 1e-3 * rng.standard_normal(v.shape).astype(v.dtype), params)


@pytest.fixture(scope="module", params=["static", "paged"])
def rollout(request):
    """(graphdef, the policy's params, the moved copy's params, its SampleOutput), sampled
    on each engine."""
    graphdef, params = nnx.split(create_model(CFG, seed=0))
    copy = _moved(params)
    tokens, mask = _prompts()
    cfg = dataclasses.replace(SAMPLING, engine=request.param)
    sample = generate if request.param == "static" else paged.generate
    out = sample(graphdef, copy, tokens, mask, jax.random.key(2), cfg, num_samples=G)
    return graphdef, params, copy, out


def _batch(graphdef, params, out, pi_old_routes=None) -> RolloutBatch:
    """The rollout as a batch, pi_old the float32 policy's under the rollout's routes (or
    under ``pi_old_routes``)."""
    n = len(out.tokens)
    old = completion_logps(
        graphdef, params, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask, 1.0,
        routes=out.routes if pi_old_routes is None else pi_old_routes,
    )  # fmt: skip
    old = np.asarray(old) * np.asarray(out.mask)
    return RolloutBatch(
        prompt_tokens_NxP=out.prompt_tokens,
        prompt_mask_NxP=out.prompt_mask,
        tokens_NxT=out.tokens,
        mask_NxT=out.mask,
        old_logps_NxT=old,
        behavior_logps_NxT=old,
        rewards_N=np.zeros(n, np.float32),
        advantages_N=np.random.default_rng(0).normal(size=n).astype(np.float32),
        weights_N=np.ones(n, np.float32),
        group_ids_N=np.arange(n, dtype=np.int32) // G,
        routes_NxSxRxK=out.routes,
    )


def _first_step(graphdef, params, batch, mesh, **grpo):
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 4)
    state = optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    replay = grpo.get("router_replay", "none") == "rollout"
    if not replay:
        batch = batch.replace(routes_NxSxRxK=None)
    step = upd.jit_update(
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=GRPOConfig(G=G, **grpo),
        minibatch_size=0,
        grad_accum=1,
        batch_shards=1,
        track_update=False,
        share_prompts=True,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=rollout_batch_shardings(mesh, routes=replay),
        ref_shardings=None,
        replicated=sharding.replicated(mesh),
    )
    return jax.device_get(step(state, batch, jax.random.key(0), None)[1])


@pytest.mark.slow
def test_the_sampler_records_each_fed_tokens_experts_only_when_asked(rollout):
    """Routes are int8 [N, P + T, R, K]: at every position the sampler fed, the experts a
    full pass of its model over [prompt | completion] chooses; -1 at a row's last token
    (never fed). Without ``record_routes`` there are none."""
    graphdef, _, copy, out = rollout
    assert out.routes.shape == (B * G, 8 + T, 2, 4) and out.routes.dtype == jnp.int8
    full = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    fmask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    _, own = nnx.merge(graphdef, copy).routed_features(full, mask_BxT=fmask)
    rec, own, fmask = np.asarray(out.routes), np.asarray(own), np.asarray(fmask)
    fed = fmask & (rec >= 0).all(axis=(2, 3))
    np.testing.assert_array_equal(rec[fed], own[fed])
    lengths = np.asarray(out.lengths)
    last = np.arange(B * G), 8 + lengths - 1
    assert (rec[last] == -1).all()  # the last token predicts nothing the update scores
    assert fed.sum(1).tolist() == (fmask.sum(1) - 1).tolist()  # all other real positions
    off = dataclasses.replace(SAMPLING, record_routes=False)
    tokens, mask = _prompts()
    none = generate(graphdef, copy, tokens, mask, jax.random.key(2), off, num_samples=G)
    assert none.routes is None


@pytest.mark.slow
def test_replay_makes_the_first_ratio_one_and_without_it_flipped_routes_move_it(
    rollout, one_device_mesh
):
    graphdef, params, _, out = rollout
    batch = _batch(graphdef, params, out)
    on = _first_step(graphdef, params, batch, one_device_mesh, router_replay="rollout")
    off = _first_step(graphdef, params, batch, one_device_mesh, router_replay="none")
    # pi_old rescored by the update itself (old_logps = "recompute"), under the same routes.
    again = _first_step(
        graphdef, params, batch, one_device_mesh, router_replay="rollout", old_logps="recompute"
    )
    for m in (on, again):
        assert m["moe/first_ratio_dev"] <= 1e-6, m["moe/first_ratio_dev"]
        np.testing.assert_allclose([m["train/ratio_min"], m["train/ratio_max"]], 1.0, atol=1e-6)
    off_dev = max(off["train/ratio_max"] - 1.0, 1.0 - off["train/ratio_min"])
    assert off_dev > 1e-3, off_dev
    assert 0.01 < on["moe/route_flip_frac"] < 0.9, on["moe/route_flip_frac"]
    assert on["moe/route_flip_layer_frac"] <= on["moe/route_flip_frac"]
    assert on["moe/abs_log_ratio_unreplayed"] > 1e-4
    assert on["moe/expert_load_imbalance"] >= 1.0
    assert not any(k.startswith("moe/") for k in off)


def test_replay_metrics_of_a_hand_made_case():
    """Two rows of three completion tokens after a prompt of one, one sparse layer, K = 2 of
    E = 4. Recorded [[0,1],[2,3],[0,1]] / [[0,1],[1,0],[-1,-1]]; own [[1,0],[2,0],[0,1]] /
    [[0,2],[0,1],[3,2]]. Tokens that count: row 0's three (flips: no, yes, no) and row 1's
    first two (yes, no); its third has no recorded route. With no token in the mask: NaN."""
    rec = -np.ones((2, 4, 1, 2), np.int8)
    rec[0, 1:, 0] = [[0, 1], [2, 3], [0, 1]]
    rec[1, 1:, 0] = [[0, 1], [1, 0], [-1, -1]]
    own = np.array([[[[1, 0]], [[2, 0]], [[0, 1]]], [[[0, 2]], [[0, 1]], [[3, 2]]]], np.int32)
    mask = np.array([[1, 1, 1], [1, 1, 1]], np.float32)
    own_lp = np.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]], np.float32)
    old_lp = np.array([[-1.0, -2.5, -3.0], [-1.5, -1.0, 0.0]], np.float32)
    m = replay.replay_metrics(rec, own, own_lp, old_lp, mask, num_experts=4)
    m = {k: float(v) for k, v in m.items()}
    assert m["moe/route_flip_frac"] == pytest.approx(2 / 5)
    assert m["moe/route_flip_layer_frac"] == pytest.approx(2 / 5)
    assert m["moe/abs_log_ratio_unreplayed"] == pytest.approx((0.5 + 0.5) / 5)
    # Picks of the 5 tokens: expert 0 x4, 1 x4, 2 x1, 3 x1; mean 10 / 4 = 2.5; max 4.
    assert m["moe/expert_load_imbalance"] == pytest.approx(4 / 2.5)
    empty = replay.replay_metrics(rec, own, own_lp, old_lp, 0 * mask, num_experts=4)
    assert all(np.isnan(float(v)) for v in empty.values())


def test_route_flips_ignore_the_order_within_a_set():
    a = np.array([[0, 1], [2, 3]])
    b = np.array([[1, 0], [2, 1]])
    assert np.asarray(moe_lib.route_flips(a, b)).tolist() == [False, True]


def test_the_batch_spec_carries_routes_only_with_replay(one_device_mesh):
    plain = batch_spec(rollout_batch_shardings(one_device_mesh), 4, 3, 2)
    assert plain.routes_NxSxRxK is None
    sh = rollout_batch_shardings(one_device_mesh, routes=True)
    spec = batch_spec(sh, 4, 3, 2, routes=(2, 4, jnp.int8))
    assert spec.routes_NxSxRxK.shape == (4, 5, 2, 4) and spec.routes_NxSxRxK.dtype == jnp.int8
    assert moe_lib.routes_dtype(127) == jnp.int8 and moe_lib.routes_dtype(128) == jnp.int16


def test_dynamic_sampling_widens_a_narrower_rounds_routes_like_its_prompts(one_device_mesh):
    """Rounds of prompts 2 and 3 wide: the kept groups' rows are gathered into one batch 3
    wide, the narrower round's prompts left-padded, and its routes [N, P + T, R, K] too, with
    -1 (no route), so that every position keeps its own experts."""
    from grpo_jax.rollout import rounds

    def out(p, base):  # one group of G = 2 rows, T = 2; routes' ids = base + position
        n, t = 2, 2
        routes = (base + np.arange(p + t)).reshape(1, p + t, 1, 1).repeat(n, 0).astype(np.int8)
        return (
            np.full((n, p), base, np.int32), np.ones((n, p), bool), np.zeros((n, t), np.int32),
            np.ones((n, t), bool), np.zeros((n, t), np.float32), np.zeros((n, t), np.float32),
            routes,
        )  # fmt: skip

    with jax.set_mesh(one_device_mesh):
        taken = rounds._assemble(
            [out(2, 10), out(3, 20)], jnp.asarray([1, 0]), group_size=2, pad_id=0,
            mesh=one_device_mesh,
        )  # fmt: skip
    prompts, pmask, routes = (np.asarray(taken[i]) for i in (0, 1, 6))
    assert routes.shape == (4, 5, 1, 1)
    assert prompts[:, 0].tolist() == [20, 20, 0, 0] and not pmask[2:, 0].any()
    assert routes[0, :, 0, 0].tolist() == [20, 21, 22, 23, 24]
    assert routes[2, :, 0, 0].tolist() == [-1, 10, 11, 12, 13]


@pytest.fixture(scope="module", params=["static", "paged"])
def episode_rollout(request):
    """Multi-turn episodes (scripted observations of 1 to 3 tokens) played by the moved copy
    on each engine: (graphdef, params, copy, the transcripts as a SampleOutput's fields, the
    observation tokens the rows fed [N, P + T])."""
    graphdef, params = nnx.split(create_model(CFG, seed=0))
    copy = _moved(params)
    toks, mask = pad_prompts(PROMPTS, pad_id=0, buckets=(8,))
    cfg = episodes.MultiTurnConfig(max_tokens=24, max_turns=4, max_obs_tokens=4, max_turn_tokens=5)
    s = dataclasses.replace(SAMPLING, max_new_tokens=1, eos_ids=EOS, engine=request.param)
    ep = episodes.run_episodes(
        graphdef, copy, _envs(G), toks, mask, jax.random.key(2), sampling=s, cfg=cfg,
        encode_observation=encode_obs, decode=decode, num_samples=G,
    )  # fmt: skip
    fed = np.arange(ep.tokens_NxT.shape[1])[None] < (ep.lengths_N - 1)[:, None]
    obs = np.concatenate([np.zeros_like(ep.prompt_mask_NxP), fed & ~ep.mask_NxT], axis=1)
    out = types.SimpleNamespace(
        prompt_tokens=jnp.asarray(ep.prompt_tokens_NxP),
        prompt_mask=jnp.asarray(ep.prompt_mask_NxP),
        tokens=jnp.asarray(ep.tokens_NxT),
        mask=jnp.asarray(ep.mask_NxT),
        routes=ep.routes_NxSxRxK,
    )
    return graphdef, params, copy, out, obs


def _full_pass_routes(graphdef, params, out):
    """The experts one full pass of ``params`` chooses over [prompt | transcript] (a
    transcript ends with a model token: its real tokens end with its mask's last)."""
    span = np.flip(np.cumsum(np.flip(np.asarray(out.mask), 1), 1) > 0, 1)
    seq = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, jnp.asarray(span)], axis=1)
    return np.asarray(nnx.merge(graphdef, params).routed_features(seq, mask_BxT=mask)[1])


@pytest.mark.slow
def test_replay_of_multi_turn_transcripts_makes_the_first_ratio_one(
    episode_rollout, one_device_mesh
):
    """pi_old here is the policy under the routing a full pass of the rollout's copy chooses
    over each whole transcript, computed apart from the sampler: the update's replay of the
    recorded routes gives ratio 1 to 1e-6 only if they hold the copy's experts at every
    position, the observation tokens' included, some of which the policy would route
    otherwise. Without replay, routes flip and the ratio moves."""
    graphdef, params, copy, out, obs = episode_rollout
    copy_routes = _full_pass_routes(graphdef, copy, out)
    own_routes = _full_pass_routes(graphdef, params, out)
    assert obs.sum() >= 10
    flipped_obs = moe_lib.route_flips(own_routes[obs], copy_routes[obs]).any(-1)
    assert np.asarray(flipped_obs).any(), "no observation token routes otherwise"
    batch = _batch(graphdef, params, out, pi_old_routes=copy_routes)
    on = _first_step(graphdef, params, batch, one_device_mesh, router_replay="rollout")
    off = _first_step(graphdef, params, batch, one_device_mesh, router_replay="none")
    assert on["moe/first_ratio_dev"] <= 1e-6, on["moe/first_ratio_dev"]
    np.testing.assert_allclose([on["train/ratio_min"], on["train/ratio_max"]], 1.0, atol=1e-6)
    off_dev = max(off["train/ratio_max"] - 1.0, 1.0 - off["train/ratio_min"])
    assert off_dev > 1e-3, off_dev
    assert 0.01 < on["moe/route_flip_frac"] < 0.9, on["moe/route_flip_frac"]
