"""Reward models: parity with transformers' AutoModelForSequenceClassification, sharded
scoring, normalisation, the Scorer's combination by weight, and containment."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_config import Console
from helpers_hf import (
    hf_classifier_scores,
    load_hf_classifier,
    make_tiny_hf_checkpoint,
    make_tiny_hf_classifier,
)
from helpers_jit import scores as jit_scores

from grpo_jax import rewards
from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import batch_sharding, make_mesh
from grpo_jax.models import CheckpointError
from grpo_jax.reward_models import (
    LEARNED,
    LearnedReward,
    RunningMoments,
    group_standardize,
    learned_metrics,
    load_reward_model,
)
from grpo_jax.rewards.section import JudgeSection, RewardModelSection
from grpo_jax.rollout.scorer import Scorer

LENGTHS = (3, 11, 7)  # prompts of different lengths: left padding in every row but one


@pytest.fixture(scope="module")
def qwen2_rm(tmp_path_factory):
    return make_tiny_hf_classifier(tmp_path_factory.mktemp("rm") / "qwen2", "qwen2", num_labels=2)


def _left_padded(rows, T):
    tokens = np.zeros((len(rows), T), np.int32)
    mask = np.zeros((len(rows), T), bool)
    for i, r in enumerate(rows):
        tokens[i, T - len(r) :], mask[i, T - len(r) :] = r, True
    return tokens, mask


def check_parity(path, seed=0):
    """A left-padded batch's scores equal transformers' on each sequence alone and batched."""
    model = load_reward_model(path)
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, 320, n) for n in LENGTHS]
    tokens, mask = _left_padded(rows, 16)
    ours = np.asarray(jit_scores(model, tokens, mask))
    hf = load_hf_classifier(path)
    alone = np.concatenate([hf_classifier_scores(hf, r[None]) for r in rows])
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    batched = hf_classifier_scores(hf, tokens, attention_mask=mask, position_ids=positions)
    assert ours.shape == alone.shape == (len(rows), model.num_labels)
    np.testing.assert_allclose(ours, alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours, batched, atol=1e-5, rtol=0)
    assert np.ptp(ours) > 0.1  # the scores differ between rows: the comparison can fail


def test_qwen2_scores_equal_transformers(qwen2_rm):
    check_parity(qwen2_rm)


@pytest.mark.slow
@pytest.mark.parametrize("family,labels", [("llama", 1), ("qwen3", 3), ("gemma3", 1)])
def test_families_score_equal_transformers(tmp_path, family, labels):
    check_parity(make_tiny_hf_classifier(tmp_path / family, family, num_labels=labels), seed=1)


def _section(path, **kw):
    return RewardModelSection(path=str(path), buckets=(16, 32), batch_size=8, **kw)


TEXTS = ["Q: 2+2? A: ", "Q: name a prime. A: ", "Q: hi A: "]
COMPLETIONS = ["4", "seven, surely", "hello there"]


# An 8-device mesh compiles its scorer again: ~20 s cold; the fast tier keeps one device's.
@pytest.mark.slow
def test_sharded_score_equals_one_device(qwen2_rm):
    """8 fake devices (4 data x 2 fsdp): the same scores as one device (one bucket there)."""
    # Two batches of 8 rows: the first needs the 32 bucket, the second (short rows) 16.
    prompts = TEXTS[1:] * 4 + TEXTS[:1] * 4
    completions = COMPLETIONS[1:] * 4 + COMPLETIONS[:1] * 4
    one = LearnedReward.load(_section(qwen2_rm), None)
    mesh = make_mesh({"data": 4, "fsdp": 2})
    eight = LearnedReward.load(
        RewardModelSection(path=str(qwen2_rm), buckets=(32,), batch_size=8), mesh
    )
    params = nnx.state(eight.model, nnx.Param)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(params)} == {8}
    a = one(prompts, completions, prompts, group_size=3)
    b = eight(prompts, completions, prompts, group_size=3)
    lengths = [len(t) for t in one.token_lists(one.texts(prompts, completions, prompts))]
    assert max(lengths[8:]) <= 16 < max(lengths[:8]) <= 32  # two buckets
    assert np.isfinite(a).all() and np.ptp(a) > 0.1
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    # The texts scored are the prompt followed by the completion, as one model call shows.
    tokens, mask = _left_padded([one.token_lists([TEXTS[1] + COMPLETIONS[1]])[0]], 32)
    direct = np.asarray(jit_scores(one.model, tokens, mask))[0, 0]
    np.testing.assert_allclose(a[0], direct, atol=1e-5)  # row 0 is that text
    # Each device computes its rows with the weights gathered: nothing to all-reduce. Jitted
    # without the mesh set, the pass split the model's width over fsdp and all-reduced the
    # activations of every row, layer by layer (14 all-reduces here; on a v5p-64, 142 GB of
    # collectives a pass of a 0.5B reward model: docs/pods.md).
    rows = jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=batch_sharding(mesh))
    mask = jax.ShapeDtypeStruct((8, 32), jnp.bool_, sharding=batch_sharding(mesh))
    graphdef, params = nnx.split(eight.model)
    text = eight._jit.lower(graphdef, params, rows, mask).compile().as_text()
    assert not re.search(r" all-reduce(?:-start)?\(", text)


def test_chat_template_and_label(qwen2_rm):
    section = RewardModelSection(
        path=str(qwen2_rm), buckets=(64,), batch_size=2, chat=True, label=1
    )
    lr = LearnedReward.load(section, None)
    (text,) = lr.texts(["ignored"], ["4"], ["2+2?"])
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    tokens, mask = _left_padded([lr.token_lists([text])[0]], 64)
    want = np.asarray(jit_scores(lr.model, tokens, mask))[0, 1]
    np.testing.assert_allclose(lr(["ignored"], ["4"], ["2+2?"], group_size=1), [want], atol=1e-5)
    with pytest.raises(ConfigError, match="reward_model.label' = 2 is not a class"):
        LearnedReward.load(_section(qwen2_rm, label=2), None)


def test_normalisation_by_hand():
    v = np.array([1.0, 3.0, np.nan, 10.0, 10.0, 16.0], np.float32)
    g = group_standardize(v, 3)
    np.testing.assert_allclose(g[:2], [-1.0, 1.0], atol=1e-5)  # mean 2, std 1 (NaN left out)
    assert np.isnan(g[2])
    std = np.sqrt(((np.array([10, 10, 16]) - 12.0) ** 2).mean())
    np.testing.assert_allclose(g[3:], (np.array([10, 10, 16]) - 12.0) / std, atol=1e-5)
    m = RunningMoments()
    m.add(np.array([1.0, 2.0]))
    m.add(np.array([np.nan, 6.0, 3.0]))
    assert m.count == 4 and m.mean == pytest.approx(3.0)
    assert m.std == pytest.approx(np.std([1.0, 2.0, 6.0, 3.0]))


class _WithMoments:
    """A stand-in learned reward that standardises by its running moments."""

    def __init__(self):
        self.moments = RunningMoments()


def test_the_running_moments_survive_a_checkpoint_bit_for_bit():
    """What checkpoint.save_run writes (JSON) and a resume restores: the resumed moments
    then standardise the next batch exactly as the uninterrupted ones do."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(3.0, 2.0, 37), rng.normal(-1.0, 0.5, 16)
    whole = RunningMoments()
    whole.add(a)
    whole.add(b)
    saved_at = RunningMoments()
    saved_at.add(a)
    kw = dict(correct_reward="exact_match", timeout_s=5.0)
    before = Scorer((), **kw, learned=[(LEARNED, _WithMoments(), 1.0), ("fixed", _Fixed([1]), 1)])
    before.learned[0][1].moments = saved_at
    meta = json.loads(json.dumps(before.state_dict()))
    assert meta == {LEARNED: {"count": 37, "mean": saved_at.mean, "m2": saved_at.m2}}
    after = Scorer((), **kw, learned=[(LEARNED, _WithMoments(), 1.0)])
    after.load_state_dict(meta)
    resumed = after.learned[0][1].moments
    resumed.add(b)
    assert resumed == whole  # count, mean and m2 equal as floats, not approximately
    after.load_state_dict({})  # an older checkpoint without them leaves the moments alone
    assert resumed == whole


