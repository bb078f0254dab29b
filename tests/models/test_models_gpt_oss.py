"""GPT-OSS: logits and routing against transformers on tiny random checkpoints (float32, within
1e-5, unpadded and left-padded), MXFP4 experts dequantised at load, export, YaRN, the router,
the clamped experts' dispatch against a dense reference, and the config's refusals. The
KV-cache, scan, attention-implementation and paged-engine checks of the family run with the
other families' (test_models.py, test_models_scan.py, test_models_attention.py,
sampling/test_paged.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, hf_routes, load_hf_model, make_tiny_hf_checkpoint

from grpo_jax.core.errors import ConfigError
from grpo_jax.models import (
    RopeScaling,
    create_model,
    family_config,
    from_pretrained,
    mxfp4,
    positions_from_mask,
    save_pretrained,
)
from grpo_jax.models import moe as moe_lib
from grpo_jax.models.safetensors_io import CheckpointError, SafetensorsCheckpoint

ATOL = 1e-5
BF16_ATOL = 0.05


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=11)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_hf_model(checkpoint)


def _padded_batch(seed=3, B=3, T=14):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 320, (B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    mask[1, :5] = False
    mask[2, :11] = False
    return np.where(mask, tokens, 0), mask


def _ours(model, tokens, mask, routes=None):
    """(float32 logits, the experts used [B, T, L, K]) of a jitted pass."""
    graphdef, params = nnx.split(model)

    def f(p, t, m, r):
        m_ = nnx.merge(graphdef, p)
        x, used = m_.routed_features(t, mask_BxT=m, routes=r)
        return m_.logits(x), used

    logits, used = jax.jit(f)(params, jnp.asarray(tokens), jnp.asarray(mask), routes)
    return np.asarray(logits), np.asarray(used)


# ---------------------------------------------------------------------------
# Against transformers.


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("attention", ["einsum", "blockwise"])
def test_logits_and_routes_match_transformers(checkpoint, reference, padded, attention):
    """Sinks, alternating windows of 4 (shorter than the rows), YaRN, biases, the top-k router
    and the clamped SwiGLU (a limit of 0.3 that binds), unpadded and left-padded."""
    model = from_pretrained(checkpoint, attention=attention)
    cfg = model.config
    assert cfg.family == "gpt_oss" and cfg.attention_sinks and cfg.moe_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.rope_scaling.kind == "yarn" and not cfg.rope_scaling.truncate
    tokens, mask = _padded_batch()
    if not padded:
        mask = np.ones_like(mask)
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    ours, routes = _ours(model, tokens, mask)
    theirs = hf_logits(reference, tokens, attention_mask=mask, position_ids=positions)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=ATOL, rtol=0)
    k = cfg.experts_per_token
    assert routes.shape == (3, 14, cfg.num_layers, k)
    want = hf_routes(reference, tokens, mask, positions, k)
    np.testing.assert_array_equal(np.sort(routes, -1)[mask], want[mask])
    # The clamp binds: some expert pre-activation leaves [-limit, limit].
    x = model.layers[0].mlp_norm(model.embed[...][tokens])
    gu = jnp.einsum("btd,edf->btef", x, model.layers[0].mlp.gate_up_experts[...])
    assert float(jnp.abs(gu).max()) > cfg.swiglu_limit


@pytest.mark.slow
def test_bfloat16_within_tolerance_given_the_float32_routes(checkpoint, reference):
    """In bfloat16 a token near a tie between experts may flip its route (a different
    expert, a different logit); given the float32 model's routes the logits are within
    the dense families' bfloat16 tolerance."""
    tokens, mask = _padded_batch(seed=5)
    mask = np.ones_like(mask)
    _, routes = _ours(from_pretrained(checkpoint), tokens, mask)
    model = from_pretrained(checkpoint, dtype=jnp.bfloat16)
    ours, _ = _ours(model, tokens, mask, routes=jnp.asarray(routes))
    error = np.abs(ours - hf_logits(reference, tokens)).max()
    assert 1e-4 < error < BF16_ATOL


