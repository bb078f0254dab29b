"""LoRA (grpo_jax.models.lora): exact zero start, hand-computed projections, the reference
with adapters off, merged weights, gradients for adapters only, the memory plan, config errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_jit import completion_logps

from grpo_jax.core import sharding
from grpo_jax.learner import optimizer
from grpo_jax.learner import update as upd
from grpo_jax.models import create_model, lora, stack_layers, tiny_config
from grpo_jax.run import memory
from grpo_jax.run.config import ConfigError, GRPOConfig, LoRAConfig, OptimConfig, parse_config

V = 64
CFG = tiny_config(
    V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48
)
LORA = LoRAConfig(rank=4, alpha=8.0)


def _model(family="qwen2", scan=False, **lora_kw):
    cfg = CFG.replace(scan_layers=scan)
    if family != "qwen2":
        cfg = tiny_config(
            V,
            family=family,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            mlp_dim=48,
            sliding_window=3,
            scan_layers=scan,
        )
    gd, params = nnx.split(create_model(cfg, seed=0))
    lcfg = LoRAConfig(**{"rank": 4, "alpha": 8.0, **lora_kw})
    gd2, p2, base_gd = lora.attach_params(gd, params, lcfg, jax.random.key(1))
    return gd, params, gd2, p2, base_gd, lcfg


def _perturbed(params, seed=3, std=0.1):
    """``params`` with every adapter B set to normal(0, std) (A keeps its random start)."""
    adapters = lora.trainable(params)
    flat = dict(nnx.to_flat_state(adapters))
    for i, (path, v) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0]))):
        if str(path[-1]).endswith("_lora_b"):
            noise = std * jax.random.normal(jax.random.key(seed + i), v.shape)
            flat[path] = v.replace(noise.astype(v.dtype))
    return lora.with_trainable(params, nnx.from_flat_state(flat))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 7)), jnp.int32)
MASK = jnp.asarray([[0, 0, 1, 1, 1, 1, 1], [1] * 7], bool)


_JITTED = {}


def _logits(gd, params):
    """The model's float32 logits on TOKENS, compiled once per graphdef."""
    if gd not in _JITTED:
        _JITTED[gd] = jax.jit(lambda p: nnx.merge(gd, p)(TOKENS, mask_BxT=MASK))
    return np.asarray(_JITTED[gd](params))


@pytest.mark.slow  # 14-29 s each on two cores, most of it compilation
@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
@pytest.mark.parametrize("scan", [False, True])
def test_adapters_at_zero_give_exactly_the_base_logits(family, scan):
    """Bit for bit (x A B adds exact zeros), except where XLA fuses a Gemma layer's float32
    norms differently once the adapter term is in the program: there to the last bit."""
    gd, params, gd2, p2, base_gd, _ = _model(family, scan)
    base = _logits(gd, params)
    if family == "gemma3":
        np.testing.assert_allclose(_logits(gd2, p2), base, atol=3e-7, rtol=0)
    else:
        np.testing.assert_array_equal(_logits(gd2, p2), base)
    # The reference: the same base arrays under the graphdef without adapters.
    np.testing.assert_array_equal(_logits(base_gd, lora.split(p2)[0]), base)


