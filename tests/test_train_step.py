"""The jitted GRPO update: ratio 1 on the first pass, guard, accumulation, schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import models, sharding
from grpo_jax import train_step as ts
from grpo_jax.config import GRPOConfig, OptimConfig

N, P, T, V = 8, 6, 5, 100


@pytest.fixture(scope="module")
def setup():
    cfg = models.tiny_config(
        V, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64
    )
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    graphdef, params = nnx.split(models.create_model(cfg, seed=0, mesh=mesh))
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
        advantages=rng.normal(size=N).astype(np.float32),
    )
    old = jax.jit(lambda p, b: ts.completion_logps(graphdef, p, b, 1.0))(params, batch)
    batch["old_logps"] = np.asarray(old) * m
    return graphdef, params, mesh, batch


_FNS = {}


def _step(setup, *, grpo=None, minibatch_size=0, grad_accum=1, beta_ref=False, logits_chunk=0):
    """A fresh state and the jitted step, compiled once per configuration per module."""
    graphdef, params, mesh, _ = setup
    grpo = grpo or GRPOConfig(G=4)
    tx, schedule = ts.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    state = ts.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    key = (grpo, minibatch_size, grad_accum, beta_ref, logits_chunk)
    if key not in _FNS:
        _FNS[key] = ts.jit_train_step(
            graphdef=graphdef,
            tx=tx,
            schedule=schedule,
            grpo=grpo,
            minibatch_size=minibatch_size,
            grad_accum=grad_accum,
            batch_shards=1,
            track_update=True,
            logits_chunk=logits_chunk,
            state_shardings=jax.tree.map(lambda x: x.sharding, state),
            batch_sharding_fn=lambda nd: sharding.batch_sharding(mesh, nd),
            ref_shardings=jax.tree.map(lambda x: x.sharding, params) if beta_ref else None,
            replicated=sharding.replicated(mesh),
        )
    return state, _FNS[key]


def _leaves_equal(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _assert_same_update(one, other, keys, *, params_atol, metrics_rtol=1e-5, metrics_atol=1e-6):
    """Two (state, metrics) results of one update: parameters and the named metrics agree."""
    (a, ma), (b, mb) = one, other
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=params_atol, rtol=1e-5)
    for k in keys:
        np.testing.assert_allclose(ma[k], mb[k], rtol=metrics_rtol, atol=metrics_atol, err_msg=k)


def test_first_update_starts_at_ratio_one_and_moves_params(setup):
    graphdef, params, _, batch = setup
    state, fn = _step(setup)
    new, m = fn(state, batch, jax.random.key(0), None)
    m = jax.device_get(m)
    # pi_old was recorded from the same parameters: the ratio is exactly 1 up to
    # float error on the (only) update, so nothing is clipped.
    assert abs(m["train/ratio_max"] - 1) < 1e-5 and abs(m["train/ratio_min"] - 1) < 1e-5
    assert m["train/clip_frac_low"] == 0 and m["train/clip_frac_high"] == 0
    assert m["train/updates"] == 1 and m["train/skipped_updates"] == 0
    assert np.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    assert "train/kl" not in m  # beta = 0: no reference model anywhere.
    assert m["policy/kl_old_new"] > 0
    assert int(new.step) == 1
    assert not _leaves_equal(new.params, params)


def test_nonfinite_update_is_skipped_and_counted(setup):
    _, params, _, batch = setup
    state, fn = _step(setup)
    bad = dict(batch, advantages=np.full(N, np.nan, np.float32))
    # A real update first, so the skipped one has non-zero Adam moments to keep.
    state, _ = fn(state, batch, jax.random.key(0), None)
    params, opt_before = jax.device_get((state.params, state.opt_state))
    s1, m1 = fn(state, bad, jax.random.key(0), None)
    m1 = jax.device_get(m1)
    assert m1["train/skipped_updates"] == 1 and m1["train/skipped_in_row"] == 1
    assert _leaves_equal(s1.params, params)  # The NaN never reached the parameters.
    assert _leaves_equal(s1.opt_state, opt_before)  # Nor the optimizer's moments.
    assert int(s1.updates) == 1
    s2, m2 = fn(s1, bad, jax.random.key(1), None)
    assert int(jax.device_get(m2["train/skipped_in_row"])) == 2
    s3, m3 = fn(s2, batch, jax.random.key(2), None)
    m3 = jax.device_get(m3)
    assert m3["train/skipped_in_row"] == 0 and m3["train/skipped_total"] == 2
    assert int(s3.updates) == 2 and np.isfinite(m3["train/loss"])


@pytest.mark.parametrize("reduction", ["grpo", "token_mean", "dr_grpo"])
def test_grad_accumulation_matches_one_big_minibatch(setup, reduction):
    _, params, _, batch = setup
    # Micro-batches with different token counts (rows 0-3 short, 4-7 full): a
    # token mean over the minibatch is not the mean of the micro-batches' means.
    mask = np.ones((N, T), bool)
    mask[:4, 2:] = False
    batch = dict(batch, mask=mask, old_logps=batch["old_logps"] * mask)
    grpo = GRPOConfig(G=4, beta=0.1, reduction=reduction)
    s_a, fn_a = _step(setup, grpo=grpo, grad_accum=1, beta_ref=True)
    s_b, fn_b = _step(setup, grpo=grpo, grad_accum=2, beta_ref=True)
    # One AdamW step of lr 1e-2 moves a parameter by ~lr * g / (|g| + eps): float32
    # noise matters only where |g| is near eps, hence 1e-4 (a wrong weighting moves ~1e-2).
    _assert_same_update(
        fn_a(s_a, batch, jax.random.key(0), params),
        fn_b(s_b, batch, jax.random.key(0), params),
        ("train/loss", "train/grad_norm", "train/kl", "train/entropy"),
        params_atol=1e-4,
    )


def test_logits_chunk_gives_the_same_update(setup):
    _, params, _, batch = setup
    grpo = GRPOConfig(G=4, beta=0.1)
    s_a, fn_a = _step(setup, grpo=grpo, beta_ref=True)
    s_b, fn_b = _step(setup, grpo=grpo, beta_ref=True, logits_chunk=1)  # T = 5 chunks of 1
    _assert_same_update(
        fn_a(s_a, batch, jax.random.key(0), params),
        fn_b(s_b, batch, jax.random.key(0), params),
        ("train/loss", "train/entropy", "train/kl", "policy/kl_old_new"),
        params_atol=2e-6,
        metrics_atol=1e-7,
    )


def test_minibatches_mu_and_frozen_reference(setup):
    _, params, _, batch = setup
    grpo = GRPOConfig(G=4, mu=2, beta=0.1)
    state, fn = _step(setup, grpo=grpo, minibatch_size=4, beta_ref=True)
    _, m = jax.device_get(fn(state, batch, jax.random.key(0), params))
    assert m["train/updates"] == 4  # mu * N / minibatch = 2 * 8 / 4
    # Later updates are off-policy: the ratio has moved away from 1, and the
    # policy away from the frozen reference (KL >= 0, k3 is never negative).
    assert m["train/ratio_max"] > 1 + 1e-4 or m["train/ratio_min"] < 1 - 1e-4
    assert 0 < m["train/kl"] < 1


def test_split_rows_takes_every_shard():
    x = jnp.arange(8)
    parts = ts._split_rows(x, 2, 2)  # 2 shards of rows [0..3], [4..7]; 2 parts
    np.testing.assert_array_equal(np.asarray(parts), [[0, 1, 4, 5], [2, 3, 6, 7]])


def test_lr_schedules():
    warm = ts.lr_schedule(OptimConfig(learning_rate=1.0, warmup_steps=4), 10)
    assert [float(warm(i)) for i in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]
    cos = ts.lr_schedule(OptimConfig(learning_rate=1.0, schedule="cosine", end_lr_factor=0.1), 11)
    assert float(cos(0)) == pytest.approx(1.0) and float(cos(10)) == pytest.approx(0.1)
    lin = ts.lr_schedule(OptimConfig(learning_rate=1.0, schedule="linear"), 5)
    assert float(lin(0)) == 1.0 and float(lin(4)) == pytest.approx(0.0)


def test_completion_logits_score_only_the_completion_positions(setup):
    graphdef, params, _, batch = setup
    model = nnx.merge(graphdef, params)
    full = np.concatenate([batch["prompt_tokens"], batch["tokens"]], axis=1)
    full_mask = np.concatenate([batch["prompt_mask"], batch["mask"]], axis=1)
    want = model(jnp.asarray(full), mask_BxT=jnp.asarray(full_mask))[:, P - 1 : P + T - 1]
    got = ts.completion_logits(
        graphdef,
        params,
        batch["prompt_tokens"],
        batch["prompt_mask"],
        batch["tokens"],
        batch["mask"],
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_chunked_scores_equal_unchunked_in_value_and_gradient(setup):
    graphdef, params, _, batch = setup
    rng = np.random.default_rng(1)
    b6 = dict(batch, tokens=rng.integers(4, V, (N, 6)).astype(np.int32), mask=np.ones((N, 6), bool))

    def scores(p, chunk):
        return ts.completion_scores(graphdef, p, b6, 0.7, chunk_size=chunk, with_entropy=True)

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
    g_lp = jax.grad(lambda p: (scores(p, 0)[0] * jnp.arange(1.0, 7.0)).sum())(params)
    for x, y in zip(jax.tree.leaves(g_lp), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="chunk_size = 4 must divide the completion length T = 6"):
        scores(params, 4)


def test_chunked_scoring_never_holds_all_the_logits():
    """XLA's own buffer plan: chunking bounds the backward pass's float32 logits."""
    cfg = models.tiny_config(
        4096, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64
    )
    graphdef, params = nnx.split(models.create_model(cfg))
    n, t = 4, 128
    b = dict(
        prompt_tokens=np.ones((n, 8), np.int32),
        prompt_mask=np.ones((n, 8), bool),
        tokens=np.ones((n, t), np.int32),
        mask=np.ones((n, t), bool),
    )

    def temp_bytes(chunk):
        def loss(p):
            return ts.completion_scores(graphdef, p, b, 1.0, chunk_size=chunk)[0].sum()

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(0), temp_bytes(16)
    assert whole > 2 * n * t * 4096 * 4  # the float32 logits and their gradient at once
    assert 3 * chunked < whole  # measured 19.7 MB vs 4.8 MB


def _grouped_batch(rng, B, G, P, T, V):
    """Rows b*G .. b*G+G-1 share prompt b (as the sampler writes them); ragged masks."""
    pmask = np.ones((B, P), bool)
    pmask[0, :3] = False
    pmask[1, :1] = False
    mask = np.ones((B * G, T), bool)
    mask[::3, T - 2 :] = False
    return dict(
        prompt_tokens=np.repeat(rng.integers(4, V, (B, P)), G, axis=0).astype(np.int32),
        prompt_mask=np.repeat(pmask, G, axis=0),
        tokens=rng.integers(4, V, (B * G, T)).astype(np.int32),
        mask=mask,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_prompt_run_once_per_group_equals_once_per_row(family):
    cfg = models.tiny_config(
        V, family=family, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, mlp_dim=64, sliding_window=4 if family == "gemma3" else None,
    )  # fmt: skip
    graphdef, params = nnx.split(models.create_model(cfg))
    b = _grouped_batch(np.random.default_rng(0), 3, 4, 7, 6, V)

    def loss(p, g):
        logps, ent = ts.completion_scores(graphdef, p, b, 0.9, group_size=g, with_entropy=True)
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


def test_share_prompts_gives_the_same_update(setup):
    graphdef, params, mesh, _ = setup
    rng = np.random.default_rng(3)
    batch = _grouped_batch(rng, 2, 4, P, T, V)
    batch["advantages"] = rng.normal(size=N).astype(np.float32)
    old = ts.completion_logps(graphdef, params, batch, 1.0)
    batch["old_logps"] = np.asarray(old) * batch["mask"]
    grpo = GRPOConfig(G=4, mu=2, beta=0.1)
    tx, schedule = ts.make_optimizer(OptimConfig(learning_rate=1e-2), 10)
    results, flops = {}, {}
    # Minibatches of 4 rows: whole groups (shared); grad_accum 2 gives micro-batches
    # of 2 rows, not whole groups (scored per row), while the reference pass shares.
    for share, accum in ((False, 1), (True, 1), (False, 2), (True, 2)):
        state = ts.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
        fn = ts.jit_train_step(
            graphdef=graphdef, tx=tx, schedule=schedule, grpo=grpo, minibatch_size=4,
            grad_accum=accum, batch_shards=1, track_update=True,
            state_shardings=jax.tree.map(lambda x: x.sharding, state),
            batch_sharding_fn=lambda nd: sharding.batch_sharding(mesh, nd),
            ref_shardings=jax.tree.map(lambda x: x.sharding, params),
            replicated=sharding.replicated(mesh), share_prompts=share,
        )  # fmt: skip
        args = (state, batch, jax.random.key(0), params)
        cost = fn.lower(*args).compile().cost_analysis()
        flops[share, accum] = (cost[0] if isinstance(cost, list) else cost)["flops"]
        results[share, accum] = jax.device_get(fn(*args))
    # Sharing really happens, and does less work: P = 6 of 11 positions per row are prompt.
    assert flops[True, 1] < 0.8 * flops[False, 1]
    assert flops[True, 2] < flops[False, 2]  # the reference and tracking passes only
    for accum in (1, 2):
        # Four AdamW updates of lr 1e-2: m / sqrt(v) magnifies float32 noise in
        # near-zero gradient coordinates, hence 1e-5 (a wrong prompt moves them ~1e-2).
        _assert_same_update(
            results[False, accum],
            results[True, accum],
            ("train/loss", "train/kl", "train/entropy", "policy/kl_old_new"),
            params_atol=1e-5,
        )


def test_prompt_once_per_group_with_one_completion_token(setup):
    graphdef, params, _, _ = setup
    b = _grouped_batch(np.random.default_rng(5), 2, 4, 5, 1, V)
    b["mask"][:] = True
    one = ts.completion_logps(graphdef, params, b, 1.0, group_size=4)
    per_row = ts.completion_logps(graphdef, params, b, 1.0)
    np.testing.assert_allclose(np.asarray(one), np.asarray(per_row), atol=2e-6)
