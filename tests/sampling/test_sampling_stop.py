"""Stop sequences (``sampling.stop``): a row ends once its last generated tokens equal one.

The sampler tests run the toy ``CountingLM`` of sampling/test_sampling.py: every test draws
once without stops and once with them from the same key, so both runs make the
same draws up to the stop, and the stopped run must equal the unstopped one cut
by hand (numpy) at the first place where the completion ends with a stop sequence.
Then the config key and its encoding at setup, and multi-turn episodes, where a
stop sequence ends the model's turn and matches within that turn's tokens only.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers_episodes import EOS as MT_EOS
from helpers_episodes import PROMPTS as MT_PROMPTS
from helpers_episodes import _envs, _model, decode, encode_obs
from test_sampling import PROMPTS, CountingLM

from grpo_jax.rollout import episodes as multiturn
from grpo_jax.run.config import ConfigError, SamplingSection, parse_config
from grpo_jax.sampling import static as sampling
from grpo_jax.sampling import static_turns as turn_decode
from grpo_jax.sampling.static import SamplingConfig, pad_prompts

T = 12
PAD = 10  # the pad id (the model may draw it too: only a row's end decides padding)


def _generate(key=5, num_samples=8, **kw):
    cfg = SamplingConfig(**{"max_new_tokens": T, "prompt_buckets": (4, 8), "pad_id": PAD, **kw})
    graphdef, params = nnx.split(CountingLM())
    toks, mask = pad_prompts(PROMPTS, pad_id=PAD, buckets=cfg.prompt_buckets)
    out = sampling.generate(
        graphdef, params, toks, mask, jax.random.key(key), cfg, num_samples=num_samples
    )
    return jax.tree.map(np.asarray, out._asdict())


def _cut(row, stops, eos=()):
    """The completion length where ``row`` (unstopped tokens) first ends; None: never."""
    row = [int(x) for x in row]
    for e, tok in enumerate(row):
        if tok in eos:
            return e + 1
        for q in stops:
            if e + 1 >= len(q) and tuple(row[e + 1 - len(q) : e + 1]) == tuple(q):
                return e + 1
    return None


def _check_cut(ref, out, stops, eos=()):
    """``out`` is ``ref`` cut at each row's first stop / EOS; returns the lengths."""
    lengths = []
    for r in range(ref["tokens"].shape[0]):
        end = _cut(ref["tokens"][r], stops, eos)
        n = T if end is None else end
        lengths.append(n)
        assert out["lengths"][r] == n, r
        assert out["truncated"][r] == (end is None), r
        np.testing.assert_array_equal(out["tokens"][r, :n], ref["tokens"][r, :n])
        assert (out["tokens"][r, n:] == PAD).all(), r
        np.testing.assert_array_equal(out["mask"][r], np.arange(T) < n)
        np.testing.assert_allclose(out["logps"][r, :n], ref["logps"][r, :n], atol=1e-6, rtol=0)
        np.testing.assert_allclose(
            out["behavior_logps"][r, :n], ref["behavior_logps"][r, :n], atol=1e-6, rtol=0
        )
        assert (out["logps"][r, n:] == 0).all() and (out["behavior_logps"][r, n:] == 0).all()
    return np.asarray(lengths)


@pytest.fixture(scope="module")
def reference():
    """32 sampled rows of T tokens, no EOS, no stops."""
    return _generate()


def _picks(ref, length):
    """Stop sequences of ``length`` tokens taken from the reference completions, so they fire."""
    toks = ref["tokens"]
    return (tuple(toks[3, 5 : 5 + length]), tuple(toks[17, 2 : 2 + length]))


@pytest.mark.parametrize("length", [1, 2, 3])
@pytest.mark.slow
def test_rows_end_at_the_first_stop(reference, length):
    stops = _picks(reference, length)
    out = _generate(stop_sequences=stops)
    lengths = _check_cut(reference, out, stops)
    # The test can fail: rows end at several places, before T, and the rows the
    # stops were taken from end by the latest there (at the pick or earlier).
    assert len(set(lengths.tolist())) >= 3 and lengths.min() < T
    assert lengths[3] <= 5 + length and lengths[17] <= 2 + length
    if length > 1:
        assert (lengths >= length).all()  # a longer stop needs that many generated tokens


def test_mixed_lengths_with_eos(reference):
    stops = (_picks(reference, 3)[0], _picks(reference, 2)[1], (int(reference["tokens"][9, 7]),))
    eos = (int(reference["tokens"][25, 4]),)
    out = _generate(stop_sequences=stops, eos_ids=eos)
    lengths = _check_cut(reference, out, stops, eos)
    assert lengths.min() < T and not out["truncated"].all()
    # The unstopped run's rows would not all end by EOS alone at these places.
    eos_only = np.asarray([_cut(r, (), eos) or T for r in reference["tokens"]], dtype=np.int64)
    assert (lengths < eos_only).any()