@pytest.mark.slow
def test_a_random_model_exports_and_transformers_agrees(tmp_path):
    """create_model -> save_pretrained -> transformers, and back, for plain RoPE (written
    explicitly: a GPT-OSS config without one means YaRN) and for YaRN."""
    base = dict(
        vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, mlp_dim=16, num_experts=4, experts_per_token=2, sliding_window=3,
        swiglu_limit=0.5,
    )  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, 300, (2, 9)).astype(np.int32)
    yarn = RopeScaling("yarn", 8.0, original_max_position_embeddings=16, truncate=False)
    for name, scaling in (("plain", None), ("yarn", yarn)):
        cfg = family_config("gpt_oss", **base, rope_scaling=scaling)
        model = create_model(cfg, seed=3)
        graphdef, params = nnx.split(model)
        noise = lambda v: v + 0.05 * jnp.cos(jnp.arange(v.size).reshape(v.shape))
        params = jax.tree.map(noise, params)  # norms, biases, sinks away from their inits
        model = nnx.merge(graphdef, params)
        out = save_pretrained(model, tmp_path / name)
        ours = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens))
        theirs = hf_logits(load_hf_model(out), tokens)
        np.testing.assert_allclose(ours, theirs, atol=ATOL, err_msg=name)
        again = from_pretrained(out)
        assert again.config == model.config
        for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# MXFP4.


def test_mxfp4_dequantises_a_hand_built_block():
    """One row of two groups: byte 0x21 holds codes 1 (low nibble: 0.5) and 2 (high: 1.0);
    0xF8 holds 8 (-0.0) and 15 (-6.0). Scales 128 and 125: times 2 and times 1/4."""
    blocks = np.zeros((1, 2, 16), np.uint8)
    blocks[0, 0, 0], blocks[0, 0, 1] = 0x21, 0xF8
    blocks[0, 1, 15] = 0x7C  # codes 12 (-2.0), 7 (6.0): the group's last two values
    scales = np.asarray([[128, 125]], np.uint8)
    out = mxfp4.dequantize(blocks, scales)
    assert out.shape == (64, 1) and out.dtype == np.float32  # [G * 32, R]: transposed
    col = out[:, 0]
    np.testing.assert_array_equal(col[:4], [1.0, 2.0, -0.0, -12.0])
    np.testing.assert_array_equal(col[4:32], 0.0)
    np.testing.assert_array_equal(col[62:], [-0.5, 1.5])
    np.testing.assert_array_equal(col[32:62], 0.0)


