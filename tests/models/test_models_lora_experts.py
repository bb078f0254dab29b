"""LoRA on a mixture's experts (docs/lora.md, "The experts"), on the tiny MoE checkpoints'
models (tiny:qwen3_moe, tiny:gpt_oss): the base at init, each expert's low-rank delta against
a dense per-expert reference, merged equals unmerged, gradients for the adapters only and a
numerical check of one entry, dropout, the memory plan, and expert 4 x fsdp 2 sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from grpo_jax.core import sharding
from grpo_jax.models import create_model, lora, param_shardings, stack_layers
from grpo_jax.models import moe as moe_lib
from grpo_jax.models.config import ConfigError, LoRAConfig
from grpo_jax.run import memory
from grpo_jax.run.runlocal import tiny_model_config

FAMILIES = ["qwen3_moe", "gpt_oss"]
TARGETS = "q,v,experts"
WEIGHTS = {
    "qwen3_moe": ("gate_experts", "up_experts", "down_experts"),
    "gpt_oss": ("gate_up_experts", "down_experts"),
}


@functools.cache
def _cfg(family, scan=False):
    return tiny_model_config(family).replace(scan_layers=scan)


def _model(family, scan=False, **lora_kw):
    """(base graphdef, base params, adapted graphdef, adapted params, LoRAConfig)."""
    cfg = _cfg(family, scan)
    gd, params = nnx.split(create_model(cfg, seed=0))
    # Sharpened (x4): routes and logits far from ties, as in the MoE sharding tests; biases and
    # sinks (zeros at creation) moved off zero so that they count.
    wave = lambda x: 0.1 * jnp.cos(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
    params = jax.tree.map(lambda x: jnp.where(jnp.any(x != 0), x, x + wave(x)), params)
    lcfg = LoRAConfig(**{"rank": 4, "alpha": 8.0, "targets": TARGETS, **lora_kw})
    gd2, p2, base_gd = lora.attach_params(gd, params, lcfg, jax.random.key(1))
    assert base_gd is gd
    return gd, params, gd2, p2, lcfg


def _perturbed(params, std=0.1):
    """``params`` with every adapter B set to normal(0, std) (A keeps its random start)."""
    flat = dict(nnx.to_flat_state(lora.trainable(params)))
    for i, (path, v) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0]))):
        if str(path[-1]).endswith("_lora_b"):
            noise = std * jax.random.normal(jax.random.key(7 + i), v.shape)
            flat[path] = v.replace(noise.astype(v.dtype))
    return lora.with_trainable(params, nnx.from_flat_state(flat))


def _tokens(cfg, rows=3, length=9, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(4, cfg.vocab_size, (rows, length)))


@functools.cache
def _forward(gd):
    """(logits, routes) of the model ``gd``, routes replayed when given; one program each."""

    @jax.jit
    def f(params, tokens, routes=None):
        model = nnx.merge(gd, params)
        x, used = model.routed_features(tokens, routes=routes)
        return model.logits(x), used

    return f


def _expert_adapters(params):
    return {
        p: v for p, v in nnx.to_flat_state(lora.trainable(params)) if "_experts_lora_" in str(p[-1])
    }


def test_expert_targets_are_named_never_matched_by_a_regex():
    assert LoRAConfig(rank=1).projections == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )  # fmt: skip
    # ".*" and "gate.*" keep meaning the dense projections: the experts are opt-in.
    assert LoRAConfig(rank=1, targets=".*").projections == LoRAConfig(rank=1).projections
    assert LoRAConfig(rank=1, targets="gate.*").projections == ("gate_proj",)
    assert LoRAConfig(rank=1, targets="q,experts").projections == (
        "q_proj", "gate_experts", "up_experts", "gate_up_experts", "down_experts",
    )  # fmt: skip
    assert LoRAConfig(rank=1, targets="down_experts,o").projections == ("o_proj", "down_experts")
    with pytest.raises(ConfigError, match="'gate_expert' matches no projection.*'experts'"):
        LoRAConfig(rank=1, targets="gate_expert")


@pytest.mark.parametrize(
    "family, targets, match",
    [
        ("qwen3", "q,experts", "entry 'experts' names experts' weights that M does not have"),
        ("gpt_oss", "gate_experts", r"'gate_experts'.*\['gate_up_experts', 'down_experts'\]"),
        ("qwen3_moe", "q,gate_up_experts", r"'gate_up_experts'.*\['gate_experts', 'up_e"),
    ],
)
def test_expert_targets_the_model_lacks_are_refused_in_one_line(family, targets, match):
    cfg = tiny_model_config(family)
    with pytest.raises(ConfigError, match=match) as e:
        LoRAConfig(rank=2, targets=targets).check_model(cfg, "M")
    assert "\n" not in str(e.value) and "model.lora.targets" in str(e.value)
    LoRAConfig(rank=2, targets="q,v").check_model(cfg, "M")  # dense targets: never refused
    LoRAConfig(rank=0, targets=targets).check_model(cfg, "M")  # LoRA off


@pytest.mark.slow  # compiles the tiny model twice, with and without adapters
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_adapters_start_as_the_base(family):
    """B = 0: the adapted model's logits are the base's; each expert has its own A and B, laid
    out as its weight ([E, in, r] and [E, r, out], on the "experts" axis)."""
    gd, params, gd2, p2, _ = _model(family)
    adapters = _expert_adapters(p2)
    names = {str(p[-1]).removesuffix("_lora_a").removesuffix("_lora_b") for p in adapters}
    assert names == set(WEIGHTS[family])
    cfg = _cfg(family)
    E, r = cfg.num_experts, 4
    model = nnx.merge(gd2, p2)
    for name in WEIGHTS[family]:
        mlp = model.layers[0].mlp
        w = getattr(mlp, name)
        a, b = getattr(mlp, name + "_lora_a"), getattr(mlp, name + "_lora_b")
        assert a.shape == (E, w.shape[1], r) and b.shape == (E, r, w.shape[2])
        axes = w.get_metadata()["logical_axes"]
        assert a.get_metadata()["logical_axes"] == ("experts", axes[1], "lora")
        assert b.get_metadata()["logical_axes"] == ("experts", "lora", axes[2])
        assert not np.asarray(b[...]).any()
        # Each expert's own A, drawn apart: PEFT's uniform(-1/sqrt(in), 1/sqrt(in)).
        a0 = np.asarray(a[...])
        assert np.abs(a0).max() <= 1 / np.sqrt(w.shape[1])
        assert all(not np.array_equal(a0[0], a0[e]) for e in range(1, E))
    tokens = _tokens(cfg)
    want, want_routes = _forward(gd)(params, tokens)
    got, got_routes = _forward(gd2)(p2, tokens)
    np.testing.assert_array_equal(np.asarray(got_routes), np.asarray(want_routes))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _route(mlp, cfg, x_MxD):
    logits = x_MxD @ mlp.router[...]
    if cfg.moe_bias:
        logits = logits + mlp.router_bias[...]
    return moe_lib.route(
        logits, cfg.experts_per_token, cfg.norm_topk_prob,
        softmax_over_topk=cfg.router_softmax_over_topk,
    )  # fmt: skip


@pytest.mark.slow  # eager: each operation of the block and the references compiles alone
@pytest.mark.parametrize("family", FAMILIES)
def test_each_experts_delta_equals_a_dense_reference_with_the_delta_in_its_weights(family):
    """The block with nonzero adapters (grouped dispatch, ragged_dot on the sorted rows) equals
    the dense per-expert reference (every expert on every token) whose weights are W_e plus
    s A_e B_e, built in float64 by hand; the dense reference with the adapters (the einsum
    path) equals it too."""
    _, _, gd2, p2, lcfg = _model(family)
    cfg = _cfg(family)
    mlp = nnx.merge(gd2, _perturbed(p2)).layers[0].mlp
    x_MxD = jnp.asarray(np.random.default_rng(2).normal(size=(11, cfg.hidden_size)), jnp.float32)
    got, used = mlp(x_MxD[None], "fsdp")
    weights_MxK, experts_MxK = _route(mlp, cfg, x_MxD)
    np.testing.assert_array_equal(np.asarray(used[0]), np.asarray(experts_MxK))
    assert len(np.unique(np.asarray(experts_MxK))) == cfg.num_experts  # every expert is used

    def merged(name):  # W_e + s A_e B_e, expert by expert
        w = np.asarray(getattr(mlp, name)[...], np.float64)
        a = np.asarray(getattr(mlp, name + "_lora_a")[...], np.float64)
        b = np.asarray(getattr(mlp, name + "_lora_b")[...], np.float64)
        delta = np.stack([a[e] @ b[e] for e in range(w.shape[0])])
        assert np.abs(delta).max() > 1e-2  # the adapters move every weight
        return jnp.asarray(w + lcfg.scale * delta, jnp.float32)

    adapters = lora.expert_adapters(mlp)
    if family == "gpt_oss":
        args = (
            x_MxD, experts_MxK, weights_MxK, merged("gate_up_experts"), mlp.gate_up_bias[...],
            merged("down_experts"), mlp.down_bias[...], cfg.swiglu_alpha, cfg.swiglu_limit,
        )  # fmt: skip
        want = moe_lib.clamped_dense_experts(*args)
        plain = [mlp.gate_up_experts[...], mlp.gate_up_bias[...], mlp.down_experts[...]]
        einsum = moe_lib.clamped_dense_experts(
            x_MxD, experts_MxK, weights_MxK, plain[0], plain[1], plain[2], mlp.down_bias[...],
            cfg.swiglu_alpha, cfg.swiglu_limit, adapters,
        )  # fmt: skip
    else:
        names = ("gate_experts", "up_experts", "down_experts")
        want = moe_lib.dense_experts(
            x_MxD, experts_MxK, weights_MxK, *map(merged, names), jax.nn.silu
        )
        plain = [getattr(mlp, n)[...] for n in names]
        einsum = moe_lib.dense_experts(
            x_MxD, experts_MxK, weights_MxK, *plain, jax.nn.silu, adapters
        )
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(einsum), np.asarray(want), atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # compiles the adapted, the merged and the scanned models
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_expert_weights_equal_the_adapted_model(family):
    """W + s A B folded expert by expert (float32) gives the adapted model's logits, unrolled
    and scanned; the scanned adapters ([L, E, in, r]) equal the unrolled ones."""
    gd, params, gd2, p2, lcfg = _model(family)
    p3 = _perturbed(p2)
    cfg = _cfg(family)
    tokens = _tokens(cfg)
    adapted, routes = _forward(gd2)(p3, tokens)
    base, _ = _forward(gd)(params, tokens, routes)
    assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-2  # the adapters count
    merged = lora.merged(p3, lcfg.scale)
    got, got_routes = _forward(gd)(merged, tokens)
    np.testing.assert_array_equal(np.asarray(got_routes), np.asarray(routes))
    np.testing.assert_allclose(np.asarray(got), np.asarray(adapted), atol=2e-5, rtol=0)
    if family == "gpt_oss":  # alternating sliding and global layers are not scanned alike
        return
    _, _, gd2s, _, _ = _model(family, scan=True)
    stacked = stack_layers(p3, cfg.num_layers)
    a = stacked["layers"]["mlp"]["down_experts_lora_a"]
    assert a.shape == (cfg.num_layers, cfg.num_experts, cfg.expert_mlp_dim, 4)
    assert a.get_metadata()["logical_axes"] == ("layers", "experts", "mlp", "lora")
    scanned, _ = _forward(gd2s)(stacked, tokens)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(adapted), atol=2e-5, rtol=0)
    gds = nnx.split(create_model(_cfg(family, True), seed=0))[0]
    folded, _ = _forward(gds)(lora.merged(stacked, lcfg.scale), tokens)
    np.testing.assert_allclose(np.asarray(folded), np.asarray(adapted), atol=2e-5, rtol=0)


def _loss_fn(gd2, frozen, tokens):
    """A smooth loss of the adapters: weighted log-probs of the next tokens."""
    w = jnp.asarray(np.random.default_rng(5).normal(size=tokens[:, 1:].shape), jnp.float32)

    def loss(trained):
        model = nnx.merge(gd2, lora.with_trainable(frozen, trained))
        logp = jax.nn.log_softmax(model(tokens)[:, :-1], axis=-1)
        return jnp.sum(w * jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0])

    return loss


@pytest.mark.slow  # the gradient's program and a dozen forward passes
def test_expert_adapter_gradient_is_finite_and_matches_central_differences():
    """Every expert adapter gets a finite, nonzero gradient; one entry of an expert's A against
    central differences. Qwen3-MoE's one layer: the routing comes before the experts, so
    moving an expert adapter moves no route."""
    _, _, gd2, p2, _ = _model("qwen3_moe")
    p3 = _perturbed(p2)
    cfg = _cfg("qwen3_moe")
    tokens = _tokens(cfg)
    loss = _loss_fn(gd2, p3, tokens)
    trained = lora.trainable(p3)
    g = jax.jit(jax.grad(loss))(trained)
    flat_g = dict(nnx.to_flat_state(g))
    assert set(flat_g) == set(dict(nnx.to_flat_state(trained)))  # the adapters, nothing else
    for path, v in flat_g.items():
        x = np.asarray(v.get_value())
        assert np.isfinite(x).all() and np.abs(x).max() > 0, path
        if "_experts_lora_" in str(path[-1]):  # every expert of every weight is reached
            assert all(np.abs(x[e]).max() > 0 for e in range(cfg.num_experts)), path
    path = ("layers", 0, "mlp", "gate_experts_lora_a")
    e, i, j = 2, 5, 1
    base = dict(nnx.to_flat_state(trained))

    def at(delta):
        flat = dict(base)
        flat[path] = flat[path].replace(flat[path].get_value().at[e, i, j].add(delta))
        return nnx.from_flat_state(flat)

    f = jax.jit(loss)
    h = 1e-2
    numeric = (float(f(at(h))) - float(f(at(-h)))) / (2 * h)
    analytic = float(np.asarray(flat_g[path].get_value())[e, i, j])
    assert abs(analytic) > 1e-3
    np.testing.assert_allclose(analytic, numeric, rtol=2e-3)


@pytest.mark.slow
def test_expert_adapter_dropout_only_inside_its_block():
    """Dropout on the experts' adapters draws its masks from the key inside the block, and
    nothing of it is left outside; with only the experts adapted, the experts alone drop."""
    _, _, gd2, p2, _ = _model("qwen3_moe", dropout=0.5, targets="experts")
    p3 = _perturbed(p2)
    tokens = _tokens(_cfg("qwen3_moe"))
    plain = np.asarray(_forward(gd2)(p3, tokens)[0])

    @jax.jit
    def dropped(p, key):
        with lora.dropout(key, 0.5):
            return nnx.merge(gd2, p)(tokens)

    a, a2 = np.asarray(dropped(p3, jax.random.key(0))), np.asarray(dropped(p3, jax.random.key(0)))
    b = np.asarray(dropped(p3, jax.random.key(1)))
    np.testing.assert_array_equal(a, a2)
    assert np.abs(a - plain).max() > 1e-3 and np.abs(a - b).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(_forward(gd2)(p3, tokens)[0]), plain)


def test_memory_plan_counts_the_expert_adapters_of_the_model():
    """The plan's trainable count is the adapters the model really gets, and tiny:qwen3_moe's
    by hand: per expert weight E (in + out) r, per layer."""
    cfg = _cfg("qwen3_moe")
    kw = dict(mesh_shape={}, layout="dp", batch_rows=8, seq_len=4, prompt_len=4, beta=0.0)
    lcfg = LoRAConfig(rank=8, targets="experts")
    est = memory.estimate(cfg, lora_rank=8, lora_targets=lcfg.projections, **kw)
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.expert_mlp_dim
    assert est.trainable_params == cfg.num_layers * 3 * E * (D + F) * 8
    model = create_model(cfg, seed=0)
    lora.attach(model, lcfg, jax.random.key(0))
    real = sum(x.size for x in jax.tree.leaves(lora.trainable(nnx.state(model))))
    assert est.trainable_params == real
    # x A saved for each of a token's K experts: 4 bytes * K r per expert weight, layer and
    # token, over 8 rows of 4 + 4 tokens.
    q = memory.estimate(cfg, lora_rank=8, lora_targets=("q_proj",), **kw)
    both = memory.estimate(cfg, lora_rank=8, lora_targets=("q_proj",) + lcfg.projections, **kw)
    K, L = cfg.experts_per_token, cfg.num_layers
    assert both.activations - q.activations == 8 * (4 + 4) * L * 4 * 3 * K * 8


def _device_bytes(tree, device):
    return sum(
        s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
        if s.device == device
    )  # fmt: skip


@pytest.mark.slow  # compiles the forward and its gradient on 8 devices
@pytest.mark.parametrize("family", FAMILIES)
def test_expert_sharded_lora_equals_single_device(family):
    """expert 4 x fsdp 2: each device holds one expert's adapters, split over fsdp as its
    weight; the logits and the adapters' gradient equal one device's. The memory plan's
    per-device parameters are what device 0 holds."""
    _, _, gd2, p2, lcfg = _model(family)
    p3 = jax.tree.map(np.asarray, _perturbed(p2))
    cfg = _cfg(family)
    tokens = _tokens(cfg, rows=4)
    one = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    mesh = sharding.make_mesh({"expert": 4, "fsdp": 2}, jax.devices()[:8])

    def run(m):
        p = jax.device_put(p3, param_shardings(p3, m, "fsdp"))
        rows = jax.device_put(tokens, sharding.batch_sharding(m))
        with jax.set_mesh(m):
            logits, routes = _forward(gd2)(p, rows)
            g = jax.jit(jax.grad(_loss_fn(gd2, p, rows)))(lora.trainable(p))
        return p, logits, routes, g

    _, want, want_routes, want_g = run(one)
    p, got, got_routes, got_g = run(mesh)
    mlp = p["layers"][0]["mlp"]
    first = "gate_up_experts" if family == "gpt_oss" else "gate_experts"
    a, b = mlp[first + "_lora_a"][...], mlp[first + "_lora_b"][...]
    assert a.sharding.spec == P("expert", "fsdp", None) and b.sharding.spec[:2] == ("expert", None)
    assert a.addressable_shards[0].data.shape == (1, cfg.hidden_size // 2, 4)
    down_b = mlp["down_experts_lora_b"][...]
    assert down_b.sharding.spec == P("expert", None, "fsdp")
    assert got_g["layers"][0]["mlp"][first + "_lora_a"][...].sharding.spec[0] == "expert"
    np.testing.assert_array_equal(np.asarray(got_routes), np.asarray(want_routes))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    flat_want, flat_got = dict(nnx.to_flat_state(want_g)), dict(nnx.to_flat_state(got_g))
    assert flat_got.keys() == flat_want.keys()
    for path, w in flat_want.items():
        w, gv = np.asarray(w.get_value()), np.asarray(flat_got[path].get_value())
        assert np.abs(w).max() > 0, path
        np.testing.assert_allclose(gv, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=str(path))
    est = memory.estimate(
        cfg, mesh_shape=mesh.shape, layout="fsdp", batch_rows=4, seq_len=4, prompt_len=4,
        beta=0.0, lora_rank=lcfg.rank, lora_targets=lcfg.projections,
    )  # fmt: skip
    dev = mesh.devices.flat[0]
    base, adapters = lora.split(p)
    assert est.params == _device_bytes(base, dev) + _device_bytes(adapters, dev)


@pytest.mark.slow  # one jitted GRPO update
@pytest.mark.parametrize("family", FAMILIES)
def test_update_trains_the_expert_adapters_only(family, one_device_mesh):
    """One GRPO update (beta > 0: the base with adapters off is the reference): optimizer
    state for the adapters only, the base untouched bit for bit, every adapter moved, every
    expert's adapter included."""
    from helpers_batches import rollout_batch

    from grpo_jax.learner import optimizer
    from grpo_jax.learner import update as upd
    from grpo_jax.run.config import GRPOConfig, OptimConfig

    _, _, gd2, p2, _ = _model(family)
    mesh = one_device_mesh
    p3 = jax.device_put(_perturbed(p2), sharding.replicated(mesh))
    cfg = _cfg(family)
    rng = np.random.default_rng(0)
    rows = dict(
        prompt_tokens=rng.integers(4, cfg.vocab_size, (8, 5)).astype(np.int32),
        prompt_mask=np.ones((8, 5), bool),
        tokens=rng.integers(4, cfg.vocab_size, (8, 4)).astype(np.int32),
        mask=np.ones((8, 4), bool),
    )
    batch = rollout_batch(gd2, p3, rows, rng.normal(size=8).astype(np.float32))
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    state = optimizer.init_state(p3, tx, mesh, trained=lora.trainable(p3))
    n_adapters = sum(x.size for x in jax.tree.leaves(lora.trainable(p3)))
    assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == 2 * n_adapters
    step = upd.jit_update(
        graphdef=gd2, tx=tx, schedule=schedule, grpo=GRPOConfig(G=4, beta=0.1),
        minibatch_size=0, grad_accum=1, batch_shards=sharding.batch_shards(mesh),
        track_update=False, state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh), ref_shardings=None,
        replicated=sharding.replicated(mesh), base_graphdef=nnx.split(create_model(cfg))[0],
    )  # fmt: skip
    before = jax.tree.map(np.asarray, p3)
    new, metrics = step(state, batch, jax.random.key(0), None)
    assert np.isfinite(float(metrics["train/loss"])) and float(metrics["train/kl"]) > 0
    base_before, ad_before = lora.split(before)
    base_after, ad_after = lora.split(new.params)
    for x, y in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    flat_after = dict(nnx.to_flat_state(ad_after))
    for path, x in nnx.to_flat_state(ad_before):
        y = np.asarray(flat_after[path].get_value())
        assert np.isfinite(y).all()
        moved = np.asarray(x.get_value()) != y
        assert moved.any(), path
        if "_experts_lora_" in str(path[-1]):
            assert all(moved[e].any() for e in range(cfg.num_experts)), path


def test_expert_targets_on_a_dense_model_stop_the_run_at_start_up(builtin_tokenizer):
    """The built-in dense model with model.lora.targets naming experts: the builder refuses
    it before any weight is made."""
    from configs.default import get_config
    from grpo_jax.run import builders
    from grpo_jax.run.config import parse_config

    c = get_config("smoke")
    c.model.lora.rank, c.model.lora.targets = 2, "q,down_experts"
    run = parse_config(c)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    with pytest.raises(ConfigError, match="'down_experts' names experts' weights that the bui"):
        builders.build_model(run, builtin_tokenizer, mesh)
