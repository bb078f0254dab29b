"""Every attention implementation equals the einsum reference: logits, gradients, KV cache.

Each family's tiny random model (tests/models/test_models.py's ``small_config``:
Gemma 3 with a binding window of 3 and attention soft-capping) is run on a
left-padded batch; logits are compared on real tokens, gradients of a loss
over real tokens for every parameter. The blockwise block size (4) is
smaller than the sequence, so several key blocks, a padded last block and
the online-softmax rescaling are all exercised. ``splash`` (TPU splash
attention) runs in Pallas's interpreter here, the same kernel code the TPU
compiles; its blocks are whole 128-lane tiles, so these sequences fit one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_models import FAMILIES, left_padded_batch, random_model, small_config

from grpo_jax.core.sharding import batch_sharding, make_mesh
from grpo_jax.models import attention as attn_lib
from grpo_jax.models import create_model, param_shardings, positions_from_mask
from grpo_jax.run.config import ConfigError

IMPLS = ("blockwise", "dot_product", "splash")


def _cfg(family, impl, **kw):
    cfg = small_config(family, attention_block_size=4, **kw)
    if impl == "dot_product" and cfg.attn_logit_softcap is not None:
        cfg = cfg.replace(attn_logit_softcap=None)  # dot_product cannot soft-cap (tested below)
    return cfg


def _loss_and_grads(model, tokens, mask):
    graphdef, params = nnx.split(model)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens, mask_BxT=mask)
        lse = jax.nn.logsumexp(logits, -1)
        per_token = lse - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / mask.sum(), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, logits, grads


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_implementation_equals_einsum_in_logits_and_gradients(family, impl):
    if family == "gpt_oss" and impl == "dot_product":  # no sinks there: refused (tested below)
        pytest.skip("jax.nn.dot_product_attention has no attention sinks")
    cfg = _cfg(family, impl)
    tokens, mask = left_padded_batch((11, 7, 3), 11, cfg.vocab_size, seed=3)
    ref = random_model(cfg)
    other = nnx.merge(nnx.graphdef(random_model(cfg.replace(attention=impl))), nnx.state(ref))
    l0, z0, g0 = _loss_and_grads(ref, tokens, mask)
    l1, z1, g1 = _loss_and_grads(other, tokens, mask)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(z1)[real], np.asarray(z0)[real], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    flat0, flat1 = dict(nnx.to_flat_state(g0)), dict(nnx.to_flat_state(g1))
    assert flat0.keys() == flat1.keys()
    for path in flat0:
        a, b = flat0[path].get_value(), flat1[path].get_value()
        scale = float(np.abs(a).max()) + 1e-6
        np.testing.assert_allclose(b, a, atol=2e-5 * scale + 1e-7, err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_kv_cache_decoding_equals_einsum(impl):
    """Prefill a left-padded prompt, decode token by token: every step equals the einsum
    model's full forward pass (Gemma 3: window and alternating layers)."""
    cfg = _cfg("gemma3", impl)
    ref = random_model(cfg)
    model = nnx.merge(nnx.graphdef(random_model(cfg.replace(attention=impl))), nnx.state(ref))
    lengths, P, N = (5, 3, 1), 5, 6
    S = P + N + 2
    prompt, prompt_mask = left_padded_batch(lengths, P, cfg.vocab_size, seed=1)
    cont = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (3, N)), jnp.int32)
    tokens = jnp.concatenate([prompt, cont], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones_like(cont, bool)], axis=1)
    full = jax.jit(lambda t, m: ref(t, mask_BxT=m))(tokens, mask)
    positions = positions_from_mask(mask)
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, tokens, positions, kv_mask, cache, index):
        return nnx.merge(graphdef, params).forward_with_cache(
            tokens, positions_BxT=positions, kv_mask_BxS=kv_mask, cache=cache, cache_index=index
        )

    kv_mask = jnp.zeros((3, S), bool).at[:, :P].set(prompt_mask)
    logits, cache = step(params, prompt, positions[:, :P], kv_mask, model.init_cache(3, S), 0)
    real = np.asarray(prompt_mask)
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(full[:, :P])[real], atol=2e-5)
    for t in range(P, P + N):
        kv_mask = kv_mask.at[:, t].set(True)
        logits, cache = step(
            params, tokens[:, t : t + 1], positions[:, t : t + 1], kv_mask, cache, t
        )
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=2e-5, rtol=1e-5)


