"""Multi-turn episodes on the paged engine (grpo_jax/sampling/paged_turns.py) against the static
kernel: greedy episodes equal token for token, recorded log-probs a full forward pass's."""

import jax
import numpy as np
import pytest
from helpers_episodes import EOS, PROMPTS, _check_exact, _envs, _model, decode, encode_obs

from grpo_jax.rollout import episodes as multiturn
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

PAGED = dict(engine="paged", page_size=4, prefill_chunk=3)


def _play(graphdef, params, *, g=2, key=0, engine=None, sampling=None, **cfg_kw):
    toks, mask = pad_prompts(PROMPTS, pad_id=0, buckets=(8,))
    cfg = multiturn.MultiTurnConfig(
        **{"max_tokens": 40, "max_turns": 4, "max_obs_tokens": 4, **cfg_kw}
    )
    s = SamplingConfig(
        max_new_tokens=1, eos_ids=EOS, pad_id=0, prompt_buckets=(8,),
        **(sampling or {}), **(engine or {}),
    )  # fmt: skip
    return multiturn.run_episodes(
        graphdef, params, _envs(g), toks, mask, jax.random.key(key), sampling=s, cfg=cfg,
        encode_observation=encode_obs, decode=decode, num_samples=g,
    )  # fmt: skip


def _assert_same_episodes(a, b):
    for f in ("tokens_NxT", "mask_NxT", "lengths_N", "rewards_N", "success_N", "truncated_N",
              "turns_N", "errors_N"):  # fmt: skip
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert a.turn_texts == b.turn_texts
    np.testing.assert_allclose(a.logps_NxT, b.logps_NxT, atol=2e-5)


@pytest.fixture(scope="module")
def llama():
    return _model("llama")


BUDGETS = [
    dict(max_turn_tokens=6),  # turns cut at 6 tokens, or by an EOS
    # A short transcript: rows run out of slots mid-turn, or their next observation would
    # not fit (the episode ends truncated).
    dict(max_tokens=14, max_turn_tokens=5),
    dict(max_turns=2, max_turn_tokens=6),  # the turn budget ends episodes that would go on
]


@pytest.mark.parametrize(
    "budgets, slots",  # slots 0: one per row; 3: rows queue for slots between turns
    [
        (BUDGETS[0], 0),
        (BUDGETS[1], 3),
        pytest.param(BUDGETS[2], 0, marks=pytest.mark.slow),
        pytest.param(BUDGETS[0], 3, marks=pytest.mark.slow),
        pytest.param(BUDGETS[1], 0, marks=pytest.mark.slow),
        pytest.param(BUDGETS[2], 3, marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_greedy_episodes_equal_the_static_kernels(llama, budgets, slots):
    graphdef, params = llama
    greedy = dict(greedy=True, stop_sequences=((9, 9),))
    ref = _play(graphdef, params, sampling=greedy, **budgets)
    ep = _play(graphdef, params, sampling=greedy, engine={**PAGED, "slots": slots}, **budgets)
    assert ep.turns_N.max() >= 2 and ep.phases >= 2  # observations were written and continued
    if "max_tokens" in budgets or "max_turns" in budgets:
        assert ep.truncated_N.any()  # the budget cut some episodes
    _assert_same_episodes(ep, ref)
    _check_exact(graphdef, params, ep, update=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_sampled_episodes_score_as_a_full_forward_pass(family):
    """Sampled at 0.7 on the paged engine: every model token's recorded log-prob is the full
    forward pass's over [prompt | transcript] (Gemma 3: a sliding window of 3 that binds)."""
    extra = {}
    if family == "gemma3":
        extra = dict(sliding_window=3, layer_types=("sliding_attention", "full_attention"))
    graphdef, params = _model(family, **extra)
    ep = _play(graphdef, params, engine=PAGED, sampling=dict(temperature=0.7), max_turn_tokens=6)
    assert ep.turns_N.max() >= 3 and ep.lengths_N.max() > 10
    _check_exact(graphdef, params, ep, temperature=0.7)


def test_the_paged_engine_refuses_row_keys(llama):
    toks, mask = pad_prompts(PROMPTS[:1], pad_id=0, buckets=(8,))
    s = SamplingConfig(max_new_tokens=1, eos_ids=EOS, pad_id=0, prompt_buckets=(8,), **PAGED)
    with pytest.raises(ValueError, match="one key, not row keys"):
        multiturn.run_episodes(
            *llama, _envs(1)[:1], toks, mask, jax.random.split(jax.random.key(0), 1),
            sampling=s, cfg=multiturn.MultiTurnConfig(max_tokens=8),
            encode_observation=encode_obs, decode=decode,
        )  # fmt: skip
