"""The sampler on the real transformer: parity with full forward passes, sharding, no recompiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.core.sharding import batch_shards, make_mesh
from grpo_jax.models import create_model, tiny_config
from grpo_jax.objective import losses
from grpo_jax.sampling import static as sampling
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

V = 64
MODEL_CFG = tiny_config(
    V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6], [60, 33], [8, 8, 8, 8, 8], [3, 1], [40], [2, 4, 6]]


def _sharpen(params):
    # Random init gives near-uniform logits; a larger scale makes the argmax
    # well separated and the sampling distribution far from uniform.
    return jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)


@pytest.fixture(scope="module")
def model():
    m = create_model(MODEL_CFG, seed=0)
    graphdef, params = nnx.split(m)
    return nnx.merge(graphdef, _sharpen(params))


def _pad(prompts, buckets=(8, 16)):
    return pad_prompts(prompts, pad_id=0, buckets=buckets)


@functools.partial(jax.jit, static_argnames="graphdef")
def _forward(params, seq_NxL, mask_NxL, *, graphdef):
    return nnx.merge(graphdef, params)(seq_NxL, mask_BxT=mask_NxL)


def _full_logps(model, out, temperature):
    """per_token_logps of one full forward pass over [prompt | completion]."""
    p, t = out.prompt_tokens.shape[1], out.tokens.shape[1]
    seq = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.mask.astype(bool)], axis=1)
    graphdef, params = nnx.split(model)
    logits = _forward(params, seq, mask, graphdef=graphdef)
    return losses.per_token_logps(logits[:, p - 1 : p - 1 + t], out.tokens, temperature=temperature)


@pytest.mark.slow
def test_greedy_equals_stepwise_full_forward_argmax(model):
    cfg = SamplingConfig(max_new_tokens=6, greedy=True, prompt_buckets=(8, 16))
    graphdef, params = nnx.split(model)
    toks, mask = _pad(PROMPTS[:4])
    out = sampling.generate(graphdef, params, toks, mask, jax.random.key(0), cfg)
    # Reference: the unpadded prompt plus the tokens so far, right-padded to a
    # fixed length (causal attention never looks right), one full forward per
    # step, argmax at the last real position.
    length = 16
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    for i, prompt in enumerate(PROMPTS[:4]):
        seq = list(prompt)
        for _ in range(cfg.max_new_tokens):
            logits = forward(params, jnp.asarray([seq + [0] * (length - len(seq))]))
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        assert np.asarray(out.tokens[i]).tolist() == seq[len(prompt) :], i
    np.testing.assert_allclose(out.logps, _full_logps(model, out, 1.0), atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        pytest.param(dict(temperature=0.7), marks=pytest.mark.slow),
        pytest.param(dict(temperature=0.7, top_k=5, top_p=0.9), marks=pytest.mark.slow),
        pytest.param(dict(temperature=1.0, top_k=8, top_p=0.7), marks=pytest.mark.slow),
    ],
)
def test_logps_equal_full_forward_per_token_logps(model, kw):
    cfg = SamplingConfig(max_new_tokens=8, eos_ids=(3, 11), prompt_buckets=(8, 16), **kw)
    graphdef, params = nnx.split(model)
    toks, mask = _pad(PROMPTS[:4])
    out = sampling.generate(graphdef, params, toks, mask, jax.random.key(1), cfg, num_samples=3)
    want = _full_logps(model, out, cfg.temperature)
    np.testing.assert_allclose(out.logps, np.where(out.mask, want, 0.0), atol=1e-5)
    assert np.asarray(out.mask).sum() > 24  # Rows really produced tokens.
    # The behaviour log-probs: those of the truncated distribution drawn from,
    # rebuilt here from the full forward pass's logits with ``candidates``.
    p, t = out.prompt_tokens.shape[1], out.tokens.shape[1]
    seq = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    full_mask = jnp.concatenate([out.prompt_mask, out.mask.astype(bool)], axis=1)
    logits = _forward(params, seq, full_mask, graphdef=graphdef)[:, p - 1 : p - 1 + t]
    scaled = logits.reshape(-1, V) / cfg.temperature
    cand, ids = sampling.candidates(scaled, top_k=cfg.top_k, top_p=cfg.top_p)
    log_q = jax.nn.log_softmax(cand, axis=-1)
    if ids is not None:
        log_q = (
            jnp.full_like(scaled, -jnp.inf).at[jnp.arange(scaled.shape[0])[:, None], ids].set(log_q)
        )
    want_q = jnp.take_along_axis(log_q, out.tokens.reshape(-1, 1), axis=-1).reshape(
        out.tokens.shape
    )
    np.testing.assert_allclose(out.behavior_logps, np.where(out.mask, want_q, 0.0), atol=1e-5)
    if cfg.top_k == 0 and cfg.top_p == 1.0:
        np.testing.assert_array_equal(out.behavior_logps, out.logps)  # no filter: q is pi
    else:
        assert np.asarray(out.behavior_logps - out.logps).max() > 0.01  # q renormalised


@pytest.fixture(scope="module")
def one_device():
    graphdef, params = nnx.split(create_model(MODEL_CFG, seed=1))
    return graphdef, jax.device_put(_sharpen(params), jax.devices()[0])


@pytest.mark.slow
def test_greedy_on_8_devices_equals_one_device(one_device):
    cfg = SamplingConfig(max_new_tokens=6, greedy=True, prompt_buckets=(8,))
    toks, mask = _pad(PROMPTS, buckets=(8,))
    key = jax.random.key(0)
    want = sampling.generate(*one_device, toks, mask, key, cfg, num_samples=2)
    assert len(jax.devices()) == 8
    for axes, layout in [({"data": 2, "fsdp": 4}, "fsdp"), ({"data": 4, "tensor": 2}, "fsdp_tp")]:
        mesh = make_mesh(axes)
        graphdef, params = nnx.split(create_model(MODEL_CFG, seed=1, mesh=mesh, layout=layout))
        params = _sharpen(params)  # Elementwise: keeps the parameters' shardings.
        got = sampling.generate(graphdef, params, toks, mask, key, cfg, num_samples=2, mesh=mesh)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logps, want.logps, atol=1e-5)
        # Rows split over the batch axes in whole groups: a prompt's 2 rows on one shard.
        rows = 16 // batch_shards(mesh)
        for shard in got.tokens.addressable_shards:
            assert shard.data.shape == (rows, 6)
            assert (shard.index[0].start or 0) % 2 == 0


@pytest.mark.slow
def test_sharded_sampling_matches_one_device_and_never_recompiles(one_device):
    # threefry draws are partitionable: the same key gives the same samples
    # however the rows are split (up to logits round-off, tiny here).
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.8, top_k=10, prompt_buckets=(8,))
    toks, mask = _pad(PROMPTS, buckets=(8,))
    key = jax.random.key(4)
    want = sampling.generate(*one_device, toks, mask, key, cfg, num_samples=2)
    mesh = make_mesh({"data": 2, "fsdp": 4})
    graphdef, params = nnx.split(create_model(MODEL_CFG, seed=1, mesh=mesh))
    params = _sharpen(params)
    got = sampling.generate(graphdef, params, toks, mask, key, cfg, num_samples=2, mesh=mesh)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logps, want.logps, atol=1e-5)
    assert got.tokens.sharding.spec[0] == ("data", "fsdp")

    # A steady-state step: other prompts in the same bucket, another key,
    # updated parameters, a fresh split: no compilation.
    before = sampling.compile_count()
    toks2, mask2 = _pad([p[::-1] + [1] for p in PROMPTS], buckets=(8,))
    params = jax.tree.map(lambda x: x * 0.99, params)
    graphdef, _ = nnx.split(nnx.merge(graphdef, params))
    sampling.generate(
        graphdef, params, toks2, mask2, jax.random.key(5), cfg, num_samples=2, mesh=mesh
    )
    assert sampling.compile_count() == before

    with pytest.raises(ValueError, match="cannot be split into 8 batch shards of whole groups"):
        sampling.generate(graphdef, params, toks[:4], mask[:4], key, cfg, num_samples=2, mesh=mesh)


@pytest.mark.slow
def test_bucketed_steps_do_not_recompile(model):
    cfg = SamplingConfig(max_new_tokens=5, temperature=0.9, prompt_buckets=(8, 16))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)

    def step(i, params):
        lengths = rng.integers(1, 9, size=4)  # All fit bucket 8.
        prompts = [rng.integers(0, V, size=n).tolist() for n in lengths]
        toks, mask = _pad(prompts)
        g, _ = nnx.split(model)  # A fresh split each step, as a trainer does.
        return sampling.generate(g, params, toks, mask, jax.random.key(i), cfg, num_samples=2)

    step(0, params)
    before = sampling.compile_count()
    for i in range(1, 4):
        params = jax.tree.map(lambda x: x * 1.01, params)  # New values, same shapes.
        step(i, params)
    assert sampling.compile_count() == before
    # A longer prompt moves to the next bucket: exactly one more prefill and decode.
    toks, mask = _pad([list(range(12))] * 4)
    sampling.generate(graphdef, params, toks, mask, jax.random.key(9), cfg, num_samples=2)
    assert sampling.compile_count() == before + 2
