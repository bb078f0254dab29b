"""Qwen3-MoE: the dropless grouped dispatch against a dense reference (values and gradients),
logits and routing against transformers on tiny random checkpoints (float32, within 1e-5),
export, and the config's checks. The KV-cache, scan and paged-engine checks of the family
run with the other families' (test_models.py, test_models_scan.py, sampling/test_paged.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, hf_routes, load_hf_model, make_tiny_hf_checkpoint

from grpo_jax.core.errors import ConfigError
from grpo_jax.models import (
    create_model,
    family_config,
    from_pretrained,
    positions_from_mask,
    save_pretrained,
)
from grpo_jax.models import moe as moe_lib

MOE_ATOL = 1e-5

# Two checkpoints: the helpers' (6 experts, top 2 renormalised, layers 0 and 2 sparse), and
# transformers' default rule (no renormalisation, every second layer sparse).
VARIANTS = {
    "mlp_only_layers": {},
    "sparse_step": dict(
        norm_topk_prob=False,
        decoder_sparse_step=2,
        num_hidden_layers=4,
        num_experts_per_tok=3,
        mlp_only_layers=[],
    ),
}


def _experts_problem(seed=0, M=13, D=8, E=5, K=2, F=6):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return dict(x=r(M, D), router=r(D, E), gate=r(E, D, F), up=r(E, D, F), down=r(E, F, D)), K


def _block(dispatch, k, normalize=True, routes=None):
    """A MoE block as a function of its input and weights, with ``dispatch`` running the
    experts: route, then dispatch; a scalar of the output for gradients."""

    def f(p):
        weights, experts = moe_lib.route(p["x"] @ p["router"], k, normalize, routes)
        out = dispatch(p["x"], experts, weights, p["gate"], p["up"], p["down"], jax.nn.silu)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), (out, experts)

    return f


@pytest.mark.slow
@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_dispatch_equals_the_dense_reference_in_value_and_gradient(normalize):
    """ragged_dot over tokens sorted by expert equals evaluating every expert on every token
    and masking by the routing weights; so do the gradients of the input, the experts and
    the router (through the chosen experts' weights)."""
    p, k = _experts_problem()
    grad = lambda d: jax.jit(jax.value_and_grad(_block(d, k, normalize), has_aux=True))(p)
    (v0, (out0, experts)), g0 = grad(moe_lib.dense_experts)
    (v1, (out1, _)), g1 = grad(moe_lib.grouped_experts)
    assert len(np.unique(np.asarray(experts))) == 5  # every expert has tokens
    np.testing.assert_allclose(out1, out0, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for name in p:
        assert np.abs(np.asarray(g0[name])).max() > 0, name
        np.testing.assert_allclose(g1[name], g0[name], atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.slow
def test_router_gradient_matches_finite_differences():
    """The router's gradient through the routing weights, against central differences in a
    direction small enough that no route flips."""
    p, k = _experts_problem(seed=1)
    f = jax.jit(_block(moe_lib.grouped_experts, k))
    g = jax.jit(jax.grad(lambda q: f(q)[0]))(p)["router"]
    d = jnp.asarray(np.random.default_rng(2).standard_normal(p["router"].shape), jnp.float32)
    eps = 1e-2
    plus, minus = ({**p, "router": p["router"] + s * eps * d} for s in (1, -1))
    (f_plus, (_, e_plus)), (f_minus, (_, e_minus)) = f(plus), f(minus)
    assert (e_plus == e_minus).all()  # the same experts on both sides
    numeric = (f_plus - f_minus) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(g, d), numeric, rtol=2e-3)


def test_top_k_and_renormalisation_are_transformers_router():
    logits = jnp.asarray([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 2.9]], jnp.float32)
    w, e = moe_lib.route(logits, 2, normalize=False)
    probs = jax.nn.softmax(logits, -1)
    np.testing.assert_array_equal(e, [[1, 3], [0, 3]])
    np.testing.assert_allclose(w, [[probs[0, 1], probs[0, 3]], [probs[1, 0], probs[1, 3]]])
    wn, _ = moe_lib.route(logits, 2, normalize=True)
    np.testing.assert_allclose(wn.sum(-1), 1.0, rtol=1e-6)
    # Given routes: those experts, their probabilities.
    wg, eg = moe_lib.route(logits, 2, normalize=False, routes_MxK=jnp.asarray([[0, 2], [1, 2]]))
    np.testing.assert_array_equal(eg, [[0, 2], [1, 2]])
    np.testing.assert_allclose(wg, [[probs[0, 0], probs[0, 2]], [probs[1, 1], probs[1, 2]]])


def test_route_flips_count_sets_not_order():
    a = jnp.asarray([[1, 3], [0, 2], [4, 5]])
    b = jnp.asarray([[3, 1], [0, 1], [4, 5]])
    np.testing.assert_array_equal(moe_lib.route_flips(a, b), [False, True, False])


# ---------------------------------------------------------------------------
# Against transformers.


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_routes_match_transformers_with_left_padding(variant, tmp_path):
    path = make_tiny_hf_checkpoint(tmp_path / variant, "qwen3_moe", seed=7, **VARIANTS[variant])
    ref = load_hf_model(path)
    model = from_pretrained(path)
    cfg = model.config
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 6
    assert cfg.sparse_layers == {"mlp_only_layers": (0, 2), "sparse_step": (1, 3)}[variant]
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 320, (3, 14)).astype(np.int32)
    mask = np.ones((3, 14), bool)
    mask[1, :5] = False
    mask[2, :11] = False
    tokens = np.where(mask, tokens, 0)
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    graphdef, params = nnx.split(model)
    f = jax.jit(lambda p, t, m: nnx.merge(graphdef, p).routed_features(t, mask_BxT=m))
    x, routes = f(params, jnp.asarray(tokens), jnp.asarray(mask))
    ours = np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p).logits(x))(params, x))
    theirs = hf_logits(ref, tokens, attention_mask=mask, position_ids=positions)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=MOE_ATOL, rtol=0)
    k = cfg.experts_per_token
    assert routes.shape == (3, 14, len(cfg.sparse_layers), k)
    want = hf_routes(ref, tokens, mask, positions, k)
    np.testing.assert_array_equal(np.sort(np.asarray(routes), -1)[mask], want[mask])