class _Fixed:
    """A stand-in reward model: fixed values, to test how the Scorer combines them."""

    def __init__(self, values):
        self.values = np.asarray(values, np.float32)

    def __call__(self, prompts, completions, questions, *, group_size):
        assert len(prompts) == len(completions) == len(questions) == len(self.values)
        return self.values


def test_scorer_adds_the_learned_reward_by_weight():
    specs = (rewards.RewardSpec("exact_match", 1.0),)
    examples = [{"prompt": "q", "answer": "4"}]
    learned = _Fixed([0.5, np.nan])
    scorer = Scorer(
        specs, correct_reward="exact_match", timeout_s=5.0, learned=[(LEARNED, learned, 2.0)]
    )
    result, correct, _ = scorer.score(
        ["q", "q"], ["<answer>4</answer>", "<answer>5</answer>"], examples, repeat=2
    )
    np.testing.assert_allclose(result.total[0], 1.0 + 2.0 * 0.5)
    assert np.isnan(result.total[1])  # a NaN score: unscored, advantage 0
    assert result.errors[LEARNED] == 1
    assert list(correct) == [True, False]
    assert result.metrics()[f"rewards/{LEARNED}/errors"] == 1


def test_nan_scores_are_contained(qwen2_rm, tmp_path, caplog):
    """A reward model whose weights hold NaN scores NaN (unscored), does not raise, and says
    so in one warning, at its first batch."""
    lr = LearnedReward.load(_section(qwen2_rm), None)
    state = nnx.state(lr.model, nnx.Param)
    state["score"][...] = state["score"][...] * np.nan
    nnx.update(lr.model, state)
    lr.__post_init__()
    with caplog.at_level("WARNING", logger="grpo_jax.reward_models.scorer"):
        out = lr(TEXTS, COMPLETIONS, TEXTS, group_size=3)
        assert np.isnan(lr(TEXTS, COMPLETIONS, TEXTS, group_size=3)).all()
    assert np.isnan(out).all()
    assert [r.getMessage()[:68] for r in caplog.records] == [
        "reward_model: 3 of 3 scores are not finite (NaN or inf), so those co"
    ]
    assert repr(str(qwen2_rm)) in caplog.records[0].getMessage()