@pytest.mark.slow  # over 1.25 s on a 2-core CPU
def test_stop_never_matches_into_the_prompt():
    # Greedy: row 0's prompt ends with 7 and its completion starts with g0, g1.
    # (7, g0) and (5, 7, g0) match only when the prompt is read as part of the
    # completion, so row 0 must not stop at its first token.
    greedy = _generate(greedy=True, num_samples=1)
    g = greedy["tokens"][0]
    assert PROMPTS[0][-2:] == [5, 7]
    stops = ((7, int(g[0])), (5, 7, int(g[0])))
    out = _generate(greedy=True, num_samples=1, stop_sequences=stops)
    lengths = _check_cut(greedy, out, stops)
    assert lengths[0] > 1


def test_loop_exits_when_every_row_stopped(reference):
    # Stops = every row's tokens 1..2: all rows end by column 2, so the loop
    # must stop there instead of running to T.
    toks = reference["tokens"]
    stops = tuple(sorted({tuple(int(x) for x in toks[r, 1:3]) for r in range(toks.shape[0])}))
    cfg = SamplingConfig(max_new_tokens=T, prompt_buckets=(4, 8), pad_id=PAD, stop_sequences=stops)
    graphdef, params = nnx.split(CountingLM())
    tk, mk = pad_prompts(PROMPTS, pad_id=PAD, buckets=cfg.prompt_buckets)
    key = jax.random.key(5)
    prefill, decode_fn = sampling._compiled(graphdef, cfg, 8, None, jax.random.key_impl(key))
    _, _, state = prefill(params, tk, mk, key)
    state, _, truncated = decode_fn(params, state)
    assert int(state.step) == int(np.asarray(state.lengths_N).max()) <= 3
    assert not np.asarray(truncated).any()


def test_no_stop_logic_is_traced_without_stops():
    # The decode step with no stop sequences is the EOS-only step: no gather of
    # the recent tokens appears in its program.
    n, t = 4, 6
    state = sampling.DecodeState(
        step=np.int32(2),
        last_tokens_N=np.zeros(n, np.int32),
        prompt_lengths_N=np.ones(n, np.int32),
        tokens_NxT=np.zeros((n, t), np.int32),
        logps_NxT=np.zeros((n, t), np.float32),
        behavior_logps_NxT=np.zeros((n, t), np.float32),
        lengths_N=np.zeros(n, np.int32),
        done_N=np.zeros(n, bool),
        kv_mask_NxS=np.zeros((n, t), bool),
        cache=None,
        key_data=np.zeros(2, np.uint32),
    )
    draw = (np.zeros(n, np.int32), np.zeros(n, np.float32), np.zeros(n, np.float32))
    jaxpr = lambda cfg: str(jax.make_jaxpr(lambda s, d: sampling._write(s, d, cfg))(state, draw))
    plain = jaxpr(SamplingConfig(max_new_tokens=t, eos_ids=(3,)))
    stopped = jaxpr(SamplingConfig(max_new_tokens=t, eos_ids=(3,), stop_sequences=((1, 2),)))
    assert "gather" not in plain and "gather" in stopped


@pytest.mark.slow
def test_stop_hits_alignment():
    # Right-aligned suffix match with an availability limit per row.
    recent = np.asarray([[1, 2, 3], [9, 2, 3], [1, 2, 3], [0, 0, 3]], np.int32)
    hits = sampling.stop_hits(recent, np.asarray([3, 3, 2, 1]), ((1, 2, 3), (5,), (3,)))
    np.testing.assert_array_equal(hits, [True, True, True, True])
    hits = sampling.stop_hits(recent, np.asarray([3, 3, 2, 1]), ((1, 2, 3), (2, 3)))
    np.testing.assert_array_equal(hits, [True, True, True, False])
    hits = sampling.stop_hits(recent, np.asarray([3, 3, 2, 3]), ((1, 2, 3),))
    np.testing.assert_array_equal(hits, [True, False, False, False])


# ---------------------------------------------------------------------------
# Configuration and encoding.


def test_sampling_config_stop_sequences():
    cfg = SamplingConfig(max_new_tokens=4, stop_sequences=[[1, 2], np.asarray([3])])
    assert cfg.stop_sequences == ((1, 2), (3,))
    hash(cfg)  # static argument of the jitted sampler
    assert SamplingConfig(max_new_tokens=4).stop_sequences == ()
    for bad, msg in [
        (((),), "'sampling.stop_sequences[0]' = () must be a non-empty tuple"),
        (((1, -1),), "'sampling.stop_sequences[0][1]' = -1 must be >= 0"),
        (((1, 2.5),), "'sampling.stop_sequences[0][1]' = 2.5 must be an integer"),
        ((5,), "'sampling.stop_sequences[0]' = 5 must be a non-empty tuple"),
        ("ab", "'sampling.stop_sequences' = 'ab' must be a tuple of token-id tuples"),
    ]:
        with pytest.raises(ConfigError) as e:
            SamplingConfig(max_new_tokens=4, stop_sequences=bad)
        assert msg in str(e.value)