@pytest.mark.slow
def test_a_random_moe_model_exports_and_transformers_agrees(tmp_path):
    """create_model -> save_pretrained -> transformers, and back: the export path alone, with
    a dense layer between sparse ones."""
    cfg = family_config(
        "qwen3_moe", vocab_size=300, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=8, mlp_dim=40, moe_mlp_dim=16, num_experts=4, experts_per_token=2,
        mlp_only_layers=(1,), tie_embeddings=False,
    )  # fmt: skip
    model = create_model(cfg, seed=3)
    graphdef, params = nnx.split(model)
    noisy = jax.tree.map(lambda v: v + 0.05 * jnp.cos(jnp.arange(v.size).reshape(v.shape)), params)
    model = nnx.merge(graphdef, noisy)  # norms and router away from their initial values
    out = save_pretrained(model, tmp_path / "tiny")
    tokens = np.random.default_rng(0).integers(0, 300, (2, 9)).astype(np.int32)
    ours = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(noisy, jnp.asarray(tokens))
    np.testing.assert_allclose(ours, hf_logits(load_hf_model(out), tokens), atol=MOE_ATOL)
    again = from_pretrained(out)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(a, b)


def test_config_checks_name_the_key():
    base = dict(
        vocab_size=50, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8,
        mlp_dim=16,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="model.experts_per_token' = 9 must be <= 8"):
        family_config("qwen3_moe", **base, experts_per_token=9)
    with pytest.raises(ConfigError, match=r"model.scan_layers' = True needs every layer sparse"):
        family_config("qwen3_moe", **base, mlp_only_layers=(1,), scan_layers=True)
    cfg = family_config("qwen3_moe", **base, decoder_sparse_step=2)
    assert cfg.sparse_layers == (1,) and cfg.expert_mlp_dim == 16
    from grpo_jax.models.hf_config_export import check_exportable
    from grpo_jax.models.safetensors_io import CheckpointError

    with pytest.raises(CheckpointError, match="num_experts"):
        check_exportable(family_config("qwen3", **base, num_experts=4, experts_per_token=2))


@pytest.mark.slow
def test_lora_adapts_attention_and_the_dense_layers_not_the_experts():
    from grpo_jax.models import lora
    from grpo_jax.models.config import LoRAConfig

    cfg = family_config(
        "qwen3_moe", vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=8, mlp_dim=16, moe_mlp_dim=8, num_experts=4, experts_per_token=2,
        mlp_only_layers=(1,),
    )  # fmt: skip
    model = create_model(cfg)
    lora.attach(model, LoRAConfig(rank=2), jax.random.key(0))
    adapted = {
        ".".join(map(str, path[:-1])) + "." + path[-1][: -len(lora.SUFFIX_A)]
        for path, _ in nnx.to_flat_state(nnx.state(model))
        if str(path[-1]).endswith(lora.SUFFIX_A)
    }
    attention = {f"layers.{i}.attn.{p}_proj" for i in (0, 1) for p in "qkvo"}
    assert adapted == attention | {f"layers.1.mlp.{p}_proj" for p in ("gate", "up", "down")}
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.arange(10).reshape(2, 5))
    assert logits.shape == (2, 5, 50) and np.isfinite(np.asarray(logits)).all()


def test_active_params_count_the_experts_a_token_computes_with():
    """The pod plan's useful FLOPs (``aot.budget.model_flops``) count K of each sparse layer's
    E experts: the parameters a token computes with."""
    base = dict(
        vocab_size=50, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8,
        mlp_dim=16, moe_mlp_dim=8, num_experts=4, experts_per_token=2,
    )  # fmt: skip
    cfg = family_config("qwen3_moe", **base, mlp_only_layers=(1,))
    assert cfg.sparse_layers == (0, 2)
    # 2 sparse layers x (4 - 2) idle experts x 3 projections of 16 x 8 each
    assert cfg.num_params - cfg.active_params == 2 * 2 * 3 * 16 * 8
    every = family_config("qwen3_moe", **{**base, "experts_per_token": 4})
    assert every.active_params == every.num_params
    dense = family_config("qwen3", **{k: v for k, v in base.items() if "expert" not in k})
    assert dense.active_params == dense.num_params
