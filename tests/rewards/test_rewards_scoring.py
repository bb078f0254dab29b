"""Weighted scoring, and rewards that raise, hang or misbehave: NaN, counted, run goes on."""

import logging
import math

import helpers_rewards  # registers the test_* rewards used below
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import rewards
from grpo_jax.objective.advantages import group_advantages
from grpo_jax.rewards import symbolic
from grpo_jax.rewards.scoring import RewardSpec, score
from grpo_jax.run.config import ConfigError


@pytest.fixture(scope="module", autouse=True)
def _release_hung_threads():
    yield
    helpers_rewards.RELEASE.set()


def _nan_at(arr):
    return [i for i, v in enumerate(arr) if math.isnan(v)]


def test_weighted_total_and_per_reward():
    completions = [
        "<think>w</think><answer>18</answer>",
        "18",
        "<think>w</think><answer>3</answer>",
    ]
    res = score(
        [
            RewardSpec("gsm8k", 1.0),
            RewardSpec("format", 0.25),
            RewardSpec("overlong(max_len=8, buffer=4)", 0.5),
        ],
        ["q"] * 3,
        completions,
        {"answer": ["18", "18", "18"]},
        completion_lengths=[2, 6, 9],
    )
    np.testing.assert_array_equal(res.per_reward["gsm8k"], [1, 1, 0])
    np.testing.assert_array_equal(res.per_reward["format"], [1, 0, 1])
    np.testing.assert_array_equal(res.per_reward["overlong(max_len=8, buffer=4)"], [0, -0.5, -1])
    np.testing.assert_allclose(res.total, [1.25, 0.75, -0.25])
    assert res.total.dtype == np.float32 and res.errors == {
        "gsm8k": 0,
        "format": 0,
        "overlong(max_len=8, buffer=4)": 0,
    }
    m = res.metrics()
    assert m["rewards/gsm8k/mean"] == pytest.approx(2 / 3)
    assert m["rewards/total/mean"] == pytest.approx(1.75 / 3)
    assert m["rewards/format/errors"] == 0.0


@pytest.mark.slow
def test_raising_reward_costs_only_its_completions(caplog):
    completions = ["ok", "boom", "fine", "boom!"]
    with caplog.at_level(logging.WARNING):
        res = score(
            [RewardSpec("test_raises_on_boom", 1.0), RewardSpec("exact_match(tag=None)", 1.0)],
            ["p"] * 4,
            completions,
            {"answer": ["ok", "x", "fine", "x"]},
            timeout_s=5.0,
        )
    assert _nan_at(res.per_reward["test_raises_on_boom"]) == [1, 3]
    assert res.errors == {"test_raises_on_boom": 2, "exact_match(tag=None)": 0}
    np.testing.assert_array_equal(res.total[[0, 2]], [2.0, 2.0])
    assert _nan_at(res.total) == [1, 3]
    assert res.metrics()["rewards/test_raises_on_boom/errors"] == 2.0
    assert "test_raises_on_boom" in caplog.text and "RuntimeError('boom')" in caplog.text


def test_always_raising_reward():
    res = score([RewardSpec("test_always_raises", 1.0)], ["p"] * 3, ["a", "b", "c"], {})
    assert _nan_at(res.total) == [0, 1, 2] and res.errors == {"test_always_raises": 3}
    assert math.isnan(res.metrics()["rewards/test_always_raises/mean"])


@pytest.mark.slow
def test_hanging_reward_times_out_per_completion():
    completions = ["a", "hang", "b", "c"]
    res = score(
        [RewardSpec("test_hangs_on_hang", 2.0), RewardSpec("format", 1.0)],
        ["p"] * 4,
        completions,
        {},
        timeout_s=0.3,
    )
    assert _nan_at(res.per_reward["test_hangs_on_hang"]) == [1]
    np.testing.assert_array_equal(res.per_reward["test_hangs_on_hang"][[0, 2, 3]], [0.5] * 3)
    assert res.errors["test_hangs_on_hang"] == 1 and res.errors["format"] == 0
    assert _nan_at(res.total) == [1]


def test_wrong_number_of_values_is_all_nan_and_named(caplog):
    with caplog.at_level(logging.WARNING):
        res = score([RewardSpec("test_wrong_length", 1.0)], ["p"] * 2, ["a", "b"], {})
    assert _nan_at(res.total) == [0, 1] and res.errors == {"test_wrong_length": 2}
    assert "reward 'test_wrong_length' returned 3 values for 2 completions" in caplog.text


