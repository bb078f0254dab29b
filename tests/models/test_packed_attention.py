"""Packed log-probs (``packed_logps_and_entropy``) equal the padded rows' in every attention
implementation: segments masked, positions restarted (RoPE and Gemma 3's window of 3), the
LM head on the scored tokens only, in chunks or not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_batches import grouped_batch
from test_models import random_model, small_config

from grpo_jax.learner import packing
from grpo_jax.objective import logprobs

B, G, P, T = 2, 3, 6, 8
N = B * G


def _case(vocab):
    rows = grouped_batch(np.random.default_rng(5), B, G, P, T, vocab)
    rows["mask"][1, 2:] = False
    rows["mask"][4, 5:] = False
    return {k: jnp.asarray(v) for k, v in rows.items()}


def _packed(graphdef, params, rows, two_level, chunk):
    s = packing.PackSettings(
        group_size=G,
        shards=1,
        num_minibatches=1,
        microbatch_tokens=2 * (P + T),
        default_rows=N,
        two_level=two_level,
        head_multiple=chunk or 8,
    )
    packs, stats = packing.plan_packs(
        np.asarray(rows["prompt_mask"]), np.asarray(rows["mask"]), np.ones(N, np.float32), s
    )
    assert stats["micro_batches"] > 1

    @jax.jit
    def score(params, rows, packs):
        def one(total, pack):
            lp, ent = logprobs.packed_logps_and_entropy(
                graphdef, params, rows["prompt_tokens"], rows["tokens"], pack, 1.0,
                chunk_size=chunk, with_entropy=True,
            )  # fmt: skip
            return (total[0] + lp, total[1] + ent), None

        zeros = jnp.zeros(rows["tokens"].shape, jnp.float32)
        first = jax.tree.map(lambda x: x[0], packs)
        return jax.lax.scan(one, (zeros, zeros), first)[0]

    return score(params, rows, packs)


@pytest.mark.parametrize(
    "impl,two_level,chunk",
    [
        pytest.param("einsum", True, 0, marks=pytest.mark.slow),
        pytest.param("einsum", False, 4, marks=pytest.mark.slow),
        pytest.param("blockwise", True, 0, marks=pytest.mark.slow),
        pytest.param("dot_product", True, 0, marks=pytest.mark.slow),
        # splash's segment ids are one level: a prompt with each completion.
        pytest.param("splash", False, 0, marks=pytest.mark.slow),
    ],
)
def test_packed_log_probs_equal_the_padded_rows(impl, two_level, chunk):
    cfg = small_config("gemma3", attention_block_size=4)
    ref = random_model(cfg)
    if impl == "dot_product":  # it cannot soft-cap (tests/models/test_models_attention.py)
        cfg = cfg.replace(attn_logit_softcap=None)
        ref = random_model(cfg)
    model = nnx.merge(nnx.graphdef(random_model(cfg.replace(attention=impl))), nnx.state(ref))
    graphdef, params = nnx.split(model)
    rows = _case(cfg.vocab_size)
    want_lp, want_ent = jax.jit(
        lambda p, r: logprobs.completion_logps_and_entropy(
            nnx.graphdef(ref), p, r["prompt_tokens"], r["prompt_mask"], r["tokens"],
            r["mask"], 1.0, with_entropy=True,
        )
    )(params, rows)  # fmt: skip
    got_lp, got_ent = _packed(graphdef, params, rows, two_level, chunk)
    m = np.asarray(rows["mask"])
    np.testing.assert_allclose(np.asarray(got_lp)[m], np.asarray(want_lp)[m], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(got_ent)[m], np.asarray(want_ent)[m], rtol=1e-5, atol=1e-5
    )
    assert (np.asarray(got_lp)[~m] == 0).all()