def _random_qkv(seed, B=2, T=10, K=2, G=2, Dh=8):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, K, G, Dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32)
    return q, k, v


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("block", [1, 3, 10, 64])
@pytest.mark.slow
def test_blockwise_kernel_value_and_gradient(window, softcap, block):
    """The kernel alone against the einsum reference, every block size (1 key, a ragged last
    block, one block, a block wider than S); a per-layer (traced) window as well."""
    q, k, v = _random_qkv(0)
    B, T = q.shape[:2]
    kv_mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [4]]))  # row 1 left-padded
    slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = attn_lib.AttnMask(slot, kv_mask, window)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    real = np.asarray(kv_mask)[:, :, None, None, None]

    def ref(q, k, v):
        out = attn_lib.einsum_attention(q, k, v, "bskh", "bskh", mask, 0.5, softcap)
        return jnp.sum(jnp.where(real, out * w, 0.0)), out

    def blk(q, k, v, window):
        m = mask._replace(window=window)
        kt, vt = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
        out = attn_lib.blockwise_attention(q, kt, vt, m, 0.5, softcap, block)
        return jnp.sum(jnp.where(real, out * w, 0.0)), out

    (l0, o0), g0 = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (l1, o1), g1 = jax.jit(jax.value_and_grad(blk, argnums=(0, 1, 2), has_aux=True))(
        q, k, v, None if window is None else jnp.int32(window)
    )
    r = np.broadcast_to(real, o0.shape)
    np.testing.assert_allclose(np.asarray(o1)[r], np.asarray(o0)[r], atol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for a, b in zip(g0, g1):
        np.testing.assert_allclose(b, a, atol=1e-5)
    assert np.isfinite(np.asarray(o1)).all()  # Pad queries see nothing: finite, not NaN.


@pytest.mark.slow
def test_sinks_in_blockwise_and_paged_equal_einsum_in_value_and_gradient():
    """Attention sinks: the blockwise kernel (sink as the online softmax's start, its own
    gradient) and the paged engine's gather path equal the einsum reference, the sinks'
    gradient included; a sink takes weight away from the keys (outputs shrink)."""
    q, k, v = _random_qkv(2, T=9)
    B, T, K, G, _ = q.shape
    kv_mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [3]]))
    slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = attn_lib.AttnMask(slot, kv_mask, 4)
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal((K, G)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).standard_normal(q.shape), jnp.float32)
    real = np.asarray(kv_mask)[:, :, None, None, None]
    loss = lambda out: jnp.sum(jnp.where(real, out * w, 0.0))
    pos = jnp.where(kv_mask, slot - jnp.asarray([[0], [3]]), attn_lib.NO_WINDOW)
    impls = {
        "einsum": lambda q, k, v, s: attn_lib.einsum_attention(
            q, k, v, "bskh", "bskh", mask, 0.5, None, s
        ),
        "blockwise": lambda q, k, v, s: attn_lib.blockwise_attention(
            q, jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3)), mask, 0.5, None,
            3, s,
        ),
        "paged": lambda q, k, v, s: attn_lib.paged_attention(
            q, k, v, pos, pos, 4, 0.5, None, s
        ),
    }  # fmt: skip
    results = {
        name: jax.jit(jax.value_and_grad(lambda *a: loss(f(*a)), argnums=(0, 1, 2, 3)))(
            q, k, v, sinks
        )
        for name, f in impls.items()
    }
    (l0, g0) = results["einsum"]
    assert np.abs(np.asarray(g0[3])).min() > 0  # every sink's gradient is live
    for name in ("blockwise", "paged"):
        l1, g1 = results[name]
        np.testing.assert_allclose(l1, l0, rtol=1e-5, err_msg=name)
        for a, b in zip(g0, g1):
            np.testing.assert_allclose(b, a, atol=1e-5, err_msg=name)
    r = np.broadcast_to(real, q.shape)
    with_sinks = np.asarray(impls["einsum"](q, k, v, sinks))[r]
    without = np.asarray(impls["einsum"](q, k, v, None))[r]
    assert np.abs(with_sinks).sum() < np.abs(without).sum()