@pytest.mark.slow  # 14-29 s each on two cores, most of it compilation
@pytest.mark.parametrize("scan", [False, True])
def test_reference_with_adapters_off_is_the_frozen_base_and_merged_equals_unmerged(scan):
    gd, params, gd2, p2, base_gd, lcfg = _model(scan=scan)
    p3 = _perturbed(p2)
    policy = _logits(gd2, p3)
    base = _logits(gd, params)
    assert np.abs(policy - base).max() > 1e-2  # the adapters move the logits
    base_half, _ = lora.split(p3)
    for (_, x), (_, y) in zip(
        nnx.to_flat_state(base_half), nnx.to_flat_state(params), strict=True
    ):  # no copy and no change: the base half holds the very arrays of the base
        assert x.get_value() is y.get_value()
    np.testing.assert_array_equal(_logits(base_gd, base_half), base)
    merged = _logits(base_gd, lora.merged(p3, lcfg.scale))
    np.testing.assert_allclose(merged, policy, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_projection_adds_the_low_rank_term_by_hand():
    """MLP up_proj: y = x W + (alpha / r) (x A) B, checked against numpy in float64."""
    gd, params, gd2, p2, _, lcfg = _model(targets=("up",))
    p3 = _perturbed(p2)
    model = nnx.merge(gd2, p3)
    mlp = model.layers[0].mlp
    assert not hasattr(mlp, "gate_proj_lora_a") and hasattr(mlp, "up_proj_lora_a")
    x = np.random.default_rng(1).normal(size=(5, 32)).astype(np.float32)
    W = np.asarray(mlp.up_proj[...], np.float64)
    A = np.asarray(mlp.up_proj_lora_a[...], np.float64)
    B = np.asarray(mlp.up_proj_lora_b[...], np.float64)
    want = x @ W + (8.0 / 4) * (x @ A) @ B
    got = lora.add(mlp, "up_proj", jnp.asarray(x), jnp.asarray(x) @ mlp.up_proj[...])
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    # PEFT's start: A uniform(-1/sqrt(in), 1/sqrt(in)), B zero.
    a0 = np.asarray(nnx.merge(gd2, p2).layers[0].mlp.up_proj_lora_a[...])
    assert np.abs(a0).max() <= 1 / np.sqrt(32) and np.abs(a0).max() > 0.5 / np.sqrt(32)
    assert not np.asarray(nnx.merge(gd2, p2).layers[0].mlp.up_proj_lora_b[...]).any()


@pytest.mark.slow
def test_scanned_adapters_equal_unrolled():
    _, _, gd2, p2, _, _ = _model(scan=False)
    _, _, gd2s, _, _, _ = _model(scan=True)
    p3 = _perturbed(p2)
    stacked = stack_layers(p3, CFG.num_layers)
    np.testing.assert_allclose(_logits(gd2s, stacked), _logits(gd2, p3), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_adapter_gradient_is_the_chain_rule_of_the_weight_gradient():
    """At B = 0: dL/dB = s A^T dL/dW and dL/dA = 0 (for every adapted projection)."""
    gd, params, gd2, p2, _, lcfg = _model()

    def loss_of(gdef, p):
        logits = nnx.merge(gdef, p)(TOKENS, mask_BxT=MASK)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

    g_base = dict(nnx.to_flat_state(jax.jit(jax.grad(lambda p: loss_of(gd, p)))(params)))
    frozen = p2
    g = jax.jit(jax.grad(lambda t: loss_of(gd2, lora.with_trainable(frozen, t))))(
        lora.trainable(p2)
    )
    g = dict(nnx.to_flat_state(g))
    flat = dict(nnx.to_flat_state(p2))
    checked = 0
    for path, gb in g.items():
        if not str(path[-1]).endswith("_lora_b"):
            assert not np.asarray(gb.get_value()).any()  # dL/dA = 0 while B = 0
            continue
        w_path = (*path[:-1], str(path[-1])[: -len("_lora_b")])
        a = np.asarray(flat[(*w_path[:-1], f"{w_path[-1]}_lora_a")].get_value())
        gw = np.asarray(g_base[w_path].get_value())
        r = a.shape[-1]
        want = lcfg.scale * a.reshape(-1, r).T @ gw.reshape(a.reshape(-1, r).shape[0], -1)
        got = np.asarray(gb.get_value()).reshape(r, -1)
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-4, err_msg=str(path))
        checked += 1
    assert checked == 2 * 7


def _rows(n=8, p=5, t=4, seed=0):
    rng = np.random.default_rng(seed)
    m = np.ones((n, t), bool)
    m[::2, 2:] = False
    return dict(
        prompt_tokens=rng.integers(4, V, (n, p)).astype(np.int32),
        prompt_mask=np.ones((n, p), bool),
        tokens=rng.integers(4, V, (n, t)).astype(np.int32),
        mask=m,
    )


def _lora_update(gd2, base_gd, state, mesh, tx, schedule, grpo, *, track_update):
    """The jitted update of a LoRA policy (graphdef ``gd2``, reference ``base_gd``) on ``mesh``."""
    return upd.jit_update(
        graphdef=gd2,
        tx=tx,
        schedule=schedule,
        grpo=grpo,
        minibatch_size=0,
        grad_accum=1,
        batch_shards=sharding.batch_shards(mesh),
        track_update=track_update,
        state_shardings=jax.tree.map(lambda x: x.sharding, state),
        batch_shardings=upd.rollout_batch_shardings(mesh),
        ref_shardings=None,
        replicated=sharding.replicated(mesh),
        base_graphdef=base_gd,
    )


@pytest.mark.slow
def test_update_trains_adapters_only_with_the_base_as_reference(one_device_mesh):
    """Optimizer state for adapters only; the base is untouched bit for bit; with beta > 0
    the KL term is measured against the base with adapters off (checked by hand)."""
    from helpers_batches import rollout_batch

    _, params, gd2, p2, base_gd, _ = _model()
    p3 = _perturbed(p2)
    mesh = one_device_mesh
    p3 = jax.device_put(p3, sharding.replicated(mesh))
    rows = _rows()
    adv = np.random.default_rng(1).normal(size=8).astype(np.float32)
    batch = rollout_batch(gd2, p3, rows, adv)
    grpo = GRPOConfig(G=4, beta=0.1)
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    state = optimizer.init_state(p3, tx, mesh, trained=lora.trainable(p3))
    n_adapters = sum(x.size for x in jax.tree.leaves(lora.trainable(p3)))
    # Adam's two moments, each the adapters' size; the rest are scalar counters.
    assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == 2 * n_adapters
    fn = _lora_update(gd2, base_gd, state, mesh, tx, schedule, grpo, track_update=True)
    before = jax.tree.map(np.asarray, p3)
    new, metrics = fn(state, batch, jax.random.key(0), None)
    base_before, ad_before = lora.split(before)
    base_after, ad_after = lora.split(new.params)
    for x, y in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    moved = [
        not np.array_equal(x, np.asarray(y))
        for x, y in zip(jax.tree.leaves(ad_before), jax.tree.leaves(ad_after), strict=True)
    ]
    assert all(moved)
    # The KL metric of the (only) update, by hand: k3 of the base against the policy.
    args = (rows["prompt_tokens"], rows["prompt_mask"], rows["tokens"], rows["mask"], 1.0)
    pol = np.asarray(completion_logps(gd2, before, *args), np.float64)
    ref = np.asarray(completion_logps(base_gd, base_before, *args), np.float64)
    m = rows["mask"]
    d = ref - pol
    kl = ((np.exp(d) - d - 1) * m).sum() / m.sum()  # k3, token mean (the metric's)
    assert kl > 1e-4  # the adapters made a difference to measure
    np.testing.assert_allclose(float(metrics["train/kl"]), kl, rtol=2e-4)


def test_memory_plan_counts_adapters_by_hand():
    """Qwen2-style 2-layer model, rank 4 on q and down: per layer q A [32, 4] + B [4, 4, 8],
    down A [48, 4] + B [4, 32]; float32 adapters, bfloat16 base, no reference copy."""
    kw = dict(mesh_shape={}, layout="dp", batch_rows=8, seq_len=4, prompt_len=4, beta=0.1)
    full = memory.estimate(CFG, param_bytes=2, **kw)
    est = memory.estimate(
        CFG, param_bytes=2, lora_rank=4, lora_targets=("q_proj", "down_proj"), **kw
    )
    per_layer = 32 * 4 + 4 * 32 + 48 * 4 + 4 * 32
    n = 2 * per_layer
    assert est.trainable_params == n
    assert est.params == full.params + 4 * n
    assert est.grads == 4 * n and est.optimizer == 2 * 4 * n and est.reference == 0
    assert full.reference == full.params and full.grads == full.params
    # x A is kept for the backward pass: 4 bytes * r * 2 targets per layer and token.
    assert est.activations - full.activations == 8 * 8 * 2 * (4 * 4 * 2)
    assert "LoRA: 1,152 trainable" in est.table()


def test_memory_plan_of_a_run_reads_model_lora():
    from configs.default import get_config

    c = get_config("runlocal")
    c.model.lora.rank = 2
    run = parse_config(c)
    est = memory.plan_run(run, CFG, {"data": 1})
    full = memory.plan_run(parse_config(get_config("runlocal")), CFG, {"data": 1})
    assert est.trainable_params == 2 * 2 * (3 * (32 + 48) + (32 + 32) + 2 * (32 + 16) + (32 + 32))
    assert est.grads == 4 * est.trainable_params and full.grads == full.params


@pytest.mark.parametrize(
    "lora_cfg, match",
    [
        ({"rank": -1}, "model.lora.rank"),
        ({"rank": 2, "alpha": 0.0}, "model.lora.alpha"),
        ({"rank": 2, "dropout": 1.0}, "model.lora.dropout"),
        ({"rank": 2, "targets": "q,qq"}, "'qq' matches no projection"),
        ({"rank": 2, "targets": "q_(proj"}, "not a valid regular expression"),
        ({"rank": 2, "tagets": "q"}, "model.lora.tagets"),
    ],
)
def test_config_errors_name_the_key(lora_cfg, match):
    from configs.default import get_config

    c = get_config("runlocal").to_dict()
    c["model"]["lora"] = {**c["model"]["lora"], **lora_cfg}
    with pytest.raises(ConfigError, match=match):
        parse_config(c)


def test_targets_by_name_and_regex():
    assert LoRAConfig(rank=1, targets="q,v").projections == ("q_proj", "v_proj")
    assert LoRAConfig(rank=1, targets=("(gate|up)_proj", "o")).projections == (
        "o_proj",
        "gate_proj",
        "up_proj",
    )
    assert LoRAConfig(rank=1, targets=".*").projections == LoRAConfig(rank=1).projections
    assert LORA.scale == 2.0


@pytest.mark.slow
def test_dropout_only_inside_its_block_and_fresh_masks_per_key():
    _, _, gd2, p2, _, _ = _model(dropout=0.5)
    p3 = _perturbed(p2)
    plain = _logits(gd2, p3)

    @jax.jit
    def dropped(p, key):  # the block is entered while tracing: the masks follow ``key``
        with lora.dropout(key, 0.5):
            return nnx.merge(gd2, p)(TOKENS, mask_BxT=MASK)

    a, a2 = dropped(p3, jax.random.key(0)), dropped(p3, jax.random.key(0))
    b = dropped(p3, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a2))
    assert np.abs(a - plain).max() > 1e-3 and np.abs(a - b).max() > 1e-3
    np.testing.assert_array_equal(_logits(gd2, p3), plain)  # nothing left behind


