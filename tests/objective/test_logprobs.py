"""Completion log-probs: completion positions only, chunked log-probs, the prompt once per group."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_batches import grouped_batch
from helpers_jit import completion_logps

from grpo_jax import models
from grpo_jax.objective import logprobs

N, P, T, V = 8, 6, 5, 100


def _rows(b):
    """The four row arrays of a batch dict, in the order the log-prob functions take them."""
    return b["prompt_tokens"], b["prompt_mask"], b["tokens"], b["mask"]


@pytest.fixture(scope="module")
def setup(tiny_policy, tiny_model_config):
    assert tiny_model_config.vocab_size == V
    graphdef, params = tiny_policy
    rng = np.random.default_rng(0)
    pm = np.ones((N, P), bool)
    pm[:, :2] = False
    m = np.ones((N, T), bool)
    m[::2, 3:] = False
    batch = dict(
        prompt_tokens=rng.integers(4, V, (N, P)).astype(np.int32),
        prompt_mask=pm,
        tokens=rng.integers(4, V, (N, T)).astype(np.int32),
        mask=m,
    )
    return graphdef, params, batch


def test_completion_logits_score_only_the_completion_positions(setup):
    graphdef, params, batch = setup
    full = np.concatenate([batch["prompt_tokens"], batch["tokens"]], axis=1)
    full_mask = np.concatenate([batch["prompt_mask"], batch["mask"]], axis=1)
    forward = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, mask_BxT=m))
    want = forward(params, full, full_mask)[:, P - 1 : P + T - 1]
    got = jax.jit(functools.partial(logprobs.completion_logits, graphdef))(params, *_rows(batch))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_chunked_scores_equal_unchunked_in_value_and_gradient(setup):
    graphdef, params, batch = setup
    rng = np.random.default_rng(1)
    b6 = dict(batch, tokens=rng.integers(4, V, (N, 6)).astype(np.int32), mask=np.ones((N, 6), bool))

    @functools.partial(jax.jit, static_argnums=1)  # one program per chunk size, not op by op
    def scores(p, chunk):
        return logprobs.completion_logps_and_entropy(
            graphdef, p, *_rows(b6), 0.7, chunk_size=chunk, with_entropy=True
        )

    def loss(p, chunk):
        logps, ent = scores(p, chunk)
        return (logps * jnp.arange(1.0, 7.0)).sum() + ent.sum()  # entropy: no gradient

    (l0, g0), (l2, g2) = (
        jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, c) for c in (0, 2)
    )
    (lp0, e0), (lp2, e2) = scores(params, 0), scores(params, 3)
    np.testing.assert_allclose(np.asarray(lp2), np.asarray(lp0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(e2), np.asarray(e0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(l2), float(l0), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(g2), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=2e-6)
    # The entropy term carries no gradient: the same loss without it has the same gradient.
    g_lp = jax.jit(jax.grad(lambda p: (scores(p, 0)[0] * jnp.arange(1.0, 7.0)).sum()))(params)
    for x, y in zip(jax.tree.leaves(g_lp), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=2e-6)
    # completion_logps is the log-prob half of completion_logps_and_entropy.
    logps = jax.jit(lambda p: logprobs.completion_logps(graphdef, p, *_rows(b6), 0.7, chunk_size=3))
    np.testing.assert_array_equal(np.asarray(logps(params)), np.asarray(lp2))
    with pytest.raises(ValueError, match="chunk_size = 4 must divide the completion length T = 6"):
        scores(params, 4)


@pytest.mark.slow
def test_chunked_scoring_never_holds_all_the_logits(tiny_model_config):
    """XLA's own buffer plan: chunking bounds the backward pass's float32 logits."""
    cfg = tiny_model_config.replace(vocab_size=4096)
    graphdef, params = nnx.split(models.create_model(cfg))
    n, t = 4, 128
    rows = (
        np.ones((n, 8), np.int32),
        np.ones((n, 8), bool),
        np.ones((n, t), np.int32),
        np.ones((n, t), bool),
    )

    def temp_bytes(chunk):
        def loss(p):
            return logprobs.completion_logps(graphdef, p, *rows, 1.0, chunk_size=chunk).sum()

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(0), temp_bytes(16)
    assert whole > 2 * n * t * 4096 * 4  # the float32 logits and their gradient at once
    assert 3 * chunked < whole  # measured 19.7 MB vs 4.8 MB


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.slow
def test_prompt_run_once_per_group_equals_once_per_row(family):
    cfg = models.tiny_config(
        V, family=family, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, mlp_dim=64, sliding_window=4 if family == "gemma3" else None,
    )  # fmt: skip
    graphdef, params = nnx.split(models.create_model(cfg))
    b = grouped_batch(np.random.default_rng(0), 3, 4, 7, 6, V)

    def loss(p, g):
        logps, ent = logprobs.completion_logps_and_entropy(
            graphdef, p, *_rows(b), 0.9, group_size=g, with_entropy=True
        )
        return (logps * b["mask"]).sum(), (logps, ent)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l1, (lp1, e1)), g1 = grad(params, 1)
    (l4, (lp4, e4)), g4 = grad(params, 4)
    m = b["mask"]
    np.testing.assert_allclose(np.asarray(lp4) * m, np.asarray(lp1) * m, atol=2e-6)
    np.testing.assert_allclose(np.asarray(e4) * m, np.asarray(e1) * m, atol=2e-6)
    np.testing.assert_allclose(float(l4), float(l1), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(g4), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_prompt_once_per_group_with_one_completion_token(setup):
    graphdef, params, _ = setup
    b = grouped_batch(np.random.default_rng(5), 2, 4, 5, 1, V)
    b["mask"][:] = True
    one = completion_logps(graphdef, params, *_rows(b), 1.0, group_size=4)
    per_row = completion_logps(graphdef, params, *_rows(b), 1.0)
    np.testing.assert_allclose(np.asarray(one), np.asarray(per_row), atol=2e-6)