def test_attention_sinks_are_refused_where_the_kernel_has_none():
    with pytest.raises(ConfigError, match="'model.attention' = 'dot_product' has no attention"):
        small_config("gpt_oss", attention="dot_product")


def test_blockwise_backward_never_forms_the_full_score_matrix():
    """Memory linear in T: no [.., T, S] float32 buffer in the compiled gradient."""
    T = 1024
    q, k, v = _random_qkv(0, B=1, T=T, K=1, G=1, Dh=8)
    slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, T))
    mask = attn_lib.AttnMask(slot, jnp.ones((1, T), bool), None)
    kt, vt = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))

    def loss(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))

    blockwise = loss(lambda q, k, v: attn_lib.blockwise_attention(q, k, v, mask, 1.0, None, 32))
    einsum = loss(
        lambda q, k, v: attn_lib.einsum_attention(
            q,
            jnp.transpose(k, (0, 2, 1, 3)),
            jnp.transpose(v, (0, 2, 1, 3)),
            "bskh",
            "bskh",
            mask,
            1.0,
            None,
        )
    )
    temp = lambda f: f.lower(q, kt, vt).compile().memory_analysis().temp_size_in_bytes
    full_scores = T * T * 4  # One float32 [T, S] matrix: 4 MiB.
    assert temp(einsum) >= full_scores
    # A few [T, 32] block buffers (scores, probabilities and their gradients) at a time.
    assert temp(blockwise) < full_scores / 4


def test_dot_product_refuses_soft_capping():
    with pytest.raises(ConfigError, match="'dot_product' cannot soft-cap"):
        small_config("gemma3", attention="dot_product")


def test_unknown_attention_is_an_error():
    with pytest.raises(ConfigError, match="model.attention"):
        small_config("llama", attention="flash")


def test_memory_plan_counts_blockwise_scores_once_per_block():
    """einsum saves (4 + c) H S bytes of scores per layer and token; blockwise saves the row
    max and normaliser (8 H) and holds one block's working set, 5 * 4 * n H S C, once;
    splash saves the log-sum-exp (4 H)."""
    from grpo_jax.run import memory

    cfg = small_config("qwen2")
    kw = dict(mesh_shape={}, layout="dp", batch_rows=2, seq_len=60, prompt_len=4, beta=0.0)
    dense = memory.estimate(cfg, **kw)
    blocks = memory.estimate(cfg, attention="blockwise", attention_block_size=16, **kw)
    n, S, L, H, c = 2, 64, cfg.num_layers, cfg.num_heads, 4
    expected = n * S * L * ((4 + c) * H * S - 8 * H) - 5 * 4 * n * H * S * 16
    assert dense.activations - blocks.activations == expected
    # splash saves the float32 log-sum-exp (4 H) and keeps its blocks in VMEM, not HBM.
    splash = memory.estimate(cfg, attention="splash", **kw)
    assert dense.activations - splash.activations == n * S * L * ((4 + c) * H * S - 4 * H)
    with pytest.raises(ValueError, match="unknown attention"):
        memory.estimate(cfg, attention="flash", **kw)


# ---------------------------------------------------------------------------
# splash: the kernel's own cases (static offsets, traced windows, the mesh).


