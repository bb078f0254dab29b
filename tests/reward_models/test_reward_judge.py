"""LLM judges: the expected score against a hand-computed softmax over the score tokens, the
reference policy as judge without a copy, and the judge's settings."""

import functools
import json

import jax
import numpy as np
import pytest
from flax import nnx

from configs.default import get_config
from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import make_mesh
from grpo_jax.reward_models import JUDGE, Judge
from grpo_jax.rewards.section import JudgeSection
from grpo_jax.rollout.scorer import Scorer
from grpo_jax.run.config import parse_config

RUBRIC = "Q: {question}\nA: {completion}\nScore 1-3: "


def _section(**kw):
    kw = {"rubric": RUBRIC, "score_tokens": ("1", "2", "3"), "buckets": (32, 64), **kw}
    return JudgeSection(batch_size=kw.pop("batch_size", 4), **kw)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def _softmax_expectation(graphdef, params, tokenizer, text, ids, values):
    tokens = np.asarray(tokenizer(text)["input_ids"], np.int32)[None]
    # One compiled forward per length (op by op it compiles a hundred small programs).
    logits = np.asarray(_forward(graphdef, params, tokens), np.float64)[0, -1]
    z = logits[ids] - logits[ids].max()
    p = np.exp(z) / np.exp(z).sum()
    return float(p @ np.asarray(values))


def test_expected_score_by_hand(tiny_policy, builtin_tokenizer):
    graphdef, params = tiny_policy
    judge = Judge(_section(), graphdef, params, builtin_tokenizer)
    ids = judge.score_ids()
    assert ids == [builtin_tokenizer.convert_tokens_to_ids(t) for t in "123"]
    questions = ["2+2?", "name a prime number", "hi"]
    completions = ["4", "seven", "a longer answer than the others"]
    got = judge(["unused"] * 3, completions, questions, group_size=1)
    texts = judge.prompts(questions, completions)
    want = [
        _softmax_expectation(graphdef, params, builtin_tokenizer, t, ids, (1.0, 2.0, 3.0))
        for t in texts
    ]
    assert len({len(t) for t in texts}) == 3  # left padding in the batch
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.all((got > 1) & (got < 3)) and np.ptp(got) > 0


# An 8-device judge compiles ~20 s cold; the fast tier keeps the hand-computed case.
@pytest.mark.slow
def test_yes_no_and_sharded(tiny_policy, builtin_tokenizer):
    graphdef, params = tiny_policy
    section = _section(score_tokens=("Y", "N"), values=(1.0, 0.0), batch_size=8)
    one = Judge(section, graphdef, params, builtin_tokenizer)
    ids = one.score_ids()
    q, c = ["is 3 prime?"] * 8, ["yes", "no"] * 4
    got = one(q, c, q, group_size=2)
    (text,) = one.prompts(q[:1], c[:1])
    want = _softmax_expectation(graphdef, params, builtin_tokenizer, text, ids, (1.0, 0.0))
    np.testing.assert_allclose(got[0], want, atol=1e-5)  # P(Y) / (P(Y) + P(N))
    mesh = make_mesh({"data": 8})
    placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    eight = Judge(section, graphdef, placed, builtin_tokenizer, mesh)
    np.testing.assert_allclose(eight(q, c, q, group_size=2), got, atol=1e-5)


def test_reference_as_judge_holds_the_same_arrays(tiny_policy, builtin_tokenizer):
    graphdef, params = tiny_policy
    judge = Judge.load(_section(path="reference"))
    with pytest.raises(RuntimeError, match="before Judge.bind"):
        judge(["p"], ["c"], ["q"], group_size=1)
    judge.bind(graphdef, params, builtin_tokenizer)
    ours, ref = jax.tree.leaves(judge.params), jax.tree.leaves(params)
    assert len(ours) == len(ref) and all(a is b for a, b in zip(ours, ref, strict=True))
    scorer = Scorer([], correct_reward="exact_match", timeout_s=5.0, learned=[(JUDGE, judge, 1.0)])
    result, _, _ = scorer.score(
        ["p"], ["<answer>1</answer>"], [{"prompt": "q", "answer": "1"}], repeat=1
    )
    assert np.isfinite(result.per_reward[JUDGE]).all()
    np.testing.assert_allclose(result.total, result.per_reward[JUDGE])


def test_judge_settings_are_checked(builtin_tokenizer, tiny_policy):
    with pytest.raises(ConfigError, match="judge.values' is needed"):
        JudgeSection(score_tokens=("Yes", "No"))
    with pytest.raises(ConfigError, match="one finite number per score token"):
        JudgeSection(score_tokens=("1", "2"), values=(1.0,))
    with pytest.raises(ConfigError, match="judge.rubric"):
        JudgeSection(rubric="{question} {answer}")
    with pytest.raises(ConfigError, match="must contain \\{completion\\}"):
        JudgeSection(rubric="{question}")
    graphdef, params = tiny_policy
    with pytest.raises(ConfigError, match="'Yes' is 3 tokens"):
        Judge(
            _section(score_tokens=("Yes", "No"), values=(1.0, 0.0)),
            graphdef,
            params,
            builtin_tokenizer,
        )
    c = get_config("")
    c.judge.path = "reference"
    c.grpo.beta = 0.0
    with pytest.raises(ConfigError, match="grpo.beta > 0"):
        parse_config(c)


