"""Routing replay's routes of multi-turn episodes (docs/moe.md, docs/multiturn.md): both
engines record, at every position of [prompt | transcript] they fed, model and observation
tokens alike, the experts one full forward pass over the whole transcript chooses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_episodes import EOS, PROMPTS, _envs, _model, decode, encode_obs

from grpo_jax.rollout import episodes as multiturn
from grpo_jax.sampling import paged
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

# Each engine's settings: the paged one with prompts in chunks of 3 over pages of 4 and
# fewer slots than rows (rows queue for slots between turns).
ENGINES = {"static": {}, "paged": dict(engine="paged", page_size=4, prefill_chunk=3, slots=3)}
G = 2


@pytest.fixture(scope="module")
def moe():
    """A tiny Qwen3-MoE (2 sparse layers, top 2 of 8 experts) with sharp logits."""
    return _model("qwen3_moe", num_experts=8, experts_per_token=2, moe_mlp_dim=16)


def _play(policy, engine: str, record: bool = True):
    toks, mask = pad_prompts(PROMPTS, pad_id=0, buckets=(8,))
    cfg = multiturn.MultiTurnConfig(max_tokens=40, max_turns=4, max_obs_tokens=4, max_turn_tokens=5)
    s = SamplingConfig(
        max_new_tokens=1, eos_ids=EOS, pad_id=0, prompt_buckets=(8,), record_routes=record,
        **ENGINES[engine],
    )  # fmt: skip
    return multiturn.run_episodes(
        *policy, _envs(G), toks, mask, jax.random.key(0), sampling=s, cfg=cfg,
        encode_observation=encode_obs, decode=decode, num_samples=G,
    )  # fmt: skip


def _full_pass_routes(policy, ep):
    """One forward pass over each row's [prompt | transcript] -> (its routes [N, P + T, R, K],
    the positions a sampler feeds: real prompt tokens and every transcript token but the
    last, which predicts nothing)."""
    t = ep.tokens_NxT.shape[1]
    real = np.arange(t)[None] < ep.lengths_N[:, None]
    seq = jnp.concatenate([ep.prompt_tokens_NxP, ep.tokens_NxT], axis=1)
    mask = jnp.asarray(np.concatenate([ep.prompt_mask_NxP, real], axis=1))
    _, full = nnx.merge(*policy).routed_features(seq, mask_BxT=mask)
    fed_NxT = np.arange(t)[None] < (ep.lengths_N - 1)[:, None]
    return np.asarray(full), np.concatenate([ep.prompt_mask_NxP, fed_NxT], axis=1)


@pytest.mark.slow  # compiles the episodes of a mixture of experts (~15 s an engine)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_recorded_routes_equal_a_full_pass_at_model_and_observation_tokens(moe, engine):
    ep = _play(moe, engine)
    p, t = ep.prompt_tokens_NxP.shape[1], ep.tokens_NxT.shape[1]
    rec = ep.routes_NxSxRxK
    assert rec.shape == (len(PROMPTS) * G, p + t, 2, 2) and rec.dtype == np.int8
    full, fed = _full_pass_routes(moe, ep)
    # Observation tokens the rows fed: transcript tokens the model did not write.
    obs = np.zeros_like(fed)
    obs[:, p:] = ~ep.mask_NxT & fed[:, p:]
    assert ep.turns_N.max() >= 3 and obs.sum() >= 10, "no observations: the test proves nothing"
    assert (rec[fed] >= 0).all()  # every fed position has its experts, observations' too
    np.testing.assert_array_equal(rec[fed], full[fed])
    np.testing.assert_array_equal(rec[obs], full[obs])
    unfed = ~fed
    if engine == "static":  # its prefill runs the padding too, as the single-turn sampler's
        unfed[:, :p] = False
    assert (rec[unfed] == -1).all()  # a row's last token and after it (the paged: padding)


@pytest.mark.slow  # compiles the episodes twice
@pytest.mark.parametrize("engine", list(ENGINES))
def test_no_routes_without_record_routes_or_experts(moe, engine):
    """Routes only when asked for on a mixture of experts; the paged engine's programs are
    then those of a run without routing replay (the same cache entry)."""
    assert _play(moe, engine, record=False).routes_NxSxRxK is None
    dense = _model("qwen3")
    assert _play(dense, engine, record=True).routes_NxSxRxK is None
    if engine == "paged":
        s = SamplingConfig(
            max_new_tokens=1, eos_ids=EOS, pad_id=0, prompt_buckets=(8,), **ENGINES["paged"]
        )
        misses = paged._compiled.cache_info().misses
        paged._compiled(moe[0], s, G, 4)
        assert paged._compiled.cache_info().misses == misses
