"""The paged engine frees the pages that fall out of a sliding window (EngineShape.local_pages):
results equal the static engine's and a full forward pass's, with fewer pages held."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers_paged import _both, _full_logps
from test_paged import _run

from grpo_jax.models import create_model, tiny_config
from grpo_jax.run import memory
from grpo_jax.sampling import paged
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

V = 64
# Gemma 3's layout in small: a window of 4 on the local layer, a global one beside it.
CFG = tiny_config(
    V, family="gemma3", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    mlp_dim=64, sliding_window=4, layer_types=("sliding_attention", "full_attention"),
)  # fmt: skip
PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6], [7], [1, 2, 3, 4, 5, 6], [60, 33, 12]]
ENGINE = dict(page_size=2, prefill_chunk=2)
T = 16


@pytest.fixture(scope="module")
def policy():
    graphdef, params = nnx.split(create_model(CFG, seed=0))
    return graphdef, jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)


@pytest.mark.slow
def test_the_window_layers_pool_is_smaller_and_greedy_equals_the_static_engine(policy):
    ref, out, st = _both(policy, PROMPTS, 2, max_new_tokens=T, greedy=True, **ENGINE)
    # Own pages of T - 1 = 15 fed tokens: 8 pages a slot; the window's 4 + 2 - 1 tokens: 4.
    assert st.local_pool_pages > 0 and st.local_pool_pages < st.pool_pages
    assert 0 < st.local_peak_pages < st.peak_pages  # pages did go back mid-row
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    full = np.where(out.mask, _full_logps(policy, out, 1.0), 0.0)
    np.testing.assert_allclose(out.logps, full, atol=2e-5)


@pytest.mark.slow
def test_sampled_rows_score_as_a_full_forward_pass_with_slots_reused(policy):
    kw = dict(max_new_tokens=T, temperature=0.8, eos_ids=(7,), slots=3, **ENGINE)
    _, out, st = _both(policy, PROMPTS, 3, key=2, **kw)
    assert st.local_pool_pages > 0
    full = _full_logps(policy, out, 0.8)
    np.testing.assert_allclose(out.logps, np.where(out.mask, full, 0.0), atol=2e-5)


@pytest.mark.slow
def test_carried_rows_continue_with_the_window_pool(policy):
    """Partial rollouts' extension path writes a carried row's tokens into both pools and
    frees what its chunks no longer see: cut and continued equals one run."""
    g = 2
    cfg = SamplingConfig(
        prompt_buckets=(16,), max_new_tokens=T, greedy=True, engine="paged", slots=6, **ENGINE
    )  # six slots for the due group's two rows: later groups start beside them
    prompts = [np.asarray(p, np.int32) for p in PROMPTS]
    whole, _ = paged.generate_rows(
        *policy, prompts, paged.fresh_rows(len(prompts) * g, T, 0), jax.random.key(0), cfg,
        num_samples=g, due=len(prompts),
    )  # fmt: skip
    rows, st = paged.generate_rows(
        *policy, prompts, paged.fresh_rows(len(prompts) * g, T, 0), jax.random.key(0), cfg,
        num_samples=g, due=1,
    )  # fmt: skip
    later = paged.Rows(*(None if x is None else x[g:] for x in rows))  # routes: None
    assert ((later.count_N > 4) & ~later.finished(T)).any()  # cut past the window
    rest, st2 = paged.generate_rows(
        *policy, prompts[1:], later, jax.random.key(0), cfg, num_samples=g, due=len(prompts) - 1
    )
    assert st2.extend_chunks > 0 and st2.local_pool_pages > 0
    np.testing.assert_array_equal(rest.tokens_NxT, whole.tokens_NxT[g:])
    np.testing.assert_array_equal(rest.count_N, whole.count_N[g:])


@pytest.mark.slow
def test_the_memory_plan_counts_the_window_layers_pool(policy):
    g, t, p = 2, T, 16
    prompts = [list(range(1 + i, 17 + i)) for i in range(2)]  # 16 tokens: the bucket
    toks, mask = pad_prompts(prompts, pad_id=0, buckets=(p,))
    cfg = SamplingConfig(prompt_buckets=(p,), max_new_tokens=t, engine="paged", **ENGINE)
    _, st = paged.generate_with_stats(*policy, toks, mask, jax.random.key(0), cfg, num_samples=g)
    planned = memory.plan_run(_run(2, g, t, p, **ENGINE), CFG, {"data": 1, "fsdp": 1, "tensor": 1})
    assert st.local_pool_pages > 0
    assert abs(planned.kv_cache - st.pool_bytes) <= 0.1 * st.pool_bytes, (planned, st.pool_bytes)