@pytest.mark.slow  # 14-29 s each on two cores, most of it compilation
def test_fingerprint_changes_with_the_weights_not_with_the_copy():
    _, params, *_ = _model()
    fp = lora.fingerprint(params)
    assert fp == lora.fingerprint(jax.tree.map(jnp.copy, params))
    flat = dict(nnx.to_flat_state(params))
    path = next(p for p in flat if p[-1] == "embed")
    flat[path] = flat[path].replace(flat[path].get_value() * 1.001)
    assert lora.fingerprint(nnx.from_flat_state(flat)) != fp


@pytest.mark.slow
def test_update_with_a_bfloat16_base_on_8_devices_equals_one_device():
    """A bfloat16 base with float32 adapters, on a 2 x 4 (data x fsdp) mesh of 8 devices and on
    one device: the base stays bfloat16 and untouched, only the adapters move, and the sharded
    update gives the single-device adapters and metrics."""
    from helpers_batches import rollout_batch

    from grpo_jax.models import param_shardings

    cfg = CFG.replace(param_dtype="bfloat16")
    gd, params = nnx.split(create_model(cfg, seed=0))
    gd2, p2, base_gd = lora.attach_params(gd, params, LORA, jax.random.key(1))
    p3 = jax.tree.map(np.asarray, _perturbed(p2))  # host copies: the update donates its state
    base0, ad0 = lora.split(p3)
    assert {x.dtype for x in jax.tree.leaves(base0)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(ad0)} == {jnp.dtype(jnp.float32)}
    rows = _rows()
    adv = np.random.default_rng(1).normal(size=8).astype(np.float32)
    grpo = GRPOConfig(G=4, beta=0.1)
    tx, schedule = optimizer.make_optimizer(OptimConfig(learning_rate=1e-2), 10)

    def run(mesh, layout):
        p = jax.device_put(p3, param_shardings(p3, mesh, layout))
        state = optimizer.init_state(p, tx, mesh, trained=lora.trainable(p))
        batch = jax.device_put(rollout_batch(gd2, p3, rows, adv), upd.rollout_batch_shardings(mesh))
        fn = _lora_update(gd2, base_gd, state, mesh, tx, schedule, grpo, track_update=False)
        with jax.set_mesh(mesh):
            new, metrics = fn(state, batch, jax.random.key(0), None)
        return jax.tree.map(np.asarray, new.params), {k: float(v) for k, v in metrics.items()}

    one, m1 = run(sharding.make_mesh({"data": 1}, jax.devices()[:1]), "dp")
    eight, m8 = run(sharding.make_mesh({"data": 2, "fsdp": 4}), "fsdp")
    for got in (one, eight):
        base, ad = lora.split(got)
        for x, y in zip(jax.tree.leaves(base0), jax.tree.leaves(base), strict=True):
            assert y.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(x), y)
        assert all(
            not np.array_equal(np.asarray(x), y)
            for x, y in zip(jax.tree.leaves(ad0), jax.tree.leaves(ad), strict=True)
        )
    # Adam's first step moves each entry by about lr * g / |g| (1e-2): the 8 shards' gradient
    # sums round differently, which near-zero entries turn into differences of ~1e-5 there.
    for x, y in zip(jax.tree.leaves(lora.trainable(one)), jax.tree.leaves(lora.trainable(eight))):
        np.testing.assert_allclose(y, x, atol=2e-5, rtol=0)
    assert m1.keys() == m8.keys()
    for k in m1:
        np.testing.assert_allclose(m8[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_dropout_holds_for_its_own_thread_only():
    """The trainer traces the update (dropout on, a traced key) on one thread while it traces
    the sampler on another: the sampler's forward must see no dropout and no key of the
    update's. A process-wide setting leaked the update's traced key into the sampler's trace
    (UnexpectedTracerError on a LoRA run with dropout, when the two traces overlapped)."""
    import threading

    _, _, gd2, p2, _, _ = _model(dropout=0.5)
    p3 = _perturbed(p2)
    forward = jax.jit(lambda p: nnx.merge(gd2, p)(TOKENS, mask_BxT=MASK))
    plain = np.asarray(forward(p3))
    inside, leave = threading.Event(), threading.Event()

    def update_thread():
        with lora.dropout(jax.random.key(0), 0.5):
            inside.set()
            leave.wait(timeout=60)

    other = threading.Thread(target=update_thread)
    other.start()
    try:
        assert inside.wait(timeout=60)
        # Traced afresh on this thread while the other thread is inside its block.
        seen = jax.jit(lambda p: nnx.merge(gd2, p)(TOKENS, mask_BxT=MASK))(p3)
    finally:
        leave.set()
        other.join()
    np.testing.assert_array_equal(np.asarray(seen), plain)
