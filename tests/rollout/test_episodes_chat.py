"""Episodes through a chat template, tools inside episodes, and the trainer's containment.

The tokenizer is the project's character tokenizer with ``<|im_start|>`` / ``<|im_end|>``
added and a ChatML template that renders ``role: "tool"`` messages as Qwen 2.5's does (a
user turn of ``<tool_response>`` blocks). The policy is a model that has memorised one
sequence (at position p it predicts token ``script[p + 1]`` with certainty), so an
episode follows a script through the real sampler, environments, tools and the trainer's
``play`` / ``collect``, and stays on it only while every observation has exactly the
tokens the script expects.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import envs
from grpo_jax.core import problems
from grpo_jax.core.sharding import Placement
from grpo_jax.models.builtin_tokenizer import EOS_ID, build_tokenizer
from grpo_jax.rollout import episodes as multiturn
from grpo_jax.rollout.rounds import Policy, PromptEncoder, Rollouts
from grpo_jax.run import evaluation
from grpo_jax.run.config import EnvSection, EvalConfig
from grpo_jax.sampling.static import SamplingConfig

# ChatML; consecutive tool messages share one user turn, as in Qwen 2.5's template.
TOOL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Numbers the messages from the end: an earlier turn renders differently later on.
REWRITING_TEMPLATE = (
    "{% for m in messages %}[{{ messages|length - loop.index0 }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tok():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TOOL_TEMPLATE
    return tok


def _im_end(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


def _ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _render(tok, messages, gen=False):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


# ---------------------------------------------------------------------------
# ObservationEncoder


def test_observation_tokens_are_the_templates_next_turn(chat_tok):
    tok, end = chat_tok, _im_end(chat_tok)
    enc = multiturn.ObservationEncoder(tok, chat=True, eos_ids=(end,))
    first = [{"role": "user", "content": "What is 17*23?"}]
    prompt = _ids(tok, _render(tok, first, gen=True))
    turn = "<calculator>17*23</calculator>"
    tool = [{"role": "tool", "name": "calculator", "content": "391"}]
    cases = [
        ("H", [{"role": "user", "content": "H"}]),  # text: a user message
        (tool, tool),  # the template's tool format
        (tool * 2, tool * 2),  # two results, one turn
    ]
    for obs, messages in cases:
        whole = first + [{"role": "assistant", "content": turn}] + messages
        want = _ids(tok, _render(tok, whole, gen=True))
        # A turn that ended with the template's end-of-turn token: not repeated.
        seen = prompt + _ids(tok, turn) + [end] + enc(obs, ended_with_eos=True)
        assert seen == want
        # A turn cut without it (max_turn_tokens, a stop string): the marker comes in.
        got = enc(obs, ended_with_eos=False)
        assert got[0] == end and prompt + _ids(tok, turn) + got == want
    assert "<tool_response>\n391\n</tool_response><|im_end|>" in enc.text(tool, ended_with_eos=True)
    # Without a chat template: the text as it is, messages joined by their content.
    plain = multiturn.ObservationEncoder(tok, chat=False, eos_ids=(end,))
    assert plain("H", ended_with_eos=True) == _ids(tok, "H")
    assert plain.text(tool * 2, ended_with_eos=False) == "391391"


def test_observation_encoder_refuses_a_template_that_rewrites_earlier_turns():
    tok = build_tokenizer()
    tok.chat_template = REWRITING_TEMPLATE
    enc = multiturn.ObservationEncoder(tok, chat=True, eos_ids=(EOS_ID,))
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        enc("H", ended_with_eos=False)


def test_first_prompt_from_the_environment_through_the_template(chat_tok):
    enc = PromptEncoder(chat_tok, template="{prompt}", chat=True, system="Be exact.", buckets=(64,))
    examples = [{"prompt": "a"}, {"prompt": "b"}]
    ids, texts = multiturn._first_prompt_tokens(enc, examples, ["guess 0-9:", None])
    assert texts[0] == _render(
        chat_tok,
        [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "guess 0-9:"}],
        gen=True,
    )
    assert texts[1] == enc.texts(examples[1:])[0]  # None: the example's usual prompt
    assert ids == [_ids(chat_tok, t) for t in texts]


# ---------------------------------------------------------------------------
# Scripted episodes through the trainer's play / collect


VOCAB = 102  # the chat tokenizer's; the plain one (100) never sees the last two
SCRIPT_LEN = 256  # one shape: every play below shares one compilation
EOS_IDS = (EOS_ID, 101)  # <eos>, <|im_end|>


class MemorizedLM(nnx.Module):
    """The sampler's model interface; at position p it predicts ``script[p + 1]``.

    Past the script's end it predicts ``default``. Its cache holds positions only, so
    what it writes depends on nothing but where it is.
    """

    def __init__(self, script, default: int):
        padded = list(script) + [default] * (SCRIPT_LEN - len(script))
        self.script = nnx.Variable(jnp.asarray(padded, jnp.int32))

    def init_cache(self, batch_size, max_len):
        return {"pos": jnp.zeros((batch_size, max_len), jnp.int32)}

    def forward_with_cache(
        self, tokens_BxT, *, positions_BxT, kv_mask_BxS, cache, cache_index, last_only=False
    ):
        del tokens_BxT, kv_mask_BxS
        positions = positions_BxT.astype(jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        cache = {"pos": jax.lax.dynamic_update_slice(cache["pos"], positions, (zero, cache_index))}
        pos = positions[:, -1:] if last_only else positions
        nxt = self.script[...][jnp.clip(pos + 1, 0, SCRIPT_LEN - 1)]
        hot = jax.nn.one_hot(nxt, VOCAB, dtype=jnp.bool_)
        return jnp.where(hot, 0.0, -1e4).astype(jnp.float32), cache


def _state(tok, script, *, chat, env, default):
    """What ``episodes.play`` reads: the run's rollout bundle (no scorer, batch or mesh:
    play uses none), its env section, and the parameters."""
    env_section = EnvSection(name=env, max_tokens=192, max_obs_tokens=64)
    graphdef, params = nnx.split(MemorizedLM(script, default))
    r = Rollouts(
        policy=Policy(graphdef=graphdef, tokenizer=tok),
        encoder=PromptEncoder(tok, template="{prompt}", chat=chat, system=None, buckets=(64,)),
        scorer=None,
        sampling=SamplingConfig(max_new_tokens=1, eos_ids=EOS_IDS, pad_id=0),
        grpo=None,
        batch_size=1,
        placement=None,
    )
    return (r, env_section), params


EXAMPLE = {"prompt": "What is 17*23?", "answer": "391"}
TURNS = ["<calculator>17*23</calculator>", "<python>print(17*23)</python>", "391"]
TOOL_USE = "tool_use(reward='exact_match(tag=None)', tools=('calculator', 'python'), chat={})"


def _check_episodes(ep, transcript, model_mask):
    for i in range(len(ep.rewards_N)):
        n = ep.lengths_N[i]
        assert ep.tokens_NxT[i, :n].tolist() == transcript
        assert ep.mask_NxT[i, :n].astype(int).tolist() == model_mask
        model = ep.mask_NxT[i].astype(bool)
        assert (ep.logps_NxT[i, model] > -1e-3).all() and (ep.logps_NxT[i, ~model] == 0).all()
        assert ep.turn_texts[i] == TURNS
        assert (ep.turns_N[i], ep.rewards_N[i], ep.success_N[i]) == (3, 1.0, True)
        assert not ep.truncated_N[i] and not ep.errors_N[i]
    assert ep.error_messages == []


@pytest.mark.slow
def test_tool_use_chat_episode_is_the_whole_conversation_templated(chat_tok):
    """Calculator, then Python, then the answer: the transcript is the template's."""
    tok, end = chat_tok, _im_end(chat_tok)
    tool = lambda name: {"role": "tool", "name": name, "content": "391"}
    messages = [
        {"role": "user", "content": EXAMPLE["prompt"]},
        {"role": "assistant", "content": TURNS[0]},
        tool("calculator"),
        {"role": "assistant", "content": TURNS[1]},
        tool("python"),
        {"role": "assistant", "content": TURNS[2]},
    ]
    whole = _ids(tok, _render(tok, messages))
    assert whole[-2:] == [end, _ids(tok, "\n")[0]]
    script = whole[:-1]  # the last turn ends at its <|im_end|>
    prompt = _ids(tok, _render(tok, messages[:1], gen=True))
    # Model tokens: each assistant message's content and its <|im_end|>.
    model_mask = [0] * len(script)
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(_ids(tok, _render(tok, messages[:k], gen=True)))
            for j in range(start, start + len(_ids(tok, m["content"])) + 1):
                model_mask[j] = 1
    assert end == EOS_IDS[1] and len(script) <= SCRIPT_LEN
    s, params = _state(tok, script, chat=True, env=TOOL_USE.format(True), default=end)
    ep, texts, reset_errors = multiturn.play(
        *s, params, [EXAMPLE], jax.random.key(0), num_samples=2
    )
    assert texts == [_render(tok, messages[:1], gen=True)] and reset_errors == []
    assert ep.prompt_tokens_NxP[0][ep.prompt_mask_NxP[0]].tolist() == prompt
    _check_episodes(ep, script[len(prompt) :], model_mask[len(prompt) :])


