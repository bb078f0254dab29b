"""Routing replay's recording on the paged engine (sampling/paged.py; docs/moe.md): each fed
token's experts, laid out as the static sampler's ``SampleOutput.routes``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_paged import BUCKETS, PROMPTS, _both

from grpo_jax.models import create_model, family_config
from grpo_jax.sampling import paged
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

# A tiny Qwen3-MoE whose middle layer is dense: R = 2 sparse layers of 3, top 2 of 8 experts.
MOE_CFG = family_config(
    "qwen3_moe", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_dim=32, moe_mlp_dim=16, num_experts=8, experts_per_token=2,
    mlp_only_layers=(1,),
)  # fmt: skip


@pytest.fixture(scope="module")
def moe_policy():
    graphdef, params = nnx.split(create_model(MOE_CFG, seed=0))
    # Sharper logits than the random init's: a well separated argmax and router top-k.
    return graphdef, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)


def _expected_recorded(out):
    """[N, P + T]: the positions a sampler feeds, real prompt tokens and every completion
    token but a row's last (which predicts nothing the update scores)."""
    t = out.tokens.shape[1]
    lengths = np.asarray(out.lengths)
    fed_NxT = np.arange(t)[None] < (lengths - 1)[:, None]
    return np.concatenate([np.asarray(out.prompt_mask), fed_NxT], axis=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine",
    [
        # 12 requests through 5 slots, prompts in chunks of 3 over pages of 4.
        dict(page_size=4, slots=5, prefill_chunk=3),
        # One slot per row, a whole prompt per chunk.
        dict(),
    ],
)
def test_greedy_routes_equal_the_static_engines_and_a_full_pass(moe_policy, engine):
    """Position for position: where the paged engine fed a token, the experts the static
    sampler recorded there and those of one full pass over [prompt | completion]; -1 at
    left padding, a row's last token and after it."""
    # Greedy rows here: 20 51 51 4 ..., 26 50 32 26 50 48 ..., 1 19 ... and three that run to
    # T; the EOS ids end the first three after 4, 6 and 1 tokens (the last: none fed).
    kw = dict(max_new_tokens=10, greedy=True, eos_ids=(4, 48, 1), record_routes=True)
    ref, out, _ = _both(moe_policy, PROMPTS, 2, **kw, **engine)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(np.asarray(out.lengths)[::2], [4, 6, 1, 10, 10, 10])
    rec, stat = np.asarray(out.routes), np.asarray(ref.routes)
    assert rec.shape == stat.shape == (12, 8 + 10, 2, 2) and rec.dtype == stat.dtype == np.int8
    fed = _expected_recorded(out)
    assert ((rec >= 0).all(axis=(2, 3)) == fed).all()
    assert (rec[~fed] == -1).all()
    np.testing.assert_array_equal(rec[fed], stat[fed])
    graphdef, params = moe_policy
    seq = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    _, full = nnx.merge(graphdef, params).routed_features(seq, mask_BxT=mask)
    np.testing.assert_array_equal(rec[fed], np.asarray(full)[fed])


@pytest.mark.slow  # compiles the paged engine twice (3.3 s in the fast tier)
def test_no_routes_without_record_routes_or_experts(moe_policy):
    """Routes only when asked for, on a mixture of experts; a dense model or a run without
    replay gets None and the programs that return none."""
    from helpers_paged import MODEL_CFG

    toks, mask = pad_prompts(PROMPTS[:2], pad_id=0, buckets=BUCKETS)
    cfg = SamplingConfig(max_new_tokens=3, greedy=True, prompt_buckets=BUCKETS, engine="paged")
    out = paged.generate(*moe_policy, toks, mask, jax.random.key(0), cfg, num_samples=2)
    assert out.routes is None
    # The programs without routes are those every other caller gets (paged_turns, the
    # programs compiled ahead): the same cache entry, no new one.
    misses = paged._compiled.cache_info().misses
    paged._compiled(moe_policy[0], cfg, 2, cfg.page_size)
    assert paged._compiled.cache_info().misses == misses
    dense = nnx.split(create_model(MODEL_CFG, seed=0))
    asked = dataclasses.replace(cfg, record_routes=True)
    out = paged.generate(*dense, toks, mask, jax.random.key(0), asked, num_samples=2)
    assert out.routes is None
    assert not paged.records_routes(MODEL_CFG, asked) and not paged.records_routes(MOE_CFG, cfg)
    assert paged.records_routes(MOE_CFG, asked)


