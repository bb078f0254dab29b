"""The Pallas kernels lower for a TPU from this CPU host, without a TPU and without libtpu.

``jax.export`` with ``platforms=["tpu"]`` runs JAX's own lowering for the TPU, Mosaic's
kernel serialisation included (``tpu_custom_call``), which is where a kernel the TPU
cannot take is refused (block shapes, interpret mode). The TPU compiler's own pass over
the programs is the slow tier's, with libtpu (tests/aot/test_aot_tpu.py). On the CPU the
same kernels run interpreted (tests/sampling/test_paged_kernel.py,
tests/models/test_models_attention.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from grpo_jax.core.sharding import make_mesh
from grpo_jax.models import attention as attn_lib


def _tpu_text(fn, *specs) -> str:
    return export.export(jax.jit(fn), platforms=["tpu"])(*specs).mlir_module()


def test_the_paged_decode_kernel_lowers_for_a_tpu():
    """The kernel, not its interpreted form, and with blocks the TPU takes (whole pages:
    one KV head of a page, block (Z, 1 of K, Dh), was refused: "the last two dimensions
    of your block shape are divisible by 8 and 128 ... or be equal to the respective
    dimensions of the overall array")."""
    B, K, G, Dh, Z, M, pages = 4, 2, 7, 64, 16, 8, 40
    q = jax.ShapeDtypeStruct((B, K, G, Dh), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((pages, Z, K, Dh), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((B, M), jnp.int32)
    pos = jax.ShapeDtypeStruct((B, M * Z), jnp.int32)
    q_pos = jax.ShapeDtypeStruct((B,), jnp.int32)

    def step(q, k, v, table, pos, q_pos):
        paged = attn_lib.PagedKV(k, v, None, None, table, pos)
        return attn_lib.paged_decode_attention(q, paged, q_pos, 24, 0.125, 50.0)

    text = _tpu_text(step, q, kv, kv, table, pos, q_pos)
    assert text.count("tpu_custom_call") == 1


def test_splash_lowers_for_a_tpu():
    B, T, K, G, Dh = 2, 128, 2, 2, 64
    q = jax.ShapeDtypeStruct((B, T, K, G, Dh), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, K, T, Dh), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((B, T), jnp.bool_)

    def prefill(q, k, v, kv_mask):
        slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        m = attn_lib.AttnMask(slot, kv_mask, None, 0)
        return attn_lib.splash_attention(q, k, v, m, 0.125, None, 128, None, "fsdp")

    assert "tpu_custom_call" in _tpu_text(prefill, q, kv, kv, mask)


def test_splash_mask_tables_stay_off_the_callers_mesh():
    """The kernel's mask tables are built outside the caller's ``jax.set_mesh``: under a
    mesh they were placed on its devices, which fails for a TPU topology's compile-only
    devices ("'Executable' object has no attribute 'local_devices'")."""
    attn_lib._splash_kernel.cache_clear()
    with jax.set_mesh(make_mesh({"fsdp": 8})):
        kernel = attn_lib._splash_kernel((128, 128), 0, None, 2, None, 128, 128, True)
    tables = [x for x in jax.tree.leaves(kernel.fwd_mask_info) if isinstance(x, jax.Array)]
    assert tables
    assert all(len(x.devices()) == 1 for x in tables)


def test_the_cpu_still_runs_the_kernels_interpreted():
    """What the platform chooses on this host: the interpreted kernel, equal to the gather
    path (a TPU branch lowered here would fail: Mosaic kernels need a TPU)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 2, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(5, 4, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(5, 4, 2, 8)), jnp.float32)
    table = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    pos = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    paged = attn_lib.PagedKV(k, v, None, None, table, pos)
    q_pos = jnp.asarray([7, 5], jnp.int32)
    got = jax.jit(lambda q: attn_lib.paged_decode_attention(q, paged, q_pos, None, 0.3, None))(q)
    ks, vs = paged.gather()
    want = attn_lib.paged_attention(q[:, None], ks, vs, q_pos[:, None], pos, None, 0.3, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, 0]), atol=1e-6)