def test_a_reward_model_checkpoint_is_refused_as_judge(
    tmp_path, builtin_tokenizer, tiny_model_config
):
    """A *ForSequenceClassification checkpoint (score.weight, no LM head) would load as a causal
    LM through its tied embedding, its head ignored: refused, naming the setting to use."""
    from grpo_jax.core import integrity
    from grpo_jax.reward_models import RewardModel
    from grpo_jax.reward_models.training import save_reward_model

    rm = RewardModel(tiny_model_config, 1, rngs=nnx.Rngs(0))
    path = save_reward_model(rm, tmp_path / "rm", tokenizer=builtin_tokenizer)
    with pytest.raises(ConfigError, match="is a reward-model checkpoint") as e:
        Judge.load(_section(path=str(path)))
    assert "reward_model.path" in str(e.value) and "\n" not in str(e.value)
    # The head alone is enough to tell: a config.json that claims a causal LM is refused too.
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    integrity.write_sums(path, integrity.sums_names(path))  # the edit is on purpose
    with pytest.raises(ConfigError, match="'score.weight'"):
        Judge.load(_section(path=str(path)))


def test_a_judge_whose_files_differ_from_their_sha256sums_is_refused(
    tmp_path, builtin_tokenizer, tiny_model_config
):
    """A judge directory's SHA256SUMS is verified as a reward model's is: a flipped byte in
    its weights refuses to load (IntegrityError naming the file), not judge from bad weights."""
    from grpo_jax.core import integrity
    from grpo_jax.core.errors import IntegrityError
    from grpo_jax.models import create_model
    from grpo_jax.models.hf import save_pretrained

    path = save_pretrained(
        create_model(tiny_model_config, seed=0), tmp_path / "judge", tokenizer=builtin_tokenizer
    )
    integrity.write_sums(path, [p.name for p in path.iterdir() if p.is_file()])
    assert integrity.check_sums(path)  # the files as summed
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor's data, past the header
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="model.safetensors differs from its checksum"):
        Judge.load(_section(path=str(path)))


def test_score_tokens_are_each_listed_once(tiny_policy):
    with pytest.raises(ConfigError, match="lists '2' twice"):
        JudgeSection(score_tokens=("1", "2", "2", "3"))
    with pytest.raises(ConfigError, match="lists 'Y' twice"):
        JudgeSection(score_tokens=("Y", "N", "Y"), values=(1.0, 0.0, 1.0))

    class OneId:  # a tokenizer that gives two different texts one token
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [7]}

    graphdef, params = tiny_policy
    with pytest.raises(ConfigError, match="'1' and '2' are both token 7"):
        Judge(_section(score_tokens=("1", "2")), graphdef, params, OneId())


@pytest.mark.slow
def test_packed_rubrics_score_as_the_padded(tiny_policy, builtin_tokenizer):
    """train.packing = "on": several rubrics a row, each attending to itself alone, give the
    padded judge's scores (float32), on one device and on 8 (4 data x 2 fsdp); a rubric over
    the largest bucket stays unscored (NaN) in both."""
    graphdef, params = tiny_policy
    section = _section(batch_size=8)
    questions = ["2+2?", "name a prime", "hi", "what is 7*6?", "x", "count to three", "?"]
    completions = ["4", "seven", "a longer answer than the others", "42", "", "1 2 3", "no"]
    questions.append("a question far too long for the largest bucket " * 3)
    completions.append("so its rubric is not scored")
    padded = Judge(section, graphdef, params, builtin_tokenizer)(
        questions, completions, questions, group_size=1
    )
    packed_judge = Judge(section, graphdef, params, builtin_tokenizer, packing=True)
    packed = packed_judge(questions, completions, questions, group_size=1)
    assert np.isnan(padded[-1]) and np.isnan(packed[-1])
    assert np.ptp(padded[:-1]) > 1e-3  # the rubrics' scores differ: the comparison can fail
    np.testing.assert_allclose(packed[:-1], padded[:-1], rtol=1e-5, atol=1e-6)
    mesh = make_mesh({"data": 4, "fsdp": 2})
    placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    on_mesh = Judge(section, graphdef, placed, builtin_tokenizer, mesh, packing=True)
    got = on_mesh(questions, completions, questions, group_size=1)
    np.testing.assert_allclose(got[:-1], padded[:-1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_sharded_judge_scores_its_rows_without_reducing_activations(tiny_policy):
    """The judge's pass on data 4 x fsdp 2 with its weights in the fsdp layout: each device
    scores its own rows with the weights gathered, so nothing is all-reduced. Jitted without
    the mesh set, the pass split the model's width over fsdp and all-reduced every row's
    activations (docs/pods.md)."""
    import re

    import jax.numpy as jnp

    from grpo_jax.core.sharding import batch_sharding
    from grpo_jax.models.partitioning import param_shardings

    graphdef, params = tiny_policy
    mesh = make_mesh({"data": 4, "fsdp": 2})
    placed = jax.device_put(params, param_shardings(params, mesh, "fsdp"))
    judge = Judge(_section(batch_size=8), graphdef, placed, None, mesh)
    rows = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=batch_sharding(mesh))
    mask = jax.ShapeDtypeStruct((8, 32), jnp.bool_, sharding=batch_sharding(mesh))
    ids = jax.ShapeDtypeStruct((3,), jnp.int32)
    values = jax.ShapeDtypeStruct((3,), jnp.float32)
    text = judge._jit.lower(graphdef, placed, rows, mask, ids, values).compile().as_text()
    assert re.search(r" all-gather(?:-start)?\(", text)  # the weights are sharded
    assert not re.search(r" all-reduce(?:-start)?\(", text)