def test_none_is_unscored_but_malformed_is_an_error():
    res = score([RewardSpec("test_mixed_values", 1.0)], ["p"] * 5, list("abcde"), {})
    v = res.per_reward["test_mixed_values"]
    assert v[0] == 1.0 and v[4] == 0.5 and _nan_at(v) == [1, 2, 3]
    assert res.errors == {"test_mixed_values": 1}  # only "abc" is malformed


def test_nan_rewards_reach_advantage_zero():
    """Through grpo_jax.objective.advantages: unscored completions get A = 0 and leave the stats."""
    res = score(
        [RewardSpec("test_raises_on_boom", 1.0), RewardSpec("exact_match(tag=None)", 1.0)],
        ["p"] * 8,
        ["a", "boom", "b", "a", "x", "y", "boom", "x"],
        {"answer": ["a"] * 4 + ["x"] * 4},
    )
    rewards_BxG = jnp.asarray(res.total).reshape(2, 4)
    adv = np.asarray(group_advantages(rewards_BxG, eps=1e-4))
    assert adv[0, 1] == 0.0 and adv[1, 2] == 0.0
    # Group 0 finite rewards [2, 1, 2]: mean 5/3, population std sqrt(2)/3.
    std = math.sqrt(2) / 3
    np.testing.assert_allclose(
        adv[0, [0, 2, 3]],
        [(1 / 3) / (std + 1e-4), (-2 / 3) / (std + 1e-4), (1 / 3) / (std + 1e-4)],
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        adv[1, [0, 1, 3]],
        [(2 - 5 / 3) / (std + 1e-4), (1 - 5 / 3) / (std + 1e-4), (2 - 5 / 3) / (std + 1e-4)],
        rtol=1e-5,
    )


def test_score_input_errors():
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        score([RewardSpec("format", 1.0), RewardSpec("nope", 1.0)], ["p"], ["c"], {})
    with pytest.raises(ConfigError, match=r"reward\(s\) \['format'\] listed more than once"):
        score([RewardSpec("format", 1.0), RewardSpec("format", 2.0)], ["p"], ["c"], {})
    with pytest.raises(ValueError, match="reward field 'answer' has 1 values for 2 completions"):
        score([RewardSpec("gsm8k", 1.0)], ["p", "p"], ["c", "d"], {"answer": ["1"]})
    with pytest.raises(ValueError, match="1 prompts for 2 completions"):
        score([RewardSpec("gsm8k", 1.0)], ["p"], ["c", "d"], {"answer": ["1", "2"]})
    with pytest.raises(ConfigError, match="weight nan must be a finite number"):
        RewardSpec("gsm8k", float("nan"))
    with pytest.raises(ConfigError, match="no rewards given"):
        score([], ["p"], ["c"], {})


def test_fields_from_examples_layout():
    batch = [{"prompt": "a", "answer": "1", "numbers": [1]}, {"prompt": "b", "answer": "2"}]
    f = rewards.fields_from_examples(batch, repeat=2)
    assert f == {"answer": ["1", "1", "2", "2"], "numbers": [[1], [1], None, None]}


def test_math_verify_equivalences():
    completions = [
        "<answer>\\frac{1}{2}</answer>",
        "so the answer is $\\boxed{0.5}$",
        "<answer>$(x+1)^2$</answer>",
        "<answer>3</answer>",
        "nothing",
    ]
    answers = ["0.5", "\\frac12", "$x^2+2x+1$", "4", "7"]
    res = score([RewardSpec("math_verify", 1.0)], [""] * 5, completions, {"answer": answers})
    np.testing.assert_array_equal(res.total, [1, 1, 1, 0, 0])
    assert res.errors == {"math_verify": 0}


@pytest.mark.slow
def test_math_verify_hang_kills_worker_and_recovers():
    worker = symbolic.MathVerifyProcess()
    try:
        assert worker.check("2", "$2$", timeout_s=1) == 1.0
        pid = worker._proc.pid
        got = worker.check("2", "2", timeout_s=1, deadline_s=1.0, _sleep=60)
        assert isinstance(got, TimeoutError) and "worker restarted" in str(got)
        assert worker._proc is None and worker.restarts == 1
        assert worker.check("1/2", "0.5", timeout_s=1) == 1.0  # a fresh child
        assert worker._proc.pid != pid
    finally:
        worker.close()