@pytest.mark.slow  # over 1.25 s on a 2-core CPU
def test_tool_use_tag_format_episode():
    """Without a chat template: results come back as <tool_result> blocks, as text."""
    tok = build_tokenizer()
    result = lambda name: _ids(tok, f'<tool_result name="{name}">391</tool_result>')
    pieces = [
        (_ids(tok, TURNS[0]) + [EOS_ID], 1),
        (result("calculator"), 0),
        (_ids(tok, TURNS[1]) + [EOS_ID], 1),
        (result("python"), 0),
        (_ids(tok, TURNS[2]) + [EOS_ID], 1),
    ]
    transcript = [t for ids, _ in pieces for t in ids]
    model_mask = [m for ids, m in pieces for _ in ids]
    prompt = list(tok(EXAMPLE["prompt"])["input_ids"])  # with <bos>, as the encoder adds it
    s, params = _state(
        tok, prompt + transcript, chat=False, env=TOOL_USE.format(False), default=EOS_ID
    )
    ep, _, _ = multiturn.play(*s, params, [EXAMPLE], jax.random.key(0), num_samples=2)
    _check_episodes(ep, transcript, model_mask)


@pytest.mark.slow
def test_a_multiturn_evaluation_gives_per_problem_results(tmp_path):
    """``evaluation.evaluate_policy`` with an environment: each problem's episode outcome
    (greedy, and two seeds of two sampled episodes), the figures from them, and a file."""
    tok = build_tokenizer()
    result = lambda name: _ids(tok, f'<tool_result name="{name}">391</tool_result>')
    turns = [_ids(tok, TURNS[0]) + [EOS_ID], _ids(tok, TURNS[1]) + [EOS_ID]]
    transcript = turns[0] + result("calculator") + turns[1] + result("python")
    answer = _ids(tok, TURNS[2]) + [EOS_ID]
    prompt = list(tok(EXAMPLE["prompt"])["input_ids"])
    (r, env), params = _state(
        tok, prompt + transcript + answer, chat=False, env=TOOL_USE.format(False), default=EOS_ID
    )
    wrong = {**EXAMPLE, "answer": "390"}  # the same episode, now a wrong answer
    cfg = EvalConfig(batch_size=1, num_samples=2, k=2, seeds=(0, 1))
    seen = []
    out = evaluation.evaluate_policy(
        r, env, params, [EXAMPLE, wrong], jax.random.key(0), cfg=cfg, on_problems=seen.append
    )
    (prob,) = seen
    assert prob.ids == (problems.problem_id(EXAMPLE), problems.problem_id(wrong))
    assert prob.greedy_correct.tolist() == [True, False]
    model_tokens = len(turns[0]) + len(turns[1]) + len(answer)
    assert prob.greedy_length.tolist() == [model_tokens] * 2
    assert prob.greedy_truncated.tolist() == [False, False]
    assert prob.seeds == (0, 1)
    assert prob.sampled_correct.tolist() == [[[True, True], [False, False]]] * 2
    assert out["eval/pass_at_1"] == 0.5 and out["eval/num_problems"] == 2
    assert out["eval/pass_at_1_lo"] < 0.5 < out["eval/pass_at_1_hi"]
    assert out["eval/pass_at_2"] == out["eval/sampled_pass_at_1"] == 0.5
    assert (out["eval/turns_mean"], out["eval/env_errors"]) == (3.0, 0.0)
    header, back = problems.read(problems.write(tmp_path / "step_0.jsonl", prob, {"step": 0}))
    assert header == {"step": 0} and problems.to_lines(back) == problems.to_lines(prob)


