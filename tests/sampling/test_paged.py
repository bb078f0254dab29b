"""The paged engine (sampling/paged.py) against the static sampler and full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_config import run_config
from helpers_hf import FAMILIES, make_tiny_hf_checkpoint
from helpers_paged import BUCKETS, MODEL_CFG, PROMPTS, V, _both, _forward, _full_logps
from scipy import stats

from grpo_jax.core.errors import ConfigError
from grpo_jax.models import create_model, from_pretrained
from grpo_jax.run import memory
from grpo_jax.sampling import paged, paged_pool
from grpo_jax.sampling.draw import candidates
from grpo_jax.sampling.engines import get_engine
from grpo_jax.sampling.static import SamplingConfig, pad_prompts


@pytest.fixture(scope="module")
def policy():
    graphdef, params = nnx.split(create_model(MODEL_CFG, seed=0))
    # Sharper logits than the random init's: a well separated argmax, a far from uniform draw.
    return graphdef, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)


@pytest.mark.parametrize(
    "engine",
    [
        # 12 requests through 5 slots
        pytest.param(dict(page_size=4, slots=5, prefill_chunk=3), marks=pytest.mark.slow),
        # One slot per row, pages of 16: a prompt's single page is partly filled.
        pytest.param(dict(), marks=pytest.mark.slow),
        # A pool below the worst case: admissions wait for pages.
        pytest.param(dict(page_size=3, slots=2, prefill_chunk=2, pages=9), marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_the_static_engine_token_for_token(policy, engine):
    # Greedy rows here: 2 2 2 24 ..., 57 57 27 ..., 32 32 32 0 0 0 ... and three that repeat
    # one token: an EOS id ends the second, a stop sequence each the first and the fourth.
    kw = dict(max_new_tokens=12, greedy=True, eos_ids=(27,), stop_sequences=((2, 24), (0, 0, 0)))
    ref, out, st = _both(policy, PROMPTS, 2, **kw, **engine)
    for field in ("prompt_tokens", "prompt_mask", "tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, field), getattr(ref, field), err_msg=field)
    np.testing.assert_allclose(out.logps, ref.logps, atol=2e-6)
    np.testing.assert_array_equal(out.behavior_logps, 0.0)
    np.testing.assert_array_equal(np.asarray(ref.lengths)[::2], [4, 3, 12, 6, 12, 12])
    full = np.where(out.mask, _full_logps(policy, out, 1.0), 0.0)
    np.testing.assert_allclose(out.logps, full, atol=2e-5)
    if engine.get("slots"):
        assert st.slot_occupancy > 0.5 and st.peak_pages <= st.pool_pages
    if engine == dict(page_size=4, slots=5, prefill_chunk=3):  # the memory figures, as below
        prompt_slots = sum(-(-len(p) // 4) * 4 for p in PROMPTS)  # 32 of the static 12 x 8
        assert st.prompt_pages * 4 == prompt_slots and prompt_slots * 2 <= 12 * 8
        planned = memory.plan_run(_run(len(PROMPTS), 2, 12, 8, **engine), MODEL_CFG, MESH)
        assert abs(planned.kv_cache - st.pool_bytes) <= 0.1 * st.pool_bytes


@pytest.mark.slow
def test_sampled_log_probs_equal_a_full_forward_pass(policy):
    kw = dict(max_new_tokens=10, temperature=0.7, top_k=20, eos_ids=(7,))
    _, out, st = _both(policy, PROMPTS, 3, page_size=4, slots=7, prefill_chunk=4, **kw)
    full = _full_logps(policy, out, 0.7)
    np.testing.assert_allclose(np.where(out.mask, out.logps, 0.0), out.logps)
    np.testing.assert_allclose(out.logps, np.where(out.mask, full, 0.0), atol=2e-5)
    assert (
        np.asarray(out.behavior_logps)[np.asarray(out.mask)] >= out.logps[out.mask] - 1e-6
    ).all()
    assert st.prefill_chunks == sum(-(-len(p) // 4) for p in PROMPTS)


@pytest.mark.slow
def test_the_sampling_distribution_is_the_models(policy):
    """Token 0 (drawn from the prefill) and token 1 (from a decode step) against exact
    probabilities from full forward passes, by a chi-square test (as test_sampling.py)."""
    temperature, g = 1.0, 1024
    prompt = [5, 9, 2]
    cfg = SamplingConfig(
        max_new_tokens=2,
        temperature=temperature,
        top_p=0.95,
        prompt_buckets=BUCKETS,
        engine="paged",
        slots=256,
    )
    toks, mask = pad_prompts([prompt], pad_id=0, buckets=BUCKETS)
    out = paged.generate(*policy, toks, mask, jax.random.key(3), cfg, num_samples=g)
    tokens = np.asarray(out.tokens)

    def expected(prefixes):  # [n, V]: the draw's distribution after each prefix
        seq = jnp.asarray(prefixes)
        logits = _forward(policy[1], seq, jnp.ones(seq.shape, bool), graphdef=policy[0])
        cand, ids = candidates(logits[:, -1] / temperature, top_p=0.95)
        q = np.zeros((len(prefixes), V))
        np.put_along_axis(q, np.asarray(ids), np.asarray(jax.nn.softmax(cand), np.float64), 1)
        return q / q.sum(axis=1, keepdims=True)

    def check(draws, q):
        counts = np.bincount(draws, minlength=V)
        assert counts[q == 0].sum() == 0  # outside the nucleus: never drawn
        keep = q * len(draws) >= 5
        assert keep.sum() >= 3, q  # a test with power: several likely tokens
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(q[keep], q[~keep].sum()) * len(draws)
        assert stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue > 1e-3, (obs, exp)

    q0 = expected([prompt])[0]
    check(tokens[:, 0], q0)
    # Token 1's marginal: sum over token 0 of q0(t0) q(. | prompt, t0).
    q1 = q0 @ expected([prompt + [t0] for t0 in range(V)])
    check(tokens[:, 1], q1)


MESH = {"data": 1, "fsdp": 1, "tensor": 1}


def _run(b, g, t, p, **engine):
    """The RunConfig ``memory.plan_run`` reads: B prompts of bucket P, G samples, T tokens."""
    return run_config(
        **{
            "grpo.G": g,
            "grpo.beta": 0.0,
            "train.batch_size": b,
            "train.minibatch_size": 0,
            "optim.grad_accum": 1,
            "sampling.max_new_tokens": t,
            "sampling.prompt_buckets": (p,),
            "sampling.engine": "paged",
            **{f"sampling.{k}": v for k, v in engine.items()},
            "eval.batch_size": 1,
            "mesh.layout": "fsdp",
            "warm_start.enabled": False,
        }
    )


@pytest.mark.slow
def test_prompt_pages_are_shared_and_the_plan_counts_the_pool(policy):
    g, t, z = 4, 9, 8
    prompts = [list(range(1, 9)), [4, 5, 6]]  # 8 tokens: one full page; 3: a partial one
    graphdef, params = policy
    cfg = SamplingConfig(max_new_tokens=t, prompt_buckets=BUCKETS, engine="paged", page_size=z)
    toks, mask = pad_prompts(prompts, pad_id=0, buckets=BUCKETS)
    out, st = paged.generate_with_stats(
        graphdef, params, toks, mask, jax.random.key(0), cfg, num_samples=g
    )
    p = np.shape(out.prompt_tokens)[1]  # the bucket, 8
    # The static engine's cache: N rows of P + T slots, of which the N x P prompt slots.
    cache = jax.eval_shape(lambda: nnx.merge(graphdef, params).init_cache(len(prompts) * g, p + t))
    static_prompt = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) * p // (p + t)
    assert st.prompt_pages == 2  # one page per prompt, read by its 4 samples
    assert st.prompt_pages * st.page_bytes * g <= static_prompt
    assert st.page_bytes == paged_pool.kv_bytes_per_token(MODEL_CFG) * z
    run = _run(len(prompts), g, t, p, page_size=z)
    planned = memory.plan_run(run, MODEL_CFG, MESH).kv_cache
    assert abs(planned - st.pool_bytes) <= 0.1 * st.pool_bytes, (planned, st.pool_bytes)


def test_engine_settings_are_checked():
    with pytest.raises(ConfigError, match="sampling.engine"):
        SamplingConfig(max_new_tokens=4, engine="")
    # The name is looked up among the registered engines (tests/sampling/test_engine_plugin.py).
    with pytest.raises(ConfigError, match="'sampling.engine' = 'vllm' is not a registered engine"):
        get_engine("vllm")
    with pytest.raises(ConfigError, match="sampling.page_size"):
        SamplingConfig(max_new_tokens=4, engine="paged", page_size=0)


def test_a_pool_too_small_for_a_prompt_is_a_clear_error(policy):
    cfg = SamplingConfig(
        max_new_tokens=4, prompt_buckets=BUCKETS, engine="paged", page_size=2, pages=2
    )
    toks, mask = pad_prompts([[1, 2, 3, 4, 5, 6]], pad_id=0, buckets=BUCKETS)
    with pytest.raises(ConfigError, match="sampling.pages' = 2 is too small"):
        paged.generate(*policy, toks, mask, jax.random.key(0), cfg)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        f: from_pretrained(make_tiny_hf_checkpoint(root / f, f, seed=i, tokenizer=False))
        for i, f in enumerate(FAMILIES)
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3"])
def test_hf_families_greedy_equal_the_static_engine(hf_models, family):
    """Tiny random Llama, Qwen2, Qwen3, Qwen3-MoE, GPT-OSS and Gemma 3 (a window of 4, shorter than
    prompts and completions here): the paged engine's greedy completions are the static
    engine's token for token, its log-probs a full forward pass's."""
    graphdef, params = nnx.split(hf_models[family])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 320, n).tolist() for n in (9, 3, 14, 6)]
    cfg = dict(max_new_tokens=10, greedy=True)
    ref, out, st = _both((graphdef, params), prompts, 2, **cfg, page_size=4, slots=3)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    full = np.where(out.mask, _full_logps((graphdef, params), out, 1.0), 0.0)
    np.testing.assert_allclose(out.logps, full, atol=2e-5)
    assert st.prompt_pages == sum(-(-len(p) // 4) for p in prompts)


def test_output_rows_keeps_the_fields_the_engine_does_not_fill_empty():
    """Given no routes (no routing replay), the SampleOutput carries None there (an array
    of None made every paged rollout raise once SampleOutput gained the routes field)."""
    rows = paged.fresh_rows(4, 3, pad_id=0)._replace(count_N=np.array([1, 2, 3, 0], np.int32))
    out = paged.output_rows(rows, np.ones((2, 5), np.int32), np.ones((2, 5), bool), g=2)
    assert out.routes is None
    assert out.tokens.shape == (4, 3) and out.prompt_tokens.shape == (4, 5)
    np.testing.assert_array_equal(out.mask.sum(1), [1, 2, 3, 0])
