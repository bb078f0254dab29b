"""The multi-turn sampler: recorded log-probs equal one full forward pass over the transcript.

Every model family, left-padded prompts of different lengths, rows in different
turns, a sliding window that binds, early ends and budget hits (each row's cut checked
against a replay of the budgets), a cache that fills while a row writes an observation,
and environments that raise or hang.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_episodes import (
    EOS,
    PROMPTS,
    ScriptedEnv,
    _check_exact,
    _envs,
    _model,
    _run,
    decode,
    encode_obs,
    full_forward_logps,
)

from grpo_jax.models import FAMILIES
from grpo_jax.rollout import episodes as multiturn
from grpo_jax.sampling.static import SamplingConfig, pad_prompts


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_logps_equal_full_forward_every_family(family):
    graphdef, params = _model(family)
    ep = _run(graphdef, params, max_turn_tokens=6)
    assert ep.turns_N.max() >= 3 and len(set(ep.turns_N.tolist())) > 1  # rows in different turns
    _check_exact(graphdef, params, ep)


@pytest.mark.slow
def test_binding_sliding_window_and_temperature():
    # Window 3, every layer sliding: transcripts of ~20 tokens see only 3 back.
    graphdef, params = _model(
        "gemma3", sliding_window=3, layer_types=("sliding_attention", "sliding_attention")
    )
    ep = _run(graphdef, params, temperature=0.7, max_turn_tokens=6)
    assert ep.lengths_N.max() > 10
    _check_exact(graphdef, params, ep, temperature=0.7)
    # The window binds: with a wide window the same tokens score differently.
    wide_gd, _ = _model("gemma3", sliding_window=64, layer_types=("sliding_attention",) * 2)
    wide = full_forward_logps(wide_gd, params, ep, 0.7)
    assert np.abs(wide - ep.logps_NxT)[ep.mask_NxT.astype(bool)].max() > 1e-3


@pytest.mark.slow
def test_transcript_layout_rewards_and_turns():
    graphdef, params = _model("qwen2")
    ep = _run(graphdef, params, max_turn_tokens=5)
    n = len(ep.rewards_N)
    envs = _envs(2)
    for i in range(n):
        obs = envs[i].obs
        real = ep.lengths_N[i]
        row, m = ep.tokens_NxT[i, :real].tolist(), ep.mask_NxT[i, :real]
        # Environment tokens are exactly the scripted observations, in order, mask 0.
        env_tokens = [t for t, k in zip(row, m) if not k]
        assert env_tokens == [int(x) for o in obs[: ep.turns_N[i] - 1] for x in o.split()]
        # Each model turn ends with an EOS or at 5 tokens; the env saw each turn's text.
        assert len(ep.turn_texts[i]) == ep.turns_N[i]
        assert ep.turns_N[i] == len(obs) + 1 and not ep.truncated_N[i]
        assert ep.rewards_N[i] == pytest.approx(0.25 * (len(obs) + 1))
        assert (ep.tokens_NxT[i, real:] == 0).all() and not ep.mask_NxT[i, real:].any()
        assert m[-1]  # a transcript ends with a model token


def _replay(ep, i, obs, *, max_tokens, max_turns, max_turn_tokens):
    """Walks row i's transcript as the budgets say it must unfold; -> what ended it.

    "done" (the script ran out), "turns" (max_turns), "tokens" (max_tokens reached
    inside a model turn) or "observation" (the next observation would leave no room
    for a model token). Asserts on the way that each model turn ends where it must and
    that each observation follows it whole.
    """
    tokens, mask = ep.tokens_NxT[i].tolist(), ep.mask_NxT[i].astype(bool)
    at, turn = 0, 1
    while True:
        start = at
        while True:  # one model turn
            assert mask[at], (i, at)
            at += 1
            if tokens[at - 1] in EOS or at - start == max_turn_tokens:
                break  # the turn is over (on the last slot too: the environment sees it)
            if at == max_tokens:
                return "tokens", at, turn
        if turn > len(obs):
            return "done", at, turn
        if turn >= max_turns:
            return "turns", at, turn
        ids = [int(x) for x in obs[turn - 1].split()]
        if at + len(ids) >= max_tokens:
            return "observation", at, turn
        assert tokens[at : at + len(ids)] == ids and not mask[at : at + len(ids)].any(), (i, at)
        at += len(ids)
        turn += 1


def _check_budgets(ep, **budgets):
    """Each row ended as :func:`_replay` says, with the turns, length, flags and reward."""
    cuts = []
    for i, env in enumerate(_envs(2)):
        cut, length, turns = _replay(ep, i, env.obs, **budgets)
        assert (ep.lengths_N[i], ep.turns_N[i]) == (length, turns), i
        assert ep.truncated_N[i] == (cut != "done") and not ep.errors_N[i], i
        assert len(ep.turn_texts[i]) == turns
        # 0.25 per step: a turn cut by max_tokens never reached the environment.
        assert ep.rewards_N[i] == pytest.approx(0.25 * (turns - (cut == "tokens")))
        cuts.append(cut)
    return cuts


@pytest.mark.slow
def test_turn_and_token_budgets():
    graphdef, params = _model("llama")
    # Turn budget: at most 2 model turns; the 4-turn scripts are cut (truncated).
    ep = _run(graphdef, params, max_turns=2, max_turn_tokens=5)
    envs = _envs(2)
    for i, env in enumerate(envs):
        assert ep.turns_N[i] == min(len(env.obs) + 1, 2)
        assert ep.truncated_N[i] == (len(env.obs) + 1 > 2)
    cuts = _check_budgets(ep, max_tokens=40, max_turns=2, max_turn_tokens=5)
    assert cuts == ["turns" if len(env.obs) + 1 > 2 else "done" for env in envs]
    _check_exact(graphdef, params, ep)
    # Token budget: 8 transcript tokens. A row ends inside a model turn at the 8th
    # token, or after a turn whose next observation does not fit, or when its script
    # ends; each happens to some row here.
    ep = _run(graphdef, params, max_tokens=8, max_turn_tokens=5)
    cuts = _check_budgets(ep, max_tokens=8, max_turns=4, max_turn_tokens=5)
    assert {"tokens", "observation", "done"} <= set(cuts), cuts
    for i in range(len(cuts)):
        assert ep.mask_NxT[i, ep.lengths_N[i] - 1]  # every row ends on a model token
    _check_exact(graphdef, params, ep)


def _run_fixed(graphdef, params, prompts, environments):
    """Two rows, no EOS, turns of exactly 2 model tokens: lengths known in advance."""
    toks, mask = pad_prompts(prompts, pad_id=0, buckets=(8,))
    return multiturn.run_episodes(
        graphdef,
        params,
        environments,
        toks,
        mask,
        jax.random.key(0),
        sampling=SamplingConfig(max_new_tokens=1, eos_ids=(), pad_id=0),
        cfg=multiturn.MultiTurnConfig(
            max_tokens=20, max_turns=4, max_turn_tokens=2, max_obs_tokens=10, env_timeout_s=0.5
        ),
        encode_observation=encode_obs,
        decode=decode,
    )


@pytest.mark.parametrize("failure", ["raise", "hang"])
@pytest.mark.slow
def test_environment_error_ends_the_episode_with_nan(failure):
    class Boom(ScriptedEnv):
        def step(self, text):
            if self.turn == 1:
                if failure == "hang":
                    time.sleep(30)  # the 0.5 s budget interrupts it
                raise RuntimeError("env bug")
            return super().step(text)

    graphdef, params = _model("qwen2")
    t0 = time.monotonic()
    ep = _run_fixed(graphdef, params, PROMPTS[:2], [ScriptedEnv(["20"]), Boom(["20", "21"])])
    assert time.monotonic() - t0 < 25
    assert np.isnan(ep.rewards_N[1]) and ep.errors_N[1] and ep.turns_N[1] == 2
    want = "EnvTimeout: ran past 0.5 s" if failure == "hang" else "RuntimeError: env bug"
    assert ep.error_messages == [f"row 1: step: {want}"]
    # The other row played on to its end.
    assert not ep.errors_N[0] and ep.turns_N[0] == 2 and ep.rewards_N[0] == pytest.approx(0.5)


@pytest.mark.slow
def test_cache_filled_inside_an_observation_writes_the_rest_next_phase():
    """A row whose observation the cache cannot hold this phase finishes it in the next.

    Row 0 (prompt 8) has 13 transcript tokens when its second observation is queued,
    row 1 (prompt 1) 5, so row 1's cache is aligned to end where row 0's does (slot 20
    of 28) and the 8 free slots cannot hold its 9-token observation: the phase ends with
    row 1 still writing it.
    """
    graphdef, params = _model("qwen2")
    long = " ".join(str(30 + k) for k in range(9))
    scripts = [[" ".join(["20"] * 9), "21"], ["22", long]]
    ep = _run_fixed(graphdef, params, [list(range(5, 13)), [7]], [ScriptedEnv(o) for o in scripts])
    assert ep.phases == 4 and ep.turns_N.tolist() == [3, 3]  # one phase more than turns
    for i, obs in enumerate(scripts):
        ids = [[int(x) for x in o.split()] for o in obs]
        want_mask = [1, 1] + [0] * len(ids[0]) + [1, 1] + [0] * len(ids[1]) + [1, 1]
        n = ep.lengths_N[i]
        assert ep.mask_NxT[i, :n].astype(int).tolist() == want_mask
        env_tokens = [t for t, m in zip(ep.tokens_NxT[i, :n].tolist(), want_mask) if not m]
        assert env_tokens == ids[0] + ids[1]
        assert [len(t.split()) for t in ep.turn_texts[i]] == [2, 2, 2]
        assert not ep.truncated_N[i] and ep.rewards_N[i] == pytest.approx(0.75)
    _check_exact(graphdef, params, ep, update=False)


@pytest.mark.slow
def test_same_key_same_episodes():
    graphdef, params = _model("qwen3")
    a = _run(graphdef, params, key=3, max_turn_tokens=5)
    b = _run(graphdef, params, key=3, max_turn_tokens=5)
    np.testing.assert_array_equal(a.tokens_NxT, b.tokens_NxT)
    np.testing.assert_array_equal(a.logps_NxT, b.logps_NxT)


@pytest.mark.slow
def test_row_keys_make_each_episode_independent_of_the_other_rows():
    """One key per prompt (evaluation's): prompt b's episodes are the same in a call of all
    four prompts and in a call of two, though rows fall out of step differently in each
    (a row's key advances only when it draws); one key per call does not give that."""
    graphdef, params = _model("qwen3")
    g = 2
    scripts = [["20 21 22", "23"], ["24"], [], ["25 26", "27 28 29", "30"]]
    env_of = lambda i: ScriptedEnv(scripts[(i // g + i) % 4])  # row i of the full call
    cfg = multiturn.MultiTurnConfig(max_tokens=40, max_turns=4, max_obs_tokens=4)
    sampling = SamplingConfig(max_new_tokens=1, eos_ids=EOS, pad_id=0, prompt_buckets=(8,))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(4))

    def run(prompts, key, rows):
        toks, mask = pad_prompts([PROMPTS[b] for b in prompts], pad_id=0, buckets=(8,))
        return multiturn.run_episodes(
            graphdef, params, [env_of(i) for i in rows], toks, mask, key, sampling=sampling,
            cfg=cfg, encode_observation=encode_obs, decode=decode, num_samples=g,
        )  # fmt: skip

    whole = run([0, 1, 2, 3], keys, range(8))
    part = run([2, 3], keys[2:], range(4, 8))
    assert whole.phases > 1 and len(set(whole.lengths_N.tolist())) > 2  # rows out of step
    np.testing.assert_array_equal(part.tokens_NxT, whole.tokens_NxT[4:])
    np.testing.assert_array_equal(part.lengths_N, whole.lengths_N[4:])
    np.testing.assert_allclose(part.logps_NxT, whole.logps_NxT[4:], atol=1e-5, rtol=0)
    # The G episodes of a prompt still differ from each other.
    assert (whole.tokens_NxT[4] != whole.tokens_NxT[5]).any()
    # With one key for the whole call (training's), prompts 2 and 3 play otherwise when
    # prompts 0 and 1 share their call.
    key = jax.random.key(7)
    alone, together = run([2, 3], key, range(4, 8)), run([0, 1, 2, 3], key, range(8))
    assert (alone.tokens_NxT != together.tokens_NxT[4:]).any()
