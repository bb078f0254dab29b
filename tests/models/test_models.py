"""The NNX transformer on its own: config validation, masking, KV-cache decoding, remat."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.models import (
    ModelConfig,
    RopeScaling,
    create_model,
    family_config,
    positions_from_mask,
    tiny_config,
)
from grpo_jax.run.config import ConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3")


def small_config(family: str, **overrides) -> ModelConfig:
    fields = dict(
        vocab_size=97,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=48,
        rope_theta=10_000.0,
    )
    if family == "gemma3":  # Window 3 binds within the test sequences.
        fields.update(
            sliding_window=3,
            layer_types=("sliding_attention", "full_attention", "sliding_attention"),
            final_logit_softcap=30.0,
            attn_logit_softcap=50.0,
        )
    if family == "gpt_oss":  # Window 3 binds; layers slide, attend globally, slide.
        fields.update(
            sliding_window=3,
            tie_embeddings=False,
            rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16),
        )
    if family == "llama":
        fields.update(
            tie_embeddings=False,
            rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16),
        )
    fields.update(overrides)
    return family_config(family, **fields)


def random_model(cfg: ModelConfig, seed: int = 0):
    """A model whose norms and biases are random too, so that every parameter matters."""
    model = create_model(cfg, seed=seed)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(seed + 1)
    noisy = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype), params)
    return nnx.merge(graphdef, noisy)


def jitted(model):
    """model(tokens, mask_BxT=..., positions_BxT=...) compiled once (eager dispatch is slow)."""
    graphdef, params = nnx.split(model)
    f = jax.jit(lambda p, t, m, pos: nnx.merge(graphdef, p)(t, mask_BxT=m, positions_BxT=pos))
    return lambda tokens, mask_BxT=None, positions_BxT=None: f(
        params, tokens, mask_BxT, positions_BxT
    )


def left_padded_batch(lengths, T, vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(len(lengths), T)).astype(np.int32)
    mask = np.zeros((len(lengths), T), bool)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = True
    return jnp.asarray(np.where(mask, tokens, 0)), jnp.asarray(mask)


# ---------------------------------------------------------------------------
# Config.


def test_tiny_config_is_a_few_million_parameters():
    cfg = tiny_config(vocab_size=300)
    assert cfg.family == "qwen2" and cfg.tie_embeddings and cfg.qkv_bias
    model = create_model(cfg)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    assert n == cfg.num_params
    assert 2_000_000 < n < 6_000_000
    assert tiny_config(300, family="llama", num_layers=2).num_layers == 2


def test_config_is_hashable_and_canonicalises_dtypes():
    a = tiny_config(100, dtype=jnp.bfloat16, eos_token_id=[3, 4])
    b = tiny_config(100, dtype="bfloat16", eos_token_id=(3, 4))
    assert a == b and hash(a) == hash(b)
    assert a.dtype == "bfloat16" and a.compute_dtype == jnp.bfloat16
    assert a.eos_token_ids == (3, 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(family="gpt2"), "'model.family' = 'gpt2' is not one of"),
        (dict(num_kv_heads=3), "'model.num_kv_heads' = 3 must divide model.num_heads = 4"),
        (dict(head_dim=7), "'model.head_dim' = 7 must be even"),
        (dict(hidden_size=0), "'model.hidden_size' = 0 must be >= 1"),
        (dict(dtype="int8"), "'model.dtype' = 'int8' is not one of"),
        (dict(activation="relu"), "'model.activation' = 'relu' is not one of"),
        (dict(layer_types=("full_attention",)), "'model.layer_types' has 1 entries"),
        (
            dict(layer_types=("sliding_attention",) * 4),
            "'model.sliding_window' is None, but model.layer_types has 'sliding_attention'",
        ),
        (dict(layer_types=("local",) * 4, sliding_window=4), "'model.layer_types[0]' = 'local'"),
        (dict(rope_scaling={"factor": 8}), "'model.rope_scaling' = {'factor': 8} must be a"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        tiny_config(100, **overrides)


def test_rope_scaling_errors():
    with pytest.raises(ConfigError, match="'rope_scaling.kind' = 'dynamic' is not one of"):
        RopeScaling("dynamic", 2.0)
    with pytest.raises(ConfigError, match="'rope_scaling.beta_fast' = -1.0"):
        RopeScaling("yarn", 2.0, beta_fast=-1.0)
    with pytest.raises(ConfigError, match="high_freq_factor = 1.0 must be > low_freq_factor"):
        RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=1.0)


def test_unknown_layout_is_an_error():
    with pytest.raises(ValueError, match="unknown sharding layout 'zero3'"):
        create_model(small_config("qwen2"), layout="zero3")


# ---------------------------------------------------------------------------
# The forward pass.


@pytest.mark.slow
def test_state_is_params_only_and_jits_as_a_pure_function():
    model = random_model(small_config("qwen3"))
    graphdef, params = nnx.split(model)
    assert all(
        isinstance(v, nnx.Param)
        for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    )
    assert len(nnx.state(model, nnx.Not(nnx.Param))) == 0
    tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
    f = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    np.testing.assert_allclose(
        f(params, tokens), nnx.jit(lambda m, t: m(t))(model, tokens), atol=1e-6
    )
    assert f(params, tokens).dtype == jnp.float32


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
@pytest.mark.slow
def test_left_padding_equals_the_unpadded_rows(family):
    """Masked pads change nothing: each padded row's real logits equal its own forward pass."""
    cfg = small_config(family)
    model = jitted(random_model(cfg))
    lengths, T = (7, 4, 1), 7
    tokens, mask = left_padded_batch(lengths, T, cfg.vocab_size)
    logits = model(tokens, mask_BxT=mask)
    assert np.isfinite(np.asarray(logits)).all()
    for b, n in enumerate(lengths):
        alone = model(tokens[b : b + 1, T - n :])
        np.testing.assert_allclose(logits[b, T - n :], alone[0], atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_explicit_positions_are_used():
    """RoPE sees relative positions: a uniform shift changes nothing, a gap does."""
    model = jitted(random_model(small_config("llama")))
    tokens = jnp.arange(6, dtype=jnp.int32)[None]
    base = model(tokens)
    shifted = model(tokens, positions_BxT=jnp.arange(6)[None] + 3)
    gap = model(tokens, positions_BxT=jnp.array([[0, 1, 2, 3, 4, 9]]))
    np.testing.assert_allclose(base, shifted, atol=1e-5)
    np.testing.assert_allclose(base[:, :5], gap[:, :5], atol=1e-6)
    assert np.abs(base[:, 5] - gap[:, 5]).max() > 1e-3


def test_positions_from_mask():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], bool)
    expected = [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    np.testing.assert_array_equal(positions_from_mask(mask), expected)


@pytest.mark.slow
def test_sliding_window_limits_what_a_layer_sees():
    """Changing a token further back than the window changes only global layers' view."""
    local = small_config("gemma3", layer_types=("sliding_attention",) * 3)
    model = jitted(random_model(local))
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, local.vocab_size, (1, 8)), jnp.int32)
    edited = tokens.at[0, 0].set((tokens[0, 0] + 1) % local.vocab_size)
    a, b = model(tokens), model(edited)
    # 3 layers of window 3: position p sees back to p - 3*2; position 7 no longer sees 0.
    np.testing.assert_allclose(a[0, 7], b[0, 7], atol=1e-6)
    assert np.abs(a[0, 6] - b[0, 6]).max() > 1e-4
    mixed = jitted(random_model(small_config("gemma3")))
    a, b = mixed(tokens), mixed(edited)
    assert np.abs(a[0, 7] - b[0, 7]).max() > 1e-4