def test_a_step_whose_rewards_are_all_unscored_blames_the_rewards_not_the_policy():
    from types import SimpleNamespace

    from grpo_jax.rollout.stats import rollout_metrics
    from grpo_jax.run.config import GRPOConfig, HealthConfig, TeacherConfig, TrainConfig
    from grpo_jax.run.report import Reporter

    console = Console()
    said = console.said
    records = SimpleNamespace(progress=console)
    run = SimpleNamespace(
        train=TrainConfig(no_signal_steps=2), health=HealthConfig(), teacher=TeacherConfig(),
        grpo=GRPOConfig(),
    )  # fmt: skip
    rep = Reporter(run, records)
    nan_N, zero_N = np.full(4, np.nan), np.zeros(4)
    for total_N, per_reward in [
        (nan_N, {"exact_match": zero_N, LEARNED: nan_N}),
        (zero_N, {"exact_match": zero_N}),
    ]:
        said.clear()
        m = rollout_metrics(
            total_N=total_N,
            per_reward=per_reward,
            errors={LEARNED: int(np.isnan(total_N).sum())},
            correct_N=zero_N.astype(bool),
            lengths_N=zero_N + 3,
            truncated_N=zero_N.astype(bool),
            duplicate_N=zero_N.astype(bool),
            G=2,
        )
        host = SimpleNamespace(metrics=m)
        for step in (1, 2):
            rep._rollout_alarms(step, host)
        assert len(said) == 1 and "step 2: no group has had any reward variance" in said[0]
        if np.isnan(total_N).all():
            assert "every one is unscored (NaN)" in said[0]
            assert "The rewards fail, not the policy: reward_model scored nothing" in said[0]
            assert "warm-start longer" not in said[0]
        else:
            assert "warm-start longer" in said[0] and "unscored" not in said[0]


def test_with_a_teacher_or_a_critic_equal_rewards_raise_no_no_signal_alarm():
    """Distillation alone (the rewards' weights 0) or PPO's critic moves the policy though
    no group's rewards vary: neither the no-signal message nor the zero-variance alarm."""
    from types import SimpleNamespace

    from grpo_jax.run.config import GRPOConfig, HealthConfig, TeacherConfig, TrainConfig
    from grpo_jax.run.report import Reporter

    m = {"rollout/frac_zero_var_groups": 1.0, "rollout/pass_rate": 0.5}
    for teacher, grpo, quiet in (
        (TeacherConfig(), GRPOConfig(), False),
        (TeacherConfig(path="/ckpt/teacher"), GRPOConfig(), True),
        (TeacherConfig(), GRPOConfig(advantage_estimator="gae"), True),
    ):
        console = Console()
        health = HealthConfig(zero_var_steps=2)
        run = SimpleNamespace(train=TrainConfig(no_signal_steps=2), health=health,
                              teacher=teacher, grpo=grpo)  # fmt: skip
        rep = Reporter(run, SimpleNamespace(progress=console))
        fired = []
        for step in (1, 2, 3):
            rep._rollout_alarms(step, SimpleNamespace(metrics=m))
            fired += [a.name for a in rep.alarms.check(step, m)]
        assert (console.said == [] and fired == []) == quiet, (console.said, fired)