def test_sampling_section_stop_key():
    section = SamplingSection.from_mapping({"max_new_tokens": 4, "stop": ["\n\nQ:", "##"]})
    assert section.stop == ("\n\nQ:", "##")
    assert SamplingSection.from_mapping({"max_new_tokens": 4, "stop": "END"}).stop == ("END",)
    assert SamplingSection.from_mapping({"max_new_tokens": 4}).stop == ()
    with pytest.raises(ConfigError, match=r"'sampling.stop\[1\]' = '' is empty"):
        SamplingSection.from_mapping({"max_new_tokens": 4, "stop": ("a", "")})
    with pytest.raises(ConfigError, match=r"'sampling.stop' = \('a', 3\) must be a tuple of str"):
        SamplingSection.from_mapping({"max_new_tokens": 4, "stop": ("a", 3)})


def _default_run(**sampling_kw):
    from configs import default

    c = default.get_config()
    for k, v in sampling_kw.items():
        setattr(c.sampling, k, v)
    return parse_config(c)


def test_setup_encodes_stop_strings_with_the_tokenizer(builtin_tokenizer):
    from grpo_jax.run.builders import stop_token_ids, tokenizer_sampling

    # The character tokenizer: ' '..'~' are ids 4..98, '\n' is 99, BOS is 1 (never added here).
    run = _default_run(stop=("\n\nQuestion:", "#"))
    cfg = tokenizer_sampling(run, builtin_tokenizer)
    want_q = (99, 99, 53, 89, 73, 87, 88, 77, 83, 82, 30)
    assert cfg.stop_sequences == (want_q, (7,))
    assert cfg.eos_ids == (2,)
    assert tokenizer_sampling(_default_run(), builtin_tokenizer).stop_sequences == ()
    # A string the tokenizer turns into no tokens could never stop a row.
    empty_tok = lambda text, add_special_tokens: {"input_ids": [] if text == " " else [5]}
    with pytest.raises(ConfigError, match=r"'sampling.stop\[1\]' = ' ' encodes to no tokens"):
        stop_token_ids(("x", " "), empty_tok)


def test_stop_key_from_the_command_line_config():
    # The key exists in every config file (configs/common.py), so a flag can set it.
    from configs import default

    c = default.get_config()
    assert tuple(c.sampling.stop) == ()
    c.sampling.stop = ("\n\nQuestion:",)
    assert parse_config(c).sampling.stop == ("\n\nQuestion:",)


# ---------------------------------------------------------------------------
# Multi-turn episodes: a stop sequence ends the model's turn.


def _episodes(graphdef, params, stops=()):
    toks, mask = pad_prompts(MT_PROMPTS, pad_id=0, buckets=(8,))
    return multiturn.run_episodes(
        graphdef,
        params,
        _envs(2),
        toks,
        mask,
        jax.random.key(0),
        sampling=SamplingConfig(
            max_new_tokens=1, eos_ids=MT_EOS, pad_id=0, prompt_buckets=(8,), stop_sequences=stops
        ),
        cfg=multiturn.MultiTurnConfig(
            max_tokens=40, max_turns=4, max_obs_tokens=4, max_turn_tokens=6
        ),
        encode_observation=encode_obs,
        decode=decode,
        num_samples=2,
    )


@pytest.fixture(scope="module")
def mt_reference():
    graphdef, params = _model("qwen2")
    return graphdef, params, _episodes(graphdef, params)


def _turns(ep, i):
    """Row i's model turns as lists of token ids (contiguous runs of model tokens)."""
    turns, cur = [], []
    for tok, m in zip(ep.tokens_NxT[i, : ep.lengths_N[i]], ep.mask_NxT[i, : ep.lengths_N[i]]):
        if m:
            cur.append(int(tok))
        elif cur:
            turns.append(cur)
            cur = []
    return turns + ([cur] if cur else [])