# ---------------------------------------------------------------------------
# KV cache.


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_cache_decoding_equals_the_full_forward_pass(family):
    """Prefill a left-padded batch, then decode one token at a time; every step's logits
    equal those of the full (masked) forward pass over the whole sequence."""
    cfg = small_config(family)
    model = random_model(cfg)
    lengths, P, N = (5, 3, 1), 5, 6
    S = P + N + 2  # Spare slots at the end stay masked.
    prompt, prompt_mask = left_padded_batch(lengths, P, cfg.vocab_size, seed=1)
    rng = np.random.default_rng(2)
    continuation = jnp.asarray(rng.integers(0, cfg.vocab_size, (len(lengths), N)), jnp.int32)
    tokens = jnp.concatenate([prompt, continuation], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones_like(continuation, bool)], axis=1)
    full = jitted(model)(tokens, mask_BxT=mask)
    positions = positions_from_mask(mask)

    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, tokens, positions, kv_mask, cache, index):
        return nnx.merge(graphdef, params).forward_with_cache(
            tokens, positions_BxT=positions, kv_mask_BxS=kv_mask, cache=cache, cache_index=index
        )

    cache = model.init_cache(len(lengths), S)
    K, Dh = cfg.num_kv_heads, cfg.head_dim
    assert [c.shape for c in cache["k"]] == [(len(lengths), K, S, Dh)] * cfg.num_layers
    assert [c.shape for c in cache["v"]] == [(len(lengths), K, Dh, S)] * cfg.num_layers
    kv_mask = jnp.zeros((len(lengths), S), bool).at[:, :P].set(prompt_mask)
    logits, cache = step(params, prompt, positions[:, :P], kv_mask, cache, jnp.int32(0))
    real = np.asarray(prompt_mask)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(full[:, :P])[real], atol=2e-5)
    for t in range(P, P + N):
        kv_mask = kv_mask.at[:, t].set(True)
        logits, cache = step(
            params, tokens[:, t : t + 1], positions[:, t : t + 1], kv_mask, cache, jnp.int32(t)
        )
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=2e-5, rtol=1e-5)