def test_too_long_text_is_unscored(qwen2_rm, caplog):
    lr = LearnedReward.load(
        RewardModelSection(path=str(qwen2_rm), buckets=(16,), batch_size=2), None
    )
    with caplog.at_level("WARNING", logger="grpo_jax.reward_models.scorer"):
        out = lr(["Q: "] * 2, ["x", "y" * 40], ["Q"] * 2, group_size=1)
    assert np.isfinite(out[0]) and np.isnan(out[1])
    assert "not finite" not in caplog.text and "exceed reward_model.buckets" in caplog.text


def test_bad_checkpoints_are_refused(qwen2_rm, tmp_path):
    with pytest.raises(CheckpointError, match="missing: no such checkpoint directory"):
        load_reward_model(tmp_path / "missing")
    causal = make_tiny_hf_checkpoint(tmp_path / "causal", "qwen2", tokenizer=False)
    with pytest.raises(CheckpointError, match="no tensor 'score.weight'"):
        load_reward_model(causal)
    cfg = json.loads((qwen2_rm / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(qwen2_rm / "model.safetensors")
    cfg["id2label"] = {"0": "a", "1": "b", "2": "c"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"score.weight' has shape \(2, 64\)"):
        load_reward_model(bad)
    (bad / "model.safetensors").unlink()
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_reward_model(bad)


def test_section_checks():
    with pytest.raises(ConfigError, match="reward_model.normalize"):
        RewardModelSection(normalize="zscore")
    with pytest.raises(ConfigError, match="reward_model.buckets"):
        RewardModelSection(buckets=(64, 32))
    with pytest.raises(ConfigError, match="reward_model.weight"):
        RewardModelSection(weight=float("nan"))

    class _OneLabel:
        num_labels = 1

    with pytest.raises(ConfigError, match="multiple of the mesh's 8 batch shards"):
        LearnedReward(_OneLabel(), None, RewardModelSection(batch_size=4), make_mesh())


def test_setup_builds_the_scorer_with_the_reward_model(qwen2_rm):
    from configs import default
    from grpo_jax.run.builders import build_scorer
    from grpo_jax.run.config import parse_config

    c = default.get_config("")
    c.rewards = "exact_match(tag=None):1.0"
    c.reward_model.path = str(qwen2_rm)
    c.reward_model.weight = 0.5
    c.reward_model.buckets = (32,)
    c.reward_model.batch_size = 8
    scorer = build_scorer(parse_config(c), make_mesh())
    ((name, learned_reward, weight),) = scorer.learned
    assert name == LEARNED and isinstance(learned_reward, LearnedReward) and weight == 0.5
    examples = [{"prompt": "q", "answer": "4"}]
    result, _, _ = scorer.score(["Q: "] * 2, ["4", "5"], examples, repeat=2)
    learned = result.per_reward[LEARNED]
    assert np.isfinite(learned).all()
    verifiable = result.per_reward["exact_match(tag=None)"]
    assert list(verifiable) == [1.0, 0.0]
    np.testing.assert_allclose(result.total, verifiable + 0.5 * learned, rtol=1e-6)


def test_learned_metrics_by_hand():
    # Group 1: correct (0.9, 0.2) vs wrong (0.5): pairs 0.9>0.5 win, 0.2<0.5 loss.
    # Group 2: correct 0.3 vs wrong (0.3 tie, NaN unscored): one tie = 1/2.
    v = np.array([0.9, 0.2, 0.5, 0.3, 0.3, np.nan])
    correct = np.array([True, True, False, True, False, False])
    m = learned_metrics("reward_model", v, correct, group_size=3)
    assert m["rewards/reward_model/agreement"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert m["rewards/reward_model/max"] == 0.9 and m["rewards/reward_model/min"] == 0.2
    assert m["rewards/reward_model/std"] == pytest.approx(np.std(v[:5]))
    assert "rewards/judge/agreement" not in learned_metrics("judge", v, np.ones(6, bool), 3)


def test_memory_plan_counts_the_reward_model(qwen2_rm, tiny_model_config):
    from grpo_jax.reward_models import checkpoint_bytes, learned_bytes, reward_model_bytes
    from grpo_jax.run import memory

    mesh = make_mesh({"data": 4, "fsdp": 2})
    placed = load_reward_model(qwen2_rm, mesh=mesh)
    # The plan's count equals the bytes one device holds of the placed parameters.
    held = sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(nnx.state(placed, nnx.Param))
    )
    assert checkpoint_bytes(qwen2_rm, dict(mesh.shape), "fsdp", classifier=True) == held
    assert learned_bytes(str(qwen2_rm), "", {"data": 1}) == reward_model_bytes(placed)
    assert learned_bytes("", "reference", dict(mesh.shape)) == 0  # the reference's own weights
    est = memory.plan(
        tiny_model_config,
        mesh_shape={"data": 1},
        layout="fsdp",
        budget_bytes=None,
        learned_bytes=held,
        batch_rows=4,
        sample_rows=4,
        seq_len=8,
        prompt_len=8,
        beta=0.0,
    )
    assert est.learned == held and "reward model / judge" in est.table()
    assert est.total == max(est.sampling, est.training) and est.sampling >= held


class _Raises:
    def __call__(self, prompts, completions, questions, *, group_size):
        raise RuntimeError("out of memory on the reward model")


def test_a_learned_reward_that_raises_or_misbehaves_is_contained(caplog):
    specs = (rewards.RewardSpec("exact_match", 1.0),)
    examples = [{"prompt": "q", "answer": "4"}]
    scorer = Scorer(
        specs,
        correct_reward="exact_match",
        timeout_s=5.0,
        learned=[(LEARNED, _Raises(), 1.0), ("judge", lambda *a, **k: [1.0, 2.0, 3.0], 1.0)],
    )
    result, correct, _ = scorer.score(["q", "q"], ["<answer>4</answer>", "x"], examples, repeat=2)
    assert np.isnan(result.total).all() and list(correct) == [True, False]
    assert result.errors[LEARNED] == 2 and result.errors["judge"] == 2
    assert "out of memory on the reward model" in caplog.text
    assert "returned shape (3,), not (2,)" in caplog.text


def test_a_reward_model_too_big_for_memory_is_refused(qwen2_rm, tiny_model_config):
    from grpo_jax.reward_models import learned_bytes
    from grpo_jax.run import memory

    held = learned_bytes(str(qwen2_rm), "", {"data": 1})
    kw = dict(batch_rows=1, sample_rows=1, seq_len=4, prompt_len=4, beta=0.0)
    est = memory.plan(tiny_model_config, mesh_shape={"data": 1}, layout="fsdp", **kw)
    with pytest.raises(memory.MemoryBudgetError, match="shard the reward model or judge"):
        memory.plan(
            tiny_model_config,
            mesh_shape={"data": 1},
            layout="fsdp",
            budget_bytes=est.total + held // 2,  # room for the policy, not for the reward model
            learned_bytes=held,
            **kw,
        )


def test_buckets_are_checked_alike_for_reward_model_and_judge():
    assert RewardModelSection(path="p", buckets="16, 32").buckets == (16, 32)
    assert JudgeSection(buckets=64).buckets == (64,)
    for section, key in ((RewardModelSection, "reward_model"), (JudgeSection, "judge")):
        for bad in ((32, 16), (), (0, 8), "16,x"):
            with pytest.raises(ConfigError, match=f"'{key}.buckets"):
                section(buckets=bad)


@pytest.mark.slow  # two processes start JAX and load the model: ~15 s
def test_two_processes_score_their_rows_as_one_process(qwen2_rm, tmp_path):
    """Each host scores its own block of rows, with different counts of texts to score
    and different buckets, and gets the scores one process gives the whole batch; the
    running moments are the same on both hosts."""
    import os
    import pathlib
    import subprocess
    import sys

    from helpers_multihost_rewards import TEXTS

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_JAX_", "SLURM_"))}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags), PYTHONPATH=f"{root}:{root / 'tests'}")
    cmd = ["bash", str(root / "launch" / "local_multiprocess.sh"), "--timeout", "240"]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--devices-per-process", "2", "2", "--"]
    cmd += [sys.executable, str(root / "tests" / "helpers_multihost_rewards.py")]
    cmd += [str(tmp_path), str(qwen2_rm)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stderr}\n{logs}"

    one = LearnedReward.load(RewardModelSection(path=str(qwen2_rm), buckets=(16, 32)), None)
    want = one.score_tokens(one.token_lists(TEXTS))
    assert np.isnan(want[[1, 3]]).all() and np.isfinite(np.delete(want, [1, 3])).all()
    moments = RunningMoments()
    moments.add(want)
    got = [np.load(tmp_path / f"scores_{i}.npz") for i in (0, 1)]
    assert [tuple(g["rows"]) for g in got] == [(0, 6), (6, 12)]
    for g in got:
        a, b = g["rows"]
        np.testing.assert_allclose(g["raw"], want[a:b], atol=1e-5, equal_nan=True)
        np.testing.assert_allclose(
            g["moments"], [moments.count, moments.mean, moments.m2], rtol=1e-5
        )
        normalised = (want[a:b] - moments.mean) / (moments.std + 1e-6)
        np.testing.assert_allclose(g["values"], normalised, atol=1e-4, equal_nan=True)
