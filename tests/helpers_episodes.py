"""Shared by several test folders; moved from test_episodes.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers_jit import completion_logps

from grpo_jax.models import create_model, tiny_config
from grpo_jax.objective import losses
from grpo_jax.rollout import episodes as multiturn
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

V = 48


EOS = (2, 3, 4)  # turns end at any of these: rows end their turns at different times


PROMPTS = [[5, 9, 12], [7], [11, 12, 13, 14, 15, 16], [40, 33]]


class ScriptedEnv:
    """Answers turn k with observation ``obs[k]`` (token ids as text); done after the last."""

    def __init__(self, obs, rewards=None):
        self.obs, self.turn = obs, 0
        self.rewards = rewards or [0.25] * (len(obs) + 1)

    def reset(self, example):
        return None

    def step(self, text):
        self.turn += 1
        if self.turn > len(self.obs):
            return None, self.rewards[self.turn - 1], True, {"success": True}
        return self.obs[self.turn - 1], self.rewards[self.turn - 1], False, {}


def encode_obs(observation, *, ended_with_eos):
    del ended_with_eos
    return [int(x) for x in observation.split()]


def decode(ids):
    return " ".join(map(str, ids))


def _model(family, **extra):
    cfg = tiny_config(
        V,
        family=family,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        **extra,
    )
    graphdef, params = nnx.split(create_model(cfg, seed=1))
    # Sharper logits than the random init's: turns of varied lengths, distinct log-probs.
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return graphdef, params


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(params, seq_NxL, mask_NxL, *, graphdef):
    return nnx.merge(graphdef, params)(seq_NxL, mask_BxT=mask_NxL)


def full_forward_logps(graphdef, params, ep, temperature):
    """Log-probs of every transcript token: one plain forward pass over [prompt | transcript]."""
    p, t = ep.prompt_tokens_NxP.shape[1], ep.tokens_NxT.shape[1]
    real_NxT = np.arange(t)[None, :] < ep.lengths_N[:, None]
    seq = jnp.concatenate([ep.prompt_tokens_NxP, ep.tokens_NxT], axis=1)
    mask = jnp.concatenate([ep.prompt_mask_NxP, real_NxT], axis=1)
    logits = _forward(params, seq, mask, graphdef=graphdef)
    return np.asarray(
        losses.per_token_logps(
            logits[:, p - 1 : p - 1 + t], jnp.asarray(ep.tokens_NxT), temperature=temperature
        )
    )


def _envs(g):
    scripts = [
        ["20 21 22", "23"],  # three turns, observations of 3 then 1 tokens
        ["24"],  # two turns
        [],  # ends after its first turn
        ["25 26", "27 28 29", "30"],
    ]
    return [ScriptedEnv(scripts[(i // g + i) % 4]) for i in range(len(PROMPTS) * g)]


def _run(graphdef, params, *, g=2, temperature=1.0, key=0, **cfg_kw):
    toks, mask = pad_prompts(PROMPTS, pad_id=0, buckets=(8,))
    cfg = multiturn.MultiTurnConfig(
        **{"max_tokens": 40, "max_turns": 4, "max_obs_tokens": 4, **cfg_kw}
    )
    sampling = SamplingConfig(
        max_new_tokens=1, temperature=temperature, eos_ids=EOS, pad_id=0, prompt_buckets=(8,)
    )
    return multiturn.run_episodes(
        graphdef,
        params,
        _envs(g),
        toks,
        mask,
        jax.random.key(key),
        sampling=sampling,
        cfg=cfg,
        encode_observation=encode_obs,
        decode=decode,
        num_samples=g,
    )


def _check_exact(graphdef, params, ep, temperature=1.0, atol=2e-5, group_size=2, update=True):
    model_NxT = ep.mask_NxT.astype(bool)
    assert (
        model_NxT.any()
        and (~model_NxT & (np.arange(ep.tokens_NxT.shape[1]) < ep.lengths_N[:, None])).any()
    ), "no environment tokens: the test would prove nothing"
    want = full_forward_logps(graphdef, params, ep, temperature)
    np.testing.assert_allclose(ep.logps_NxT[model_NxT], want[model_NxT], atol=atol, rtol=0)
    assert (ep.logps_NxT[~model_NxT] == 0).all()
    if not update:
        return
    # The update's own scoring path (shared prompt, loss mask = model tokens) agrees too.
    got = completion_logps(
        graphdef,
        params,
        jnp.asarray(ep.prompt_tokens_NxP),
        jnp.asarray(ep.prompt_mask_NxP),
        jnp.asarray(ep.tokens_NxT),
        jnp.asarray(ep.mask_NxT),
        temperature,
        group_size=group_size,
    )
    np.testing.assert_allclose(np.asarray(got)[model_NxT], want[model_NxT], atol=atol, rtol=0)
