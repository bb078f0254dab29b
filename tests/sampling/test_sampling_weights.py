"""The sampler's copy of the policy in another dtype (grpo_jax.sampling.weights).

The copy must compute exactly as a model built in that dtype from the start
(same graph, same weights), leave the trained parameters as they are, keep each
parameter's sharding, and cast floating parameters only.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.core import sharding
from grpo_jax.models import create_model, lora
from grpo_jax.rollout.rounds import Policy, Rollouts
from grpo_jax.sampling.static import SamplingConfig, generate, pad_prompts
from grpo_jax.sampling.weights import sampler_weights

PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]  # left padding on the second row


def _floating_params(params):
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [
        v
        for v in leaves
        if isinstance(v, nnx.Param) and jnp.issubdtype(v.value.dtype, jnp.floating)
    ]


@pytest.mark.slow
def test_the_copy_samples_as_a_model_built_in_bfloat16(tiny_policy, tiny_model_config):
    graphdef, params = tiny_policy
    w = sampler_weights(graphdef, params, "bfloat16")
    copy = w(params)
    assert w.dtype == "bfloat16"
    assert {str(v.value.dtype) for v in _floating_params(copy)} == {"bfloat16"}
    # The trained parameters are not touched.
    assert {str(v.value.dtype) for v in _floating_params(params)} == {"float32"}

    # The same weights in a model whose config says bfloat16 from the start.
    cfg16 = dataclasses.replace(tiny_model_config, dtype="bfloat16", param_dtype="bfloat16")
    graphdef16, _ = nnx.split(create_model(cfg16, seed=1))
    assert nnx.merge(w.graphdef, copy).config == cfg16

    tokens, mask = pad_prompts(PROMPTS, pad_id=0, buckets=(8,))
    cfg = SamplingConfig(max_new_tokens=6, greedy=True, pad_id=0)
    key = jax.random.key(0)
    got = generate(w.graphdef, copy, tokens, mask, key, cfg)
    want = generate(graphdef16, copy, tokens, mask, key, cfg)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logps, want.logps)  # bit for bit: one graph
    # And it is not the float32 policy: its log-probs differ by bfloat16's rounding.
    full = generate(graphdef, params, tokens, mask, key, cfg)
    diff = np.abs(np.asarray(full.logps) - np.asarray(got.logps))[np.asarray(got.mask)]
    assert 0 < diff.max() < 0.1

    # A copy is not cast again.
    assert w(copy) is copy


@pytest.mark.slow  # about 1.7 s: the fast tier stays under 90 s cold
def test_the_copy_keeps_shardings_and_leaves_integer_variables_alone(tiny_model_config):
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4}, jax.devices()[:8])
    graphdef, params = nnx.split(create_model(tiny_model_config, seed=0, mesh=mesh))
    # LoRA with dropout adds integer layer indices (lora.LoRAIndex) beside float adapters.
    cfg = lora.LoRAConfig(rank=2, dropout=0.1)
    graphdef, params, _ = lora.attach_params(graphdef, params, cfg, jax.random.key(1), mesh=mesh)
    w = sampler_weights(graphdef, params, "bfloat16")
    copy = w(params)
    before = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    after = jax.tree.leaves(copy, is_leaf=lambda x: isinstance(x, nnx.Variable))
    kinds = set()
    for a, b in zip(before, after, strict=True):
        assert b.value.sharding.is_equivalent_to(a.value.sharding, a.value.ndim)
        if jnp.issubdtype(a.value.dtype, jnp.floating):
            assert b.value.dtype == jnp.bfloat16, type(a).__name__
        else:
            assert b.value.dtype == a.value.dtype and type(b) is type(a)
            np.testing.assert_array_equal(b.value, a.value)
        kinds.add(type(a).__name__)
    assert "LoRAIndex" in kinds and any("fsdp" in str(v.value.sharding.spec) for v in after)


def test_a_graph_without_a_model_config_is_refused():
    class Plain(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((2,)))

    graphdef, params = nnx.split(Plain())
    with pytest.raises(ValueError, match="no ModelConfig"):
        sampler_weights(graphdef, params, "bfloat16")


def test_rollouts_sample_with_the_copy_only_when_there_is_one(tiny_policy):
    graphdef, params = tiny_policy
    fields = dict(encoder=None, scorer=None, sampling=None, grpo=None, batch_size=1, placement=None)
    policy = Policy(graphdef=graphdef, tokenizer=None)
    assert Rollouts(policy=policy, **fields).sampler_policy(params) == (graphdef, params)
    w = sampler_weights(graphdef, params, "bfloat16")
    r = Rollouts(policy=policy, sampler_weights=w, **fields)
    got_graphdef, got = r.sampler_policy(params)
    assert got_graphdef is w.graphdef
    assert {str(v.value.dtype) for v in _floating_params(got)} == {"bfloat16"}


def test_the_key_names_a_bad_dtype_and_the_log_prob_source_is_warned_about():
    from helpers_config import smoke_config

    from grpo_jax.run.builders import sampler_dtype_warning
    from grpo_jax.run.config import ConfigError, parse_config
    from grpo_jax.sampling.config import SamplingSection

    with pytest.raises(ConfigError, match=r"'sampling.param_dtype' = 'bf16' is not one of"):
        SamplingSection.from_mapping({"max_new_tokens": 4, "param_dtype": "bf16"})
    assert SamplingSection.from_mapping({"max_new_tokens": 4}).param_dtype == ""
    copy = types.SimpleNamespace(dtype="bfloat16")
    run = parse_config(smoke_config(**{"sampling.param_dtype": "bfloat16"}))
    assert "grpo.old_logps = 'recompute'" in sampler_dtype_warning(run, copy)
    run = parse_config(
        smoke_config(**{"sampling.param_dtype": "bfloat16", "grpo.old_logps": "recompute"})
    )
    assert sampler_dtype_warning(run, copy) is None