def test_a_template_that_cannot_continue_ends_the_episode_as_an_error():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = REWRITING_TEMPLATE
    prompt = _ids(tok, _render(tok, [{"role": "user", "content": EXAMPLE["prompt"]}], gen=True))
    script = prompt + _ids(tok, TURNS[0]) + [EOS_ID]
    s, params = _state(tok, script, chat=True, env=TOOL_USE.format(True), default=EOS_ID)
    ep, _, _ = multiturn.play(*s, params, [EXAMPLE], jax.random.key(0), num_samples=2)
    assert np.isnan(ep.rewards_N).all() and ep.errors_N.all() and (ep.turns_N == 1).all()
    assert ep.turn_texts == [[TURNS[0]]] * 2
    assert "observation: ValueError" in ep.error_messages[0]
    assert "renders earlier turns differently" in ep.error_messages[0]


_INSTANCES = iter(range(10**6))


@envs.register("reset_fails_on_bad_test")
class _ResetFailsOnBad:
    """reset raises for answer "bad"; one step ends the episode, rewards 0 and 1 in turn."""

    def __init__(self):
        self.reward = float(next(_INSTANCES) % 2)

    def reset(self, example):
        if example["answer"] == "bad":
            raise RuntimeError("no such puzzle")
        return None

    def step(self, text):
        return None, self.reward, True, {"success": self.reward == 1.0}


