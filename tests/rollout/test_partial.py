"""Partial rollouts (grpo_jax/rollout/partial.py, paged.generate_rows): rows cut when a run's due
groups are done, and continued by a later run, against one uninterrupted run and full
forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_paged import BUCKETS, MODEL_CFG, PROMPTS, V, _forward
from scipy import stats

from grpo_jax.models import create_model
from grpo_jax.objective import losses
from grpo_jax.run import config as config_lib
from grpo_jax.run.config import ConfigError
from grpo_jax.sampling import paged
from grpo_jax.sampling.draw import candidates
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

T = 12
# Greedy rows of the test_paged policy: EOS and stop sequences end some early.
GREEDY = dict(max_new_tokens=T, greedy=True, eos_ids=(27,), stop_sequences=((2, 24), (0, 0, 0)))
ENGINE = dict(engine="paged", page_size=4, slots=3, prefill_chunk=3)


def _policy(seed, scale=4.0):
    graphdef, params = nnx.split(create_model(MODEL_CFG, seed=seed))
    return graphdef, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params)


@pytest.fixture(scope="module")
def policy():
    return _policy(0)


def _rows(rows, groups, g):
    """Rows of groups ``groups`` (a slice) of a Rows of G rows per group."""
    cut = slice(groups.start * g, groups.stop * g)
    return paged.Rows(*(None if x is None else x[cut] for x in rows))  # routes: None


def _cat(*parts):
    return paged.Rows(*(None if x[0] is None else np.concatenate(x) for x in zip(*parts)))


def _prompts(prompts):
    return [np.asarray(p, np.int32) for p in prompts]


def _full_logps(policy, prompt, completion, temperature=1.0):
    """Log-probs of ``completion`` after ``prompt`` from one full forward pass."""
    seq = jnp.asarray([list(prompt) + list(completion)])
    logits = _forward(policy[1], seq, jnp.ones(seq.shape, bool), graphdef=policy[0])
    n = len(prompt)
    out = losses.per_token_logps(
        logits[:, n - 1 : n - 1 + len(completion)], seq[:, n:], temperature=temperature
    )
    return np.asarray(out[0]), np.asarray(jnp.argmax(logits[0, n - 1 : -1], axis=-1))


@pytest.mark.slow
def test_rows_cut_and_continued_equal_one_uninterrupted_run(policy):
    """Three runs, two groups due in each, the later groups cut wherever the due ones end:
    the same greedy completions as one run over all six prompts."""
    g, key = 2, jax.random.key(0)
    # Slots: one per due row (the default), so later groups start as due rows end.
    cfg = SamplingConfig(prompt_buckets=BUCKETS, **GREEDY, **{**ENGINE, "slots": 0})
    # Greedy lengths 12, 3 | 12, 6 | 12, 4: a long row keeps each run going while a later
    # group's rows start in the slots the short ones free.
    order = [PROMPTS[i] for i in (2, 1, 4, 3, 5, 0)]
    prompts = _prompts(order)
    toks, mask = pad_prompts(order, pad_id=0, buckets=BUCKETS)
    whole = paged.generate(*policy, toks, mask, key, cfg, num_samples=g)

    rows = paged.fresh_rows(len(prompts) * g, T, 0)
    done, cut = [], 0
    for first in (0, 2, 4):
        rows, st = paged.generate_rows(
            *policy, prompts[first:], rows, key, cfg, num_samples=g, due=2
        )
        assert rows.finished(T)[: 2 * g].all()
        later = _rows(rows, slice(2, len(prompts) - first), g)
        # Rows cut mid-completion: tokens drawn, more to draw (they need the extension path).
        cut += int(((later.count_N > 1) & ~later.finished(T)).sum())
        done.append(_rows(rows, slice(0, 2), g))
        rows = later
    assert cut >= 2 and st.extend_chunks >= 1
    out = _cat(*done)
    np.testing.assert_array_equal(out.tokens_NxT, np.asarray(whole.tokens))
    np.testing.assert_array_equal(out.count_N, np.asarray(whole.lengths))
    np.testing.assert_array_equal(~out.ended_N, np.asarray(whole.truncated))
    for r in range(len(prompts) * g):
        n = int(out.count_N[r])
        full, _ = _full_logps(policy, order[r // g], out.tokens_NxT[r, :n])
        np.testing.assert_allclose(out.logps_NxT[r, :n], full, atol=2e-5, err_msg=f"row {r}")


@pytest.mark.slow
def test_a_carried_row_continues_under_the_new_parameters(policy):
    """A row cut under parameters A and continued under B: the tokens drawn before the cut
    are A's greedy choices with A's log-probs, those after are B's given the whole prefix,
    with B's log-probs (a full forward pass of B): the continuation's keys and values are
    B's, not A's left in a cache."""
    g, key = 2, jax.random.key(1)
    other = _policy(7, scale=3.0)
    # Six slots for the due group's two rows: four rows of later groups start beside them.
    cfg = SamplingConfig(
        prompt_buckets=BUCKETS, max_new_tokens=T, greedy=True, **{**ENGINE, "slots": 6}
    )
    prompts = _prompts(PROMPTS)
    rows_a, _ = paged.generate_rows(
        *policy, prompts, paged.fresh_rows(len(prompts) * g, T, 0), key, cfg, num_samples=g, due=1
    )
    later = _rows(rows_a, slice(1, len(prompts)), g)
    rows_b, _ = paged.generate_rows(
        *other, prompts[1:], later, key, cfg, num_samples=g, due=len(prompts) - 1
    )
    checked = 0
    for r in range(len(later.count_N)):
        c, n = int(later.count_N[r]), int(rows_b.count_N[r])
        if not 1 < c < n:
            continue
        prompt, tokens = PROMPTS[1 + r // g], rows_b.tokens_NxT[r, :n]
        np.testing.assert_array_equal(tokens[:c], later.tokens_NxT[r, :c])
        logps_a, argmax_a = _full_logps(policy, prompt, tokens[:c])
        logps_b, argmax_b = _full_logps(other, prompt, tokens)
        np.testing.assert_array_equal(tokens[:c], argmax_a)
        np.testing.assert_array_equal(tokens[c:], argmax_b[c:])
        np.testing.assert_allclose(rows_b.logps_NxT[r, :c], logps_a, atol=2e-5)
        np.testing.assert_allclose(rows_b.logps_NxT[r, c:n], logps_b[c:], atol=2e-5)
        checked += 1
    assert checked == 4


@pytest.mark.slow
def test_a_continued_row_draws_from_the_model_given_its_prefix(policy):
    """512 rows carried with the same three drawn tokens: the next token's draw (the first
    decode step after the extension writes two of them) against the model's probabilities
    given prompt + prefix, by a chi-square test; and it fails at a wrong temperature."""
    g, prompt, prefix = 512, [5, 9, 2], [11, 40, 3]
    cfg = SamplingConfig(
        max_new_tokens=4,
        temperature=1.0,
        top_p=0.95,
        prompt_buckets=BUCKETS,
        engine="paged",
        page_size=2,
        prefill_chunk=1,
        slots=128,
    )
    rows = paged.fresh_rows(g, 4, 0)
    rows.tokens_NxT[:, :3] = prefix
    rows.count_N[:] = 3
    out, st = paged.generate_rows(
        *policy, _prompts([prompt]), rows, jax.random.key(5), cfg, num_samples=g, due=1
    )
    assert st.extend_chunks == 2 * g and (out.count_N == 4).all()
    draws = out.tokens_NxT[:, 3]
    seq = jnp.asarray([prompt + prefix])
    logits = _forward(policy[1], seq, jnp.ones(seq.shape, bool), graphdef=policy[0])[0, -1]

    def q(temperature):
        cand, ids = candidates(logits[None] / temperature, top_p=0.95)
        p = np.zeros(V)
        p[np.asarray(ids[0])] = np.asarray(jax.nn.softmax(cand[0]), np.float64)
        return p / p.sum()

    def pvalue(p):
        counts = np.bincount(draws, minlength=V)
        keep = p * g >= 5
        obs = np.append(counts[keep], counts[~keep].sum())
        exp = np.append(p[keep], p[~keep].sum()) * g
        return stats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue, keep.sum()

    p_right, likely = pvalue(q(1.0))
    assert likely >= 3 and p_right > 1e-3
    assert np.bincount(draws, minlength=V)[q(1.0) == 0].sum() == 0  # never outside the nucleus
    assert pvalue(q(0.5))[0] < 1e-6


def _parse(**updates):
    from helpers_config import smoke_config

    return config_lib.parse_config(smoke_config(plain=True, **updates))


@pytest.mark.parametrize(
    "updates, match",
    [
        ({"train.max_staleness": 1}, "needs sampling.engine = 'paged'"),
        ({"sampling.engine": "paged"}, "needs train.max_staleness >= 1"),
        (
            {"sampling.engine": "paged", "train.max_staleness": 1, "train.dynamic_sampling": True},
            "does not combine with train.dynamic_sampling",
        ),
        (
            {"sampling.engine": "paged", "train.max_staleness": 1, "env.name": "guess_number"},
            "does not combine with an environment",
        ),
        (
            {"sampling.engine": "paged", "train.max_staleness": 1, "sampling.partial_rollouts": 1},
            "must be True or False",
        ),  # fmt: skip
    ],
)
def test_bad_partial_rollout_settings_name_the_key(updates, match):
    updates.setdefault("sampling.partial_rollouts", True)
    with pytest.raises(ConfigError, match=match):
        _parse(**updates)


@pytest.mark.slow
def test_the_memory_plan_counts_the_pool_of_k_plus_one_steps_of_prompts(policy):
    """With partial rollouts the pool holds the next k steps' prompts beside the step's:
    the plan's KV figure is within 10% of the bytes the engine allocates (B = 2, k = 1)."""
    from grpo_jax.run import memory

    b, k, g, t, z = 2, 1, 2, 9, 4
    prompts = [list(range(1 + i, 9 + i)) for i in range((k + 1) * b)]  # 8 tokens: the bucket
    cfg = SamplingConfig(prompt_buckets=(8,), max_new_tokens=t, engine="paged", page_size=z)
    rows = paged.fresh_rows(len(prompts) * g, t, 0)
    _, st = paged.generate_rows(
        *policy, _prompts(prompts), rows, jax.random.key(0), cfg, num_samples=g, due=b
    )
    plan = {
        "grpo.G": g,
        "grpo.beta": 0.0,
        "train.batch_size": b,
        "train.minibatch_size": 0,
        "train.max_staleness": k,
        "optim.grad_accum": 1,
        "sampling.max_new_tokens": t,
        "sampling.prompt_buckets": (8,),
        "sampling.engine": "paged",
        "sampling.page_size": z,
        "eval.batch_size": 1,
        "mesh.layout": "fsdp",
        "warm_start.enabled": False,
    }
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    planned = memory.plan_run(
        _parse(**plan, **{"sampling.partial_rollouts": True}), MODEL_CFG, mesh
    )
    assert abs(planned.kv_cache - st.pool_bytes) <= 0.1 * st.pool_bytes, (planned, st.pool_bytes)
    # Without the later steps' prompts the plan would be short of the pool.
    run = _parse(**plan)
    assert memory.plan_run(run, MODEL_CFG, mesh).kv_cache < 0.9 * st.pool_bytes