def test_output_rows_cuts_the_rows_routes_to_the_prompts_width():
    """Rows carry routes for prompts up to W = 7 tokens; prompts 5 wide get the last 5 + T
    columns (the prompts are left-padded, so their real tokens' columns are among them)."""
    routes = np.arange(4 * 10 * 1 * 2, dtype=np.int8).reshape(4, 10, 1, 2)
    rows = paged.fresh_rows(4, 3, pad_id=0, routes=routes)
    out = paged.output_rows(rows, np.ones((2, 5), np.int32), np.ones((2, 5), bool), 2)
    np.testing.assert_array_equal(out.routes, routes[:, 2:])


def _full_routes(policy, prompts, rows, width):
    """The routes of one full pass of ``policy`` over each row's [prompt | completion], its
    prompt left-padded to ``width``; and where a run feeds tokens (as _expected_recorded)."""
    toks, mask = pad_prompts([list(p) for p in prompts], pad_id=0, buckets=(width,))
    g = len(rows.count_N) // len(prompts)
    toks, mask = np.repeat(toks, g, axis=0), np.repeat(mask, g, axis=0)
    t = rows.tokens_NxT.shape[1]
    done = np.arange(t)[None] < rows.count_N[:, None]
    seq = jnp.asarray(np.concatenate([toks, rows.tokens_NxT], axis=1))
    full_mask = jnp.asarray(np.concatenate([mask, done], axis=1))
    _, full = nnx.merge(policy[0], policy[1]).routed_features(seq, mask_BxT=full_mask)
    fed = np.concatenate([mask, np.arange(t)[None] < (rows.count_N - 1)[:, None]], axis=1)
    return np.asarray(full), fed


@pytest.mark.slow
def test_carried_rows_routes_are_those_of_the_run_that_finished_them(moe_policy):
    """Partial rollouts (``generate_rows``): a first run with parameters A stops once group 0
    is done, rows of later groups part-way; a second with B finishes them (sampled rows, ended
    by EOS ids at different lengths). Each row's routes
    are a full pass's with the parameters of the run that finished it, at every position it
    fed (the carried prefix fed again by the second run), -1 elsewhere."""
    graphdef, a = moe_policy
    rng = np.random.default_rng(3)
    b = jax.tree.map(lambda v: v + 0.05 * rng.standard_normal(v.shape).astype(v.dtype), a)
    prompts = [np.asarray(p, np.int32) for p in PROMPTS[:4]]
    eos = (4, 48, 1)  # rows of 1 to 10 tokens
    cfg = SamplingConfig(
        max_new_tokens=10, temperature=1.0, eos_ids=eos, prompt_buckets=BUCKETS,
        engine="paged", slots=4, page_size=4, prefill_chunk=3, record_routes=True,
    )  # fmt: skip
    w, n = max(BUCKETS), 4 * 2
    rows = paged.fresh_rows(n, 10, 0, paged.fresh_routes(MOE_CFG, n, w, 10))
    first, _ = paged.generate_rows(
        graphdef, a, prompts, rows, jax.random.key(0), cfg, num_samples=2, due=1
    )
    early = first.finished(10)
    assert early[:2].all() and not early.all()
    assert ((first.count_N > 1) & ~early).any()  # rows carried part-way
    # and a group with a row finished in the first run and one carried: its prompt is fed
    # again in the second, for the carried row alone.
    assert (early.reshape(4, 2).any(1) & ~early.reshape(4, 2).all(1)).any()
    second, st = paged.generate_rows(
        graphdef, b, prompts, first, jax.random.key(1), cfg, num_samples=2, due=4
    )
    assert second.finished(10).all() and st.extend_chunks > 0
    rec = second.routes_NxSxRxK
    full_a, fed = _full_routes((graphdef, a), prompts, second, w)
    full_b, _ = _full_routes((graphdef, b), prompts, second, w)
    assert ((rec >= 0).all(axis=(2, 3)) == fed).all() and (rec[~fed] == -1).all()
    np.testing.assert_array_equal(rec[early][fed[early]], full_a[early][fed[early]])
    late = ~early
    np.testing.assert_array_equal(rec[late][fed[late]], full_b[late][fed[late]])
    assert (full_a[late][fed[late]] != full_b[late][fed[late]]).any()  # A's would not do