def _collect_state(env, mesh, said):
    """What ``episodes.collect`` reads of the trainer's state: configs/multiturn.py at G = 2,
    B = 3 (prompt bucket 16), a model whose every turn is one EOS; messages go to ``said``."""
    from integration.test_multiturn_train import _config

    from grpo_jax.run import builders
    from grpo_jax.run import config as config_lib

    cfg = _config()
    cfg.env.name = env
    cfg.grpo.G, cfg.train.batch_size = 2, 3
    run = config_lib.parse_config(cfg)
    tok = build_tokenizer()
    graphdef, params = nnx.split(MemorizedLM((), default=EOS_ID))  # turns of one EOS
    B, G = run.train.batch_size, run.grpo.G
    r = Rollouts(
        policy=Policy(graphdef=graphdef, tokenizer=tok),
        encoder=builders.build_encoder(run, tok),
        scorer=None,  # the environment scores
        sampling=builders.tokenizer_sampling(run, tok),
        grpo=run.grpo,
        batch_size=B,
        placement=Placement(mesh, None, None, rows_B=slice(0, B), rows_N=slice(0, B * G)),
        message=said.append,
    )
    return (r, run.env), params


@pytest.mark.slow
def test_collect_contains_a_failing_reset(one_device_mesh):
    """The trainer's collect: a reset that raises gives NaN episodes, counted; the rest play."""
    said = []
    s, params = _collect_state("reset_fails_on_bad_test", one_device_mesh, said)
    examples = [{"prompt": "1+2=", "answer": a} for a in ("3", "bad", "5")]
    batch, host = multiturn.collect(*s, params, examples, jax.random.key(0))
    rewards, adv = np.asarray(batch.rewards_N), np.asarray(batch.advantages_N)
    good = [0, 1, 4, 5]
    assert np.isnan(rewards[2:4]).all() and sorted(rewards[good]) == [0.0, 0.0, 1.0, 1.0]
    assert (adv[2:4] == 0).all()  # NaN: no gradient
    assert np.isfinite(adv).all() and (np.abs(adv[good]) > 0.5).all()  # the rest learn
    m = host.metrics
    assert m["env/reset_errors"] == 2 and m["env/errors"] == 2  # both episodes of "bad"
    assert m["env/turns_mean"] == 1.0
    assert said[0] == (
        "environment error (episode ends, reward NaN): "
        "example 1: reset: RuntimeError: no such puzzle"
    )
    # The broken rows end without stepping a missing environment.
    assert not any("NoneType" in line for line in said), said


@envs.register("long_or_huge_test")
class _LongOrHuge:
    """reset: answer "long" gives a first prompt of 40 tokens (the bucket holds 16).
    step: answer "huge" rewards 1e300 on every other instance, else 0 and 1 in turn."""

    def __init__(self):
        self.k = next(_INSTANCES)

    def reset(self, example):
        self.answer = example["answer"]
        return "x" * 40 if self.answer == "long" else None

    def step(self, text):
        reward = float(self.k % 2) * (1e300 if self.answer == "huge" else 1.0)
        return None, reward, True, {}


def test_collect_contains_a_long_first_prompt_and_clips_a_huge_reward(one_device_mesh):
    """A first observation longer than the largest prompt bucket breaks its group's episodes
    (the example's usual prompt stands in; reward NaN, counted); an episode reward beyond
    +-1e6 is clipped to it and counted, as single-turn rewards are, so that its group learns."""
    said = []
    s, params = _collect_state("long_or_huge_test", one_device_mesh, said)
    examples = [{"prompt": "1+2=", "answer": a} for a in ("3", "long", "huge")]
    batch, host = multiturn.collect(*s, params, examples, jax.random.key(0))
    rewards, adv = np.asarray(batch.rewards_N), np.asarray(batch.advantages_N)
    assert np.isnan(rewards[2:4]).all() and (adv[2:4] == 0).all()
    assert sorted(rewards[4:]) == [0.0, 1e6] and np.isfinite(adv).all()
    assert (np.abs(adv[[0, 1, 4, 5]]) > 0.5).all()
    m = host.metrics
    assert m["env/reset_errors"] == 2 and m["env/errors"] == 2
    assert m["rewards/env/clipped"] == 1
    assert said[0] == (
        "environment error (episode ends, reward NaN): example 1: reset: a first prompt of "
        "41 tokens, more than the largest prompt bucket (16, sampling.prompt_buckets)"
    )