def test_math_verify_failures_are_counted(monkeypatch):
    class Flaky:
        def check(self, gold, pred, *, timeout_s):
            return TimeoutError("stuck") if "stuck" in pred else 1.0

    monkeypatch.setattr(symbolic, "shared_process", lambda: Flaky())
    res = score(
        [RewardSpec("math_verify", 1.0)], [""] * 3, ["1", "stuck", "1"], {"answer": ["1"] * 3}
    )
    assert _nan_at(res.total) == [1] and res.errors == {"math_verify": 1}


def test_scorer_passes_token_lengths_to_training_and_evaluation_scoring():
    from grpo_jax.rollout.scorer import Scorer

    @rewards.register("test_short_is_correct", override=True)
    def short(prompts, completions, *, completion_lengths, **_):
        return [1.0 if n <= 4 else 0.0 for n in completion_lengths]

    spec = RewardSpec("test_short_is_correct", 1.0)
    scorer = Scorer((spec,), correct_reward="test_short_is_correct", timeout_s=10.0)
    examples = [{"prompt": "q", "answer": "1"}]
    texts, lengths = ["a", "b"], np.array([3, 7])
    result, correct, _ = scorer.score(["q", "q"], texts, examples, repeat=2, lengths_N=lengths)
    np.testing.assert_allclose(result.total, [1.0, 0.0])
    assert correct.tolist() == [True, False]
    # Evaluation's correctness gets the same token lengths.
    assert scorer.correct(texts, examples, repeat=2, lengths_N=lengths).tolist() == [True, False]
    # Without them the reward cannot score: NaN, counted as not correct, never a crash.
    assert scorer.correct(texts, examples, repeat=2).tolist() == [False, False]


def test_weight_zero_reward_that_fails_leaves_total_finite_and_is_counted():
    # A weight-0 reward is scored (for logging or correctness) but is no part of
    # sum_k w_k r_k: its NaN on a failed row must not make that row's total NaN.
    completions = ["ok", "boom", "fine"]
    res = score(
        [RewardSpec("exact_match(tag=None)", 0.5), RewardSpec("test_raises_on_boom", 0.0)],
        ["p"] * 3,
        completions,
        {"answer": ["ok", "boom", "x"]},
        timeout_s=5.0,
    )
    assert _nan_at(res.per_reward["test_raises_on_boom"]) == [1]
    assert res.errors == {"exact_match(tag=None)": 0, "test_raises_on_boom": 1}
    np.testing.assert_array_equal(
        res.total, np.float32(0.5) * res.per_reward["exact_match(tag=None)"]
    )
    np.testing.assert_array_equal(res.total, [0.5, 0.5, 0.0])
    assert res.total.dtype == np.float32
    m = res.metrics()
    assert m["rewards/test_raises_on_boom/errors"] == 1.0
    assert m["rewards/total/unscored_frac"] == 0.0
    # A reward of non-zero weight that fails still makes the total NaN there.
    res = score(
        [RewardSpec("exact_match(tag=None)", 0.5), RewardSpec("test_raises_on_boom", 1e-3)],
        ["p"] * 3,
        completions,
        {"answer": ["ok", "boom", "x"]},
        timeout_s=5.0,
    )
    assert _nan_at(res.total) == [1]


def test_scorer_correctness_reward_outside_the_specs_that_fails_leaves_total_finite():
    from grpo_jax.rollout.scorer import Scorer

    @rewards.register("test_correct_raises_on_boom", override=True)
    def correct_or_boom(prompts, completions, *, answer, **_):
        if any("boom" in c for c in completions):
            raise RuntimeError("boom")
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    scorer = Scorer(
        (RewardSpec("exact_match(tag=None)", 1.0),),
        correct_reward="test_correct_raises_on_boom",
        timeout_s=5.0,
    )
    examples = [{"prompt": "q", "answer": "boom"}, {"prompt": "r", "answer": "7"}]
    texts = ["boom", "x", "7", "8"]
    result, correct, _ = scorer.score(["q", "q", "r", "r"], texts, examples, repeat=2)
    np.testing.assert_array_equal(result.total, [1.0, 0.0, 1.0, 0.0])
    assert correct.tolist() == [False, False, True, False]
    # Its failure is counted and logged under its own name, though it is no training reward.
    assert result.errors == {"exact_match(tag=None)": 0, "test_correct_raises_on_boom": 1}
    assert scorer.display["test_correct_raises_on_boom"] == "test_correct_raises_on_boom"