def test_cache_is_in_the_compute_dtype():
    model = create_model(small_config("qwen2", dtype="bfloat16", param_dtype="bfloat16"))
    cache = model.init_cache(2, 4)
    assert {c.dtype for c in cache["k"] + cache["v"]} == {jnp.dtype(jnp.bfloat16)}
    logits = jitted(model)(jnp.zeros((2, 3), jnp.int32))
    assert logits.dtype == jnp.float32


@pytest.mark.slow
def test_mixed_precision_float32_params_bfloat16_compute():
    cfg = small_config("qwen3")
    model = random_model(cfg)
    graphdef, params = nnx.split(model)
    mixed = nnx.merge(nnx.split(create_model(cfg.replace(dtype="bfloat16")))[0], params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    exact, approx = jitted(model)(tokens), jitted(mixed)(tokens)
    assert mixed.layers[0].attn.q_proj[...].dtype == jnp.float32
    assert approx.dtype == jnp.float32
    assert 1e-4 < np.abs(exact - approx).max() < 0.05


# ---------------------------------------------------------------------------
# Rematerialisation.


@pytest.mark.slow
def test_remat_gives_the_same_loss_and_gradients():
    cfg = small_config("gemma3")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)

    def loss_and_grad(remat):
        graphdef, params = nnx.split(random_model(cfg.replace(remat=remat)))

        def loss(p):
            logits = nnx.merge(graphdef, p)(tokens)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

        return jax.jit(jax.value_and_grad(loss))(params)

    (l0, g0), (l1, g1) = loss_and_grad(False), loss_and_grad(True)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_prefill_last_only_equals_the_last_column(tiny_model_config):
    cfg = tiny_model_config.replace(vocab_size=64)
    model = create_model(cfg, seed=0)
    tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) % 64
    kw = dict(
        positions_BxT=jnp.broadcast_to(jnp.arange(5), (2, 5)),
        kv_mask_BxS=jnp.ones((2, 8), bool).at[:, 5:].set(False),
        cache_index=0,
    )
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="last_only")
    def forward(params, last_only):  # one program each, not ~90 op-by-op compilations
        m = nnx.merge(graphdef, params)
        return m.forward_with_cache(tokens, cache=m.init_cache(2, 8), last_only=last_only, **kw)

    full, _ = forward(params, last_only=False)
    last, _ = forward(params, last_only=True)
    assert last.shape == (2, 1, 64)
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=1e-6, atol=1e-6)