def _cached_layout(k, v):
    """[B, S, K, Dh] keys/values as the kernels' [B, K, S, Dh]."""
    return jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))


@pytest.mark.parametrize(
    "offset,window",
    # All in the slow tier with the other Pallas-interpreter tests (seconds each on a CPU).
    [pytest.param(5, "traced", marks=pytest.mark.slow)]
    + [pytest.param(o, w, marks=pytest.mark.slow) for o in (0, 5) for w in (None, 3)]
    + [pytest.param(0, "traced", marks=pytest.mark.slow)],
)
def test_splash_kernel_value_and_gradient(offset, window):
    """Queries in slots offset..offset+T-1 over S = offset + T keys (the prompt-once
    scoring call at offset 5), left padding, soft-capping; a per-layer window traced
    (scanned Gemma 3) picks the local kernel at 3 and the global one at NO_WINDOW."""
    B, T, K, G, Dh = 2, 6, 2, 2, 8
    S = offset + T
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, K, G, Dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, K, Dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, Dh)), jnp.float32)
    kv_mask = jnp.asarray(np.arange(S)[None] >= np.array([[0], [3]]))  # row 1: 3 pads
    slot = jnp.broadcast_to(offset + jnp.arange(T, dtype=jnp.int32), (B, T))
    q_real = np.asarray(kv_mask)[:, offset:, None, None, None]
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    cases = [(3, 3), (attn_lib.NO_WINDOW, None)] if window == "traced" else [(window, window)]
    for w_in, w_ref in cases:
        ref_mask = attn_lib.AttnMask(slot, kv_mask, w_ref)

        def ref(q, k, v):
            out = attn_lib.einsum_attention(q, k, v, "bskh", "bskh", ref_mask, 0.5, 2.0)
            return jnp.sum(jnp.where(q_real, out * w, 0.0)), out

        def spl(q, k, v, w_arg):
            m = attn_lib.AttnMask(slot, kv_mask, w_arg, offset)
            kt, vt = _cached_layout(k, v)
            out = attn_lib.splash_attention(q, kt, vt, m, 0.5, 2.0, 128, 3, "fsdp")
            return jnp.sum(jnp.where(q_real, out * w, 0.0)), out

        w_arg = jnp.int32(w_in) if window == "traced" else w_in
        (l0, o0), g0 = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        (l1, o1), g1 = jax.jit(jax.value_and_grad(spl, argnums=(0, 1, 2), has_aux=True))(
            q, k, v, w_arg
        )
        r = np.broadcast_to(q_real, o0.shape)
        np.testing.assert_allclose(np.asarray(o1)[r], np.asarray(o0)[r], atol=1e-5)
        np.testing.assert_allclose(l1, l0, rtol=1e-5)
        for a, b in zip(g0, g1):
            np.testing.assert_allclose(b, a, atol=1e-5)
        assert np.isfinite(np.asarray(o1)).all()  # Pad queries see pads: finite, not NaN.


def test_splash_without_a_static_offset_is_refused():
    q = jnp.zeros((1, 2, 1, 1, 8))
    k = jnp.zeros((1, 1, 4, 8))
    mask = attn_lib.AttnMask(jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="q_offset"):
        attn_lib.splash_attention(q, k, k, mask, 1.0, None, 128, None, "fsdp")


