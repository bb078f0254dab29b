"""Sampler pieces that need no transformer: config, padding, the draw, the state machine.

The state machine runs on ``CountingLM``, a toy model whose logits depend on
the current token, its position and the count and sum of the real tokens
before it, so that a wrong cache slot, kv mask or position changes the output.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from grpo_jax.objective import losses
from grpo_jax.run.config import ConfigError
from grpo_jax.sampling import static as sampling
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

V = 11


class CountingLM(nnx.Module):
    """logits_t = table[x_t] + a * n_t + b * s_t + c * pos_t over real tokens up to t."""

    def __init__(self, vocab: int = V, seed: int = 0):
        k = jax.random.split(jax.random.key(seed), 4)
        self.table = nnx.Param(jax.random.normal(k[0], (vocab, vocab)))
        self.a = nnx.Param(0.3 * jax.random.normal(k[1], (vocab,)))
        self.b = nnx.Param(0.05 * jax.random.normal(k[2], (vocab,)))
        self.c = nnx.Param(0.2 * jax.random.normal(k[3], (vocab,)))

    def _logits(self, tokens_BxT, n_BxT, s_BxT, pos_BxT):
        f = lambda x: x.astype(jnp.float32)[..., None]
        return (
            self.table[...][tokens_BxT]
            + f(n_BxT) * self.a[...]
            + f(s_BxT) * self.b[...]
            + f(pos_BxT) * self.c[...]
        )

    def __call__(self, tokens_BxT, *, positions_BxT=None, mask_BxT=None):
        if mask_BxT is None:
            mask_BxT = jnp.ones(tokens_BxT.shape, jnp.bool_)
        m = mask_BxT.astype(jnp.int32)
        if positions_BxT is None:
            positions_BxT = jnp.cumsum(m, axis=1) - 1
        n = jnp.cumsum(m, axis=1)
        s = jnp.cumsum(tokens_BxT * m, axis=1)
        return self._logits(tokens_BxT, n, s, positions_BxT)

    def init_cache(self, batch_size, max_len):
        return {"tokens": jnp.zeros((batch_size, max_len), jnp.int32)}

    def forward_with_cache(
        self, tokens_BxT, *, positions_BxT, kv_mask_BxS, cache, cache_index, last_only=False
    ):
        cached = jax.lax.dynamic_update_slice(cache["tokens"], tokens_BxT, (0, cache_index))
        t, s = tokens_BxT.shape[1], cached.shape[1]
        q_T = cache_index + jnp.arange(t)
        causal_TxS = jnp.arange(s)[None, :] <= q_T[:, None]
        vis_BxTxS = causal_TxS[None] & kv_mask_BxS[:, None, :]
        n = vis_BxTxS.sum(-1)
        sm = (vis_BxTxS * cached[:, None, :]).sum(-1)
        logits = self._logits(tokens_BxT, n, sm, positions_BxT)
        return (logits[:, -1:] if last_only else logits), {"tokens": cached}


PROMPTS = [[3, 5, 7], [1], [2, 9, 4, 4, 8], [6, 6]]


def _setup(**cfg_kw):
    cfg = SamplingConfig(**{"max_new_tokens": 7, "prompt_buckets": (4, 8), **cfg_kw})
    model = CountingLM()
    graphdef, params = nnx.split(model)
    toks, mask = pad_prompts(PROMPTS, pad_id=cfg.pad_id, buckets=cfg.prompt_buckets)
    return model, graphdef, params, cfg, toks, mask


def _full_logps(model, out, temperature):
    """per_token_logps of one full forward pass over [prompt | completion]."""
    p = out.prompt_tokens.shape[1]
    seq = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    seq_mask = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    logits = model(seq, mask_BxT=seq_mask)
    t = out.tokens.shape[1]
    return losses.per_token_logps(logits[:, p - 1 : p - 1 + t], out.tokens, temperature=temperature)


# ---------------------------------------------------------------------------
# SamplingConfig.


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"max_new_tokens": 0}, "'sampling.max_new_tokens' = 0 must be >= 1"),
        ({"max_new_tokens": 2.5}, "'sampling.max_new_tokens' = 2.5 must be an integer"),
        ({"temperature": 0.0}, "'sampling.temperature' = 0.0 must be > 0"),
        ({"top_k": -1}, "'sampling.top_k' = -1 must be >= 0"),
        ({"top_p": 0.0}, "'sampling.top_p' = 0.0 must be > 0"),
        ({"top_p": 1.5}, "'sampling.top_p' = 1.5 must be <= 1"),
        ({"greedy": "yes"}, "'sampling.greedy' = 'yes' must be a bool"),
        ({"eos_ids": (2, -1)}, "'sampling.eos_ids[1]' = -1 must be >= 0"),
        ({"eos_ids": "2"}, "'sampling.eos_ids' = '2' must be a tuple of integers"),
        ({"pad_id": -3}, "'sampling.pad_id' = -3 must be >= 0"),
        ({"prompt_buckets": ()}, "'sampling.prompt_buckets' = () must not be empty"),
        ({"prompt_buckets": (64, 32)}, "must be strictly increasing"),
        ({"prompt_buckets": (0, 32)}, "'sampling.prompt_buckets[0]' = 0 must be >= 1"),
    ],
)
def test_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        SamplingConfig(**{"max_new_tokens": 4, **kw})


def test_config_lists_become_tuples_and_hash():
    cfg = SamplingConfig(max_new_tokens=4, eos_ids=[1, 2], prompt_buckets=[8, 16])
    assert cfg.eos_ids == (1, 2) and cfg.prompt_buckets == (8, 16)
    assert hash(cfg) == hash(
        SamplingConfig(max_new_tokens=4, eos_ids=(1, 2), prompt_buckets=(8, 16))
    )
    assert SamplingConfig(max_new_tokens=4, eos_ids=5).eos_ids == (5,)


# ---------------------------------------------------------------------------
# pad_prompts.


def test_pad_prompts_left_pads_to_smallest_bucket():
    toks, mask = pad_prompts([[5, 6, 7], [9]], pad_id=0, buckets=(2, 4, 8))
    np.testing.assert_array_equal(toks, [[0, 5, 6, 7], [0, 0, 0, 9]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    assert toks.dtype == np.int32 and mask.dtype == np.bool_
    toks, _ = pad_prompts([[5, 6, 7, 8]], pad_id=3, buckets=(8, 4))
    np.testing.assert_array_equal(toks, [[5, 6, 7, 8]])
    toks, _ = pad_prompts([[5, 6, 7, 8, 1]], pad_id=3, buckets=(8, 4))
    np.testing.assert_array_equal(toks, [[3, 3, 3, 5, 6, 7, 8, 1]])


def test_pad_prompts_errors():
    with pytest.raises(
        ValueError, match=r"prompt 1 has 9 tokens, more than the largest prompt bucket 8"
    ):
        pad_prompts([[1], list(range(9))], pad_id=0, buckets=(4, 8))
    with pytest.raises(
        ValueError,
        match=r"prompt 0 has 6 tokens; with max_new_tokens=5 it needs 11 positions, "
        r"more than the model's max context 10",
    ):
        pad_prompts([list(range(6))], pad_id=0, buckets=(8,), max_new_tokens=5, max_context=10)
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        pad_prompts([[1], [2], []], pad_id=0, buckets=(8,))
    with pytest.raises(ValueError, match="got no prompts"):
        pad_prompts([], pad_id=0, buckets=(8,))
    with pytest.raises(ValueError, match="prompt 0 must be a flat list of non-negative"):
        pad_prompts([[1, -2]], pad_id=0, buckets=(8,))


# ---------------------------------------------------------------------------
# The draw: log-probs, greedy, and the distribution (chi-square).

LOGITS = np.array([2.0, 1.2, 0.9, 0.3, -0.4, -1.0, -2.5], np.float32)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _expected(temperature, top_k, top_p, min_p=0.0):
    """The truncated, renormalised target distribution, computed independently in numpy."""
    p = _softmax(LOGITS.astype(np.float64) / temperature)
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: (top_k or len(p))]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    mass = 0.0
    keep_p = np.zeros_like(keep)
    for i in order:
        if q[i] > 0 and mass < top_p:
            keep_p[i] = True
        mass += q[i]
    q = np.where(keep_p, q, 0.0)
    q = np.where(q >= min_p * q.max(), q, 0.0)  # min-p last, relative to the largest
    return q / q.sum()


def _counts(temperature, top_k, top_p, min_p=0.0, n=40_000, seed=0):
    logits_NxV = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    # One compiled program per filter setting (the sampler runs it inside its jitted loop).
    step = jax.jit(sampling.sample_step, static_argnames=("temperature", "top_k", "top_p", "min_p"))
    tokens_N, logps_N, behavior_N = step(
        logits_NxV,
        jax.random.key(seed),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    tokens_N = np.asarray(tokens_N)
    # The recorded log-prob is the untruncated temperature-scaled one ...
    full = np.log(_softmax(LOGITS.astype(np.float64) / temperature))
    np.testing.assert_allclose(np.asarray(logps_N), full[tokens_N], atol=1e-5)
    # ... and the behaviour log-prob that of the truncated distribution drawn from.
    with np.errstate(divide="ignore"):
        log_q = np.log(_expected(temperature, top_k, top_p, min_p))
    np.testing.assert_allclose(np.asarray(behavior_N), log_q[tokens_N], atol=1e-5)
    return np.bincount(tokens_N, minlength=LOGITS.size)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.3, 3, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (0.7, 4, 0.9, 0.0),
        (1.0, 1, 1.0, 0.0),
        (1.0, 0, 1.0, 0.1),  # min-p alone: keeps p >= 0.045, four tokens
        (1.3, 5, 0.95, 0.2),  # all three filters
    ],
)
def test_empirical_frequencies_match_target(temperature, top_k, top_p, min_p):
    q = _expected(temperature, top_k, top_p, min_p)
    counts = _counts(temperature, top_k, top_p, min_p)
    support = q > 0
    assert counts[~support].sum() == 0, (counts, q)  # Truncated tokens never drawn.
    if support.sum() > 1:
        pvalue = stats.chisquare(counts[support], q[support] * counts.sum()).pvalue
        assert pvalue > 1e-3, (counts, q)


def test_chi_square_detects_wrong_distribution():
    # The same test must reject samples at T=1 when the target is T=0.7.
    q = _expected(0.7, 0, 1.0)
    counts = _counts(1.0, 0, 1.0)
    assert stats.chisquare(counts, q * counts.sum()).pvalue < 1e-6


def test_top_p_boundary_and_candidates():
    # At T=1 the sorted probs are ~[.45,.20,.15,.08,.04,.02,.005]: top_p=0.6
    # keeps two tokens (0.45 < 0.6 <= 0.65), top_p=0.45 keeps just one.
    scaled = jnp.asarray(LOGITS)[None]
    for top_p, kept in [(0.6, 2), (0.45, 1), (1e-6, 1), (0.999, 7)]:
        cand, ids = sampling.candidates(scaled, top_p=top_p)
        assert int(jnp.isfinite(cand).sum()) == kept, top_p
        np.testing.assert_array_equal(np.asarray(ids)[0, :kept], np.argsort(-LOGITS)[:kept])
    cand, ids = sampling.candidates(scaled)
    assert ids is None and cand is scaled


def test_greedy_step_is_argmax_with_logps_at_temperature():
    logits = jax.random.normal(jax.random.key(1), (5, V))
    tok, logp, behavior = sampling.sample_step(
        logits, jax.random.key(0), greedy=True, temperature=0.7
    )
    np.testing.assert_array_equal(tok, np.argmax(logits, -1))
    np.testing.assert_array_equal(behavior, 0.0)  # greedy: a point mass
    want = jax.nn.log_softmax(logits / 0.7)[jnp.arange(5), tok]
    np.testing.assert_allclose(logp, want, atol=1e-6)


# ---------------------------------------------------------------------------
# The state machine on the toy model.


@pytest.mark.slow
def test_greedy_equals_stepwise_full_forward_argmax():
    model, graphdef, params, cfg, toks, mask = _setup(greedy=True)
    out = sampling.generate(graphdef, params, toks, mask, jax.random.key(0), cfg)
    # Each step's full forward pass at one shape (one program): the sequence so far,
    # right-padded and masked; the model is causal, so the padding after it changes nothing.
    forward = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, mask_BxT=m))
    width = max(map(len, PROMPTS)) + cfg.max_new_tokens
    for i, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for _ in range(cfg.max_new_tokens):
            tokens = np.zeros((1, width), np.int32)
            tokens[0, : len(seq)] = seq
            logits = forward(params, tokens, np.arange(width)[None] < len(seq))
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        assert np.asarray(out.tokens[i]).tolist() == seq[len(prompt) :], i
    assert np.asarray(out.mask).all() and np.asarray(out.truncated).all()  # No EOS ids.


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(temperature=1.0), marks=pytest.mark.slow),
        dict(temperature=0.7, top_k=4),
        pytest.param(dict(temperature=0.7, top_p=0.8), marks=pytest.mark.slow),
    ],
)
def test_logps_equal_full_forward(kw):
    model, graphdef, params, cfg, toks, mask = _setup(eos_ids=(4,), **kw)
    out = sampling.generate(graphdef, params, toks, mask, jax.random.key(3), cfg, num_samples=3)
    want = _full_logps(model, out, cfg.temperature)
    np.testing.assert_allclose(out.logps, np.where(out.mask, want, 0.0), atol=1e-5)


@pytest.mark.slow
def test_eos_mask_lengths_truncated_and_padding():
    # A small vocabulary with EOS ids 4 and 7 and many draws: rows end at
    # different steps, some never.
    model, graphdef, params, cfg, toks, mask = _setup(eos_ids=(4, 7), pad_id=10)
    out = sampling.generate(graphdef, params, toks, mask, jax.random.key(5), cfg, num_samples=8)
    tokens, m, logps = map(np.asarray, (out.tokens, out.mask, out.logps))
    lengths, truncated = np.asarray(out.lengths), np.asarray(out.truncated)
    assert tokens.shape == (32, 7) and m.dtype == np.bool_ and logps.dtype == np.float32
    saw_end = saw_trunc = False
    for row in range(32):
        is_eos = np.isin(tokens[row], (4, 7))
        first = int(np.argmax(is_eos)) if is_eos.any() else None
        n = 7 if first is None else first + 1
        assert lengths[row] == n and m[row].sum() == n and m[row, :n].all()
        assert truncated[row] == (first is None)
        assert (tokens[row, n:] == 10).all() and (logps[row, n:] == 0).all()
        assert (logps[row, :n] < 0).all()
        saw_end |= first is not None and first < 6
        saw_trunc |= first is None
    assert saw_end and saw_trunc


def test_all_rows_done_at_first_token():
    # Greedy rows that all emit EOS first: everything after token 0 is padding.
    model, graphdef, params, cfg, toks, mask = _setup(greedy=True)
    first = sampling.generate(graphdef, params, toks, mask, jax.random.key(0), cfg).tokens[:, 0]
    cfg = SamplingConfig(
        max_new_tokens=7, greedy=True, eos_ids=tuple(set(np.asarray(first).tolist())), pad_id=0
    )
    out = sampling.generate(graphdef, params, toks, mask, jax.random.key(0), cfg)
    np.testing.assert_array_equal(out.lengths, 1)
    np.testing.assert_array_equal(out.tokens[:, 1:], 0)
    assert not np.asarray(out.truncated).any()


@pytest.mark.parametrize("stop_column", [0, 2])
def test_loop_exits_when_every_row_is_done(stop_column):
    # EOS ids = the greedy tokens of one column: every row ends by then, so
    # the loop must stop at the longest row instead of running to T.
    _, graphdef, params, cfg, toks, mask = _setup(greedy=True)
    key = jax.random.key(0)
    greedy = sampling.generate(graphdef, params, toks, mask, key, cfg).tokens
    eos = tuple(sorted(set(np.asarray(greedy[:, stop_column]).tolist())))
    cfg = SamplingConfig(max_new_tokens=7, greedy=True, eos_ids=eos, prompt_buckets=(4, 8))
    prefill, decode = sampling._compiled(graphdef, cfg, 1, None, jax.random.key_impl(key))
    _, _, state = prefill(params, toks, mask, key)
    state, _, truncated = decode(params, state)
    assert int(state.step) == int(state.lengths_N.max()) <= stop_column + 1
    assert not np.asarray(truncated).any()


@pytest.mark.slow
def test_groups_keys_and_determinism():
    _, graphdef, params, cfg, toks, mask = _setup()
    g = 4
    a = sampling.generate(graphdef, params, toks, mask, jax.random.key(7), cfg, num_samples=g)
    b = sampling.generate(graphdef, params, toks, mask, jax.random.key(7), cfg, num_samples=g)
    c = sampling.generate(graphdef, params, toks, mask, jax.random.key(8), cfg, num_samples=g)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.tokens, c.tokens)
    np.testing.assert_array_equal(a.prompt_tokens, np.repeat(toks, g, axis=0))
    np.testing.assert_array_equal(a.prompt_mask, np.repeat(mask, g, axis=0))
    rows = np.asarray(a.tokens).reshape(len(PROMPTS), g, -1)
    for b_ in range(len(PROMPTS)):
        assert len({tuple(r) for r in rows[b_]}) > 1, b_  # Members of a group differ.


def test_generate_input_errors():
    _, graphdef, params, cfg, toks, mask = _setup()
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"must be two arrays of the same \[B, P\] shape"):
        sampling.generate(graphdef, params, toks, mask[:, 1:], key, cfg)
    with pytest.raises(ValueError, match="num_samples = 0 must be a positive integer"):
        sampling.generate(graphdef, params, toks, mask, key, cfg, num_samples=0)
    with pytest.raises(TypeError, match="cfg must be a SamplingConfig"):
        sampling.generate(graphdef, params, toks, mask, key, {"max_new_tokens": 3})


def test_draw_finds_its_entry_in_any_block_and_weighs_blocks_by_mass():
    """Blocks of 8 over 50 entries (the last block ragged): the fast tier's check of the
    two-level draw (the slow tests below test its distribution at length)."""
    draw = jax.jit(sampling.draw, static_argnames="block")
    k = 50
    # Row j holds one drawable entry, j: the block, the entry within it and the clamp to
    # the block's last positive entry must all land on j, for every position of every block.
    one_hot = jnp.asarray(np.where(np.eye(k, dtype=bool), 0.0, -np.inf), jnp.float32)
    np.testing.assert_array_equal(draw(one_hot, jax.random.key(0), block=8), np.arange(k))
    # Entries 3 (block 0) and 49 (the last entry of the ragged last block) at odds 1 : 3.
    n = 4000
    row = np.full(k, -np.inf, np.float32)
    row[3], row[49] = 0.0, np.log(3.0)
    tokens = np.asarray(
        draw(jnp.broadcast_to(jnp.asarray(row), (n, k)), jax.random.key(1), block=8)
    )
    counts = np.bincount(tokens, minlength=k)
    assert counts[3] + counts[49] == n
    assert abs(counts[3] - n / 4) < 200, counts[3]  # binomial sd 27


@pytest.mark.parametrize("block", [7, 64, 512])
@pytest.mark.slow
def test_draw_matches_softmax_across_blocks_and_never_draws_minus_inf(block):
    # 300 entries: ragged last block for 7 and 64, one block for 512. Every third
    # entry is -inf (probability 0), the rest spread over several orders of magnitude.
    v, n = 300, 60_000
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, v).astype(np.float32)
    logits[::3] = -np.inf
    p = np.exp(logits.astype(np.float64) - logits[np.isfinite(logits)].max())
    p /= p.sum()
    tokens = np.asarray(
        sampling.draw(jnp.broadcast_to(jnp.asarray(logits), (n, v)), jax.random.key(3), block=block)
    )
    counts = np.bincount(tokens, minlength=v)
    assert counts[p == 0].sum() == 0
    # Chi-square over entries with enough expected counts, the rest pooled.
    big = p * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(p[big], p[~big].sum()) * n
    assert stats.chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.slow
def test_draw_edge_cases():
    key = jax.random.key(0)
    one = jnp.full((1000, 50), -jnp.inf).at[:, 37].set(0.0)
    np.testing.assert_array_equal(sampling.draw(one, key, block=8), 37)
    # The last entry of the last (ragged) block, and a huge logit range.
    last = jnp.full((1000, 50), -jnp.inf).at[:, 49].set(3.0).at[:, 0].set(-80.0)
    np.testing.assert_array_equal(sampling.draw(last, key, block=8), 49)
    # Rows draw independently: the same row repeated gives different tokens.
    flat = jnp.zeros((1000, 4))
    assert len(set(np.asarray(sampling.draw(flat, key)).tolist())) == 4