@pytest.mark.slow
def test_multiturn_write_token_matches_within_the_turn_only():
    # One step of the multi-turn loop's bookkeeping, no model: each row has a
    # transcript so far (model tokens m, observation tokens o) and writes token w.
    stops = ((6, 7), (4, 4, 4))
    rows = [  # (transcript, model mask, model tokens of this turn, w, w from the model, ends)
        ([5, 6], [1, 1], 2, 7, True, True),  # (6, 7) within the turn
        ([6], [0], 0, 7, True, False),  # 6 is the observation's
        ([6, 9, 6], [1, 0, 0], 0, 7, True, False),  # 6 of the last turn, then an observation
        ([1, 6], [1, 1], 2, 7, False, False),  # w is forced (an observation token)
        ([4, 4], [1, 1], 2, 4, True, True),  # (4, 4, 4) within the turn
        ([4, 4], [0, 1], 1, 4, True, False),  # the first 4 is the observation's
    ]
    n, t = len(rows), 6
    tokens, mask = np.zeros((n, t), np.int32), np.zeros((n, t), bool)
    for i, (seq, m, *_) in enumerate(rows):
        tokens[i, : len(seq)], mask[i, : len(seq)] = seq, m
    zeros = np.zeros(n, np.int32)
    st = turn_decode.MTState(
        cache=None,
        kv_mask_NxS=np.zeros((n, t), bool),
        end_slot_N=zeros,
        pos_N=zeros,
        pending_N=zeros,
        tokens_NxT=tokens,
        mask_NxT=mask,
        logps_NxT=np.zeros((n, t), np.float32),
        behavior_NxT=np.zeros((n, t), np.float32),
        len_N=np.asarray([len(r[0]) for r in rows], np.int32),
        turn_len_N=np.asarray([r[2] for r in rows], np.int32),
        active_N=np.ones(n, bool),
        reason_N=zeros,
        last_eos_N=np.zeros(n, bool),
        forced_NxO=np.zeros((n, 1), np.int32),
        forced_len_N=zeros,
        forced_pos_N=zeros,
        key_data=np.zeros(2, np.uint32),
    )
    sampling_cfg = SamplingConfig(max_new_tokens=1, eos_ids=(2,), stop_sequences=stops)
    out = turn_decode.write_token(
        st,
        np.ones(n, bool),
        np.asarray([r[3] for r in rows], np.int32),
        np.asarray([r[4] for r in rows]),
        np.zeros(n, np.float32),
        np.zeros(n, np.float32),
        multiturn.MultiTurnConfig(max_tokens=t),
        sampling_cfg,
    )
    ends = np.asarray([r[5] for r in rows])
    np.testing.assert_array_equal(np.asarray(out.active_N), ~ends)
    np.testing.assert_array_equal(np.asarray(out.reason_N), np.where(ends, turn_decode.TURN_END, 0))
    assert not np.asarray(out.last_eos_N).any()  # a stop is not an EOS (observation encoding)


@pytest.mark.slow
def test_multiturn_stop_ends_the_turn(mt_reference):
    graphdef, params, ref = mt_reference
    first = [_turns(ref, i)[0] for i in range(len(ref.rewards_N))]
    # A pair from inside a long first turn: that row's turn must end earlier than before.
    row = max(range(len(first)), key=lambda i: len(first[i]))
    assert len(first[row]) >= 4
    stop = tuple(first[row][1:3])
    ep = _episodes(graphdef, params, (stop,))
    cut_rows = 0
    for i, turn in enumerate(first):
        end = _cut(turn, (stop,)) or len(turn)
        assert ep.turn_texts[i][0] == decode(turn[:end]), i
        assert _turns(ep, i)[0] == turn[:end], i
        cut_rows += end < len(turn)
        # The same draws up to the stop: the same recorded log-probs.
        np.testing.assert_allclose(ep.logps_NxT[i, :end], ref.logps_NxT[i, :end], atol=1e-6, rtol=0)
        assert ep.mask_NxT[i, :end].all()
    assert cut_rows >= 1 and _turns(ep, row)[0] == first[row][:3]


@pytest.mark.slow
def test_multiturn_stop_never_spans_an_observation(mt_reference):
    # (last observation token, first model token of the next turn) would match
    # only by reading the environment's tokens as the model's: it must not fire,
    # so the episodes are exactly those without stops.
    graphdef, params, ref = mt_reference
    inside = set()
    for i in range(len(ref.rewards_N)):
        for turn in _turns(ref, i):
            inside |= {tuple(turn[j : j + 2]) for j in range(len(turn) - 1)}
    stop = None
    for i in range(len(ref.rewards_N)):
        m = ref.mask_NxT[i, : ref.lengths_N[i]]
        for k in range(1, len(m)):
            pair = (int(ref.tokens_NxT[i, k - 1]), int(ref.tokens_NxT[i, k]))
            if m[k] and not m[k - 1] and pair not in inside:
                stop = pair
                break
        if stop:
            break
    assert stop is not None, "no observation/turn boundary to test"
    ep = _episodes(graphdef, params, (stop,))
    np.testing.assert_array_equal(ep.tokens_NxT, ref.tokens_NxT)
    np.testing.assert_array_equal(ep.mask_NxT, ref.mask_NxT)
    np.testing.assert_array_equal(ep.lengths_N, ref.lengths_N)
    assert ep.turn_texts == ref.turn_texts