def _random_mxfp4(rng, E, R, C):
    """blocks [E, R, C / 32, 16] and scales [E, R, C / 32] of random codes, scaled by 2^-12
    to 2^-5 (weights of a trained model's size)."""
    blocks = rng.integers(0, 256, (E, R, C // 32, 16)).astype(np.uint8)
    scales = rng.integers(115, 123, (E, R, C // 32)).astype(np.uint8)
    return blocks, scales


@pytest.mark.slow
def test_mxfp4_dequantisation_equals_transformers_and_loads(tmp_path):
    """A checkpoint whose experts are MXFP4 blocks and scales: the dequantiser equals
    transformers' (``convert_moe_packed_tensors``) bit for bit, from_pretrained reads it, and
    its logits equal transformers' on the dequantised weights."""
    import safetensors.numpy
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = make_tiny_hf_checkpoint(
        tmp_path / "dense", "gpt_oss", seed=2, tokenizer=False, hidden_size=64,
        intermediate_size=32,
    )  # fmt: skip
    tensors = dict(SafetensorsCheckpoint(path).where.items())
    arrays = {k: np.asarray(f[k]) for k, f in tensors.items()}
    rng = np.random.default_rng(0)
    E, D, F = 6, 64, 32
    ref = load_hf_model(path)
    for i in range(3):
        for name, (R, C) in (("gate_up_proj", (2 * F, D)), ("down_proj", (D, F))):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = _random_mxfp4(rng, E, R, C)
            ours = mxfp4.dequantize(blocks, scales)
            theirs = convert_moe_packed_tensors(
                torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32
            ).numpy()
            np.testing.assert_array_equal(ours, theirs)
            assert ours.shape == arrays[key].shape
            del arrays[key]
            arrays[key + "_blocks"], arrays[key + "_scales"] = blocks, scales
            with torch.no_grad():  # the reference runs on the dequantised weights
                getattr(ref.model.layers[i].mlp.experts, name).copy_(torch.as_tensor(theirs))
    (path / "model.safetensors").unlink()
    safetensors.numpy.save_file(arrays, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = from_pretrained(path)
    np.testing.assert_array_equal(
        model.layers[1].mlp.down_experts[...],
        mxfp4.dequantize(arrays["model.layers.1.mlp.experts.down_proj_blocks"],
                         arrays["model.layers.1.mlp.experts.down_proj_scales"]),
    )  # fmt: skip
    tokens = np.random.default_rng(1).integers(0, 320, (2, 10)).astype(np.int32)
    ours = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray(tokens)))
    theirs = hf_logits(ref, tokens)
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, atol=ATOL * max(scale, 1.0), rtol=0)
    bf16 = from_pretrained(path, dtype=jnp.bfloat16)  # MXFP4 values are exact in bfloat16
    np.testing.assert_array_equal(
        np.asarray(bf16.layers[1].mlp.down_experts[...], np.float32),
        model.layers[1].mlp.down_experts[...],
    )


# ---------------------------------------------------------------------------
# Pieces.


@pytest.mark.slow
def test_yarn_frequencies_and_factor_equal_transformers():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from grpo_jax.models.rope import inv_frequencies

    for truncate in (False, True):
        params = dict(
            rope_type="yarn", rope_theta=150_000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            truncate=truncate, original_max_position_embeddings=4096,
        )  # fmt: skip
        hf = GptOssConfig(head_dim=64, rope_parameters=params, max_position_embeddings=131072)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        scaling = RopeScaling(
            "yarn", 32.0, original_max_position_embeddings=4096, truncate=truncate
        )
        ours = inv_frequencies(64, 150_000.0, scaling)
        np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
        assert scaling.cos_sin_scale == pytest.approx(factor)
        assert 0 < ours[-1] < inv_frequencies(64, 150_000.0)[-1]  # low frequencies scaled


def test_router_softmax_over_the_top_k_logits_and_replay():
    logits = jnp.asarray([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 2.9]], jnp.float32)
    w, e = moe_lib.route(logits, 2, normalize=False, softmax_over_topk=True)
    np.testing.assert_array_equal(e, [[1, 3], [0, 3]])
    np.testing.assert_allclose(w[0], jax.nn.softmax(jnp.asarray([2.0, 1.5])), rtol=1e-6)
    np.testing.assert_allclose(w[1], jax.nn.softmax(jnp.asarray([3.0, 2.9])), rtol=1e-6)
    given = jnp.asarray([[0, 2], [-1, -1]])  # row 1 not recorded: its own top k
    wg, eg = moe_lib.route(logits, 2, False, given, softmax_over_topk=True)
    np.testing.assert_array_equal(eg, [[0, 2], [0, 3]])
    np.testing.assert_allclose(wg[0], jax.nn.softmax(jnp.asarray([0.1, -1.0])), rtol=1e-6)


@pytest.mark.slow
def test_clamped_dispatch_equals_the_dense_reference_in_value_and_gradient():
    rng = np.random.default_rng(0)
    M, D, E, K, F = 13, 8, 5, 2, 6
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    p = dict(x=r(M, D), router=r(D, E), rb=r(E), gu=r(E, D, 2 * F), gub=r(E, 2 * F),
             down=r(E, F, D), db=r(E, D))  # fmt: skip

    def block(dispatch):
        def f(p):
            w, e = moe_lib.route(p["x"] @ p["router"] + p["rb"], K, False, softmax_over_topk=True)
            out = dispatch(p["x"], e, w, p["gu"], p["gub"], p["down"], p["db"], 1.702, 1.0)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), (out, e)

        return jax.jit(jax.value_and_grad(f, has_aux=True))

    (v0, (o0, experts)), g0 = block(moe_lib.clamped_dense_experts)(p)
    (v1, (o1, _)), g1 = block(moe_lib.clamped_grouped_experts)(p)
    assert len(np.unique(np.asarray(experts))) == E
    np.testing.assert_allclose(o1, o0, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for name in p:
        assert np.abs(np.asarray(g0[name])).max() > 0, name
        np.testing.assert_allclose(g1[name], g0[name], atol=1e-4, rtol=1e-4, err_msg=name)


def test_clamped_swiglu_is_gpt_oss_activation():
    gate = jnp.asarray([-9.0, -1.0, 0.5, 9.0])
    up = jnp.asarray([-9.0, 0.5, 2.0, 9.0])
    g = np.minimum(np.asarray(gate), 7.0)
    expected = (np.clip(np.asarray(up), -7, 7) + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(moe_lib.clamped_swiglu(gate, up, 1.702, 7.0), expected, rtol=1e-6)


def test_config_defaults_and_refusals():
    base = dict(
        vocab_size=50, hidden_size=16, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=8,
        mlp_dim=16,
    )  # fmt: skip
    cfg = family_config("gpt_oss", **base)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.sliding_window == 128 and cfg.sparse_layers == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match="'model.moe_bias' = True needs model.swiglu_limit"):
        family_config("gpt_oss", **base, swiglu_limit=None)
    from grpo_jax.models.hf_config_export import check_exportable

    with pytest.raises(CheckpointError, match="attention_sinks"):
        check_exportable(family_config("gpt_oss", **base, attention_sinks=False))
    with pytest.raises(CheckpointError, match="attention_sinks"):
        check_exportable(family_config("qwen3", **base, attention_sinks=True))
    # Parameter counts: sinks, router bias and expert biases included.
    model = create_model(cfg)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == cfg.num_params


def test_yarn_config_without_its_keys_names_them(tmp_path):
    from grpo_jax.models.hf_config import config_from_hf

    hf = dict(model_type="gpt_oss", rope_scaling=dict(rope_type="yarn", factor=4.0))
    with pytest.raises(CheckpointError, match="lacks 'original_max_position_embeddings'"):
        config_from_hf(hf)
    # No RoPE keys at all: GptOssConfig's YaRN default.
    cfg = config_from_hf(dict(model_type="gpt_oss"))
    assert cfg.rope_scaling == RopeScaling(
        "yarn", 32.0, original_max_position_embeddings=4096, truncate=False
    )


@pytest.mark.slow
def test_rmsnorm_multiplies_in_float32_before_the_cast_as_transformers():
    """GPT-OSS's RMSNorm takes w * x in float32 and casts after (Llama's casts first): in
    bfloat16 the outputs equal transformers' GptOssRMSNorm bit for bit."""
    import ml_dtypes
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from grpo_jax.models.layers import RMSNorm

    cfg = family_config(
        "gpt_oss", vocab_size=10, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=8, mlp_dim=8, dtype="bfloat16", param_dtype="bfloat16",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    w = (1 + 0.3 * rng.standard_normal(64)).astype(ml_dtypes.bfloat16)
    norm = RMSNorm(64, cfg)
    norm.scale[...] = jnp.asarray(w)
    ours = np.asarray(norm(jnp.asarray(x))).astype(np.float32)
    ref = GptOssRMSNorm(64, eps=cfg.rms_norm_eps).to(torch.bfloat16)
    bf16 = lambda a: torch.tensor(a.astype(np.float32)).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(bf16(w))
        theirs = ref(bf16(x)).float().numpy()
    np.testing.assert_array_equal(ours, theirs)