@pytest.mark.slow
def test_splash_model_serves_traced_multi_token_writes_by_blockwise():
    """A multi-token write at a traced slot (a multi-turn observation) cannot use the static
    mask; the model runs blockwise there and still equals einsum."""
    cfg = small_config("gemma3")
    ref = random_model(cfg)
    model = nnx.merge(nnx.graphdef(random_model(cfg.replace(attention="splash"))), nnx.state(ref))
    tokens, mask = left_padded_batch((6, 4), 6, cfg.vocab_size, seed=5)
    S = 9
    kv_mask = jnp.zeros((2, S), bool).at[:, :6].set(mask)
    positions = positions_from_mask(mask)

    def run(m, index):
        return m.forward_with_cache(
            tokens,
            positions_BxT=positions,
            kv_mask_BxS=kv_mask,
            cache=m.init_cache(2, S),
            cache_index=index,
        )[0]

    want = jax.jit(lambda: run(ref, 0))()
    got = jax.jit(lambda i: run(model, i))(jnp.int32(0))  # traced index
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,axes", [("fsdp", {"data": 2, "fsdp": 4}), ("fsdp_tp", {"fsdp": 4, "tensor": 2})]
)
def test_splash_on_a_mesh_equals_one_device(layout, axes):
    """On 8 devices the kernel runs under shard_map (rows over the batch axes, KV heads over
    "tensor"); logits and gradients equal the single-device einsum model's."""
    cfg = small_config("gemma3", scan_layers=True)
    mesh = make_mesh(axes)
    ref = random_model(cfg)
    tokens, mask = left_padded_batch((11, 7, 3, 9, 11, 5, 8, 2), 11, cfg.vocab_size, seed=3)
    l0, z0, g0 = _loss_and_grads(ref, tokens, mask)
    graphdef = nnx.graphdef(create_model(cfg.replace(attention="splash"), layout=layout))
    params = jax.device_put(nnx.state(ref), param_shardings(nnx.state(ref), mesh, layout))
    with jax.set_mesh(mesh):
        tokens_s, mask_s = jax.device_put((tokens, mask), batch_sharding(mesh))
        l1, z1, g1 = _loss_and_grads(nnx.merge(graphdef, params), tokens_s, mask_s)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(z1)[real], np.asarray(z0)[real], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    flat0, flat1 = dict(nnx.to_flat_state(g0)), dict(nnx.to_flat_state(g1))
    for path in flat0:
        a, b = flat0[path].get_value(), np.asarray(flat1[path].get_value())
        np.testing.assert_allclose(b, a, atol=2e-5 * (float(np.abs(a).max()) + 1e-6) + 1e-7)


@pytest.mark.slow
def test_splash_serves_the_prompt_once_scoring_path():
    """The update's scoring with groups (prompt prefilled once at slot 0, completions written
    at the static slot P): splash's features and their gradient equal einsum's."""
    from grpo_jax.objective.logprobs import completion_features

    cfg = small_config("qwen3")
    ref = random_model(cfg)
    model = nnx.merge(nnx.graphdef(random_model(cfg.replace(attention="splash"))), nnx.state(ref))
    prompt, pmask = left_padded_batch((5, 5, 3, 3), 5, cfg.vocab_size, seed=7)
    prompt, pmask = prompt.at[1].set(prompt[0]), pmask  # rows 0-1 and 2-3: one group each
    prompt = prompt.at[3].set(prompt[2])
    tokens, _ = left_padded_batch((6, 6, 6, 6), 6, cfg.vocab_size, seed=8)
    cmask = jnp.asarray(np.arange(6)[None] < np.array([[6], [4], [5], [2]]))  # ended early

    def features(m):
        graphdef, params = nnx.split(m)

        def loss(p):
            x = completion_features(nnx.merge(graphdef, p), prompt, pmask, tokens, cmask, 2)
            return jnp.sum(jnp.where(cmask[..., None], x, 0.0) ** 2), x

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (l0, x0), g0 = features(ref)
    (l1, x1), g1 = features(model)
    real = np.asarray(cmask)
    np.testing.assert_allclose(np.asarray(x1)[real], np.asarray(x0)[real], atol=2e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    flat0, flat1 = dict(nnx.to_flat_state(g0)), dict(nnx.to_flat_state(g1))
    for path in flat0:
        a, b = flat0[path].get_value(), flat1[path].get_value()
        np.testing.assert_allclose(b, a, atol=2e-5 * (float(np.abs(a).max()) + 1e-6) + 1e-7)
