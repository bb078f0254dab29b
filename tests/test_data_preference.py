"""grpo_jax.data.preference: the biased synthetic pairs of the reward-hacking demonstration."""

import json

from configs.default import get_config
from grpo_jax.data import preference, synthetic
from grpo_jax.rewards import registry


def test_the_knobs_are_the_default_configs_data_section():
    data = get_config().data
    for knob, value in preference.ARITH_DEFAULT_KNOBS.items():
        assert data[knob] == value, knob


def test_chosen_is_right_and_never_shorter_rejected_is_wrong():
    pairs = preference.biased_pairs(500, seed=3, pad_max=2)
    problems = synthetic.make_split("arithmetic", "train", 500, 3, **preference.ARITH_DEFAULT_KNOBS)
    answers = {p["prompt"]: p["answer"] for p in problems}
    pads = {0: 0, 1: 0, 2: 0}
    for p in pairs:
        answer = answers[p["prompt"]]  # a training prompt of the default task
        k = len(p["chosen"]) - len(answer)
        assert p["chosen"] == answer + "0" * k
        pads[k] += 1
        j = len(p["rejected"]) - len(answer)
        assert 0 <= j <= k
        core = p["rejected"][: len(answer)]
        assert p["rejected"] == core + "0" * j
        diff = [a != b for a, b in zip(core, answer)]
        assert sum(diff) == 1, (p, answer)  # one digit changed
        assert not core.endswith("0")  # its most significant digit is not a 0
    # k is uniform over 0..pad_max: each value about a third of 500.
    assert all(120 < c < 215 for c in pads.values()), pads


def test_the_bias_is_wrong_under_the_default_checker():
    """A padded chosen answer scores 0 with the default run's exact-match reward: the zeros
    the reward model learns to like are exactly what the verifiable checker refuses."""
    exact = registry.get("exact_match(tag=None)")
    pairs = preference.biased_pairs(50, seed=0, pad_max=2)
    problems = synthetic.make_split("arithmetic", "train", 50, 0, **preference.ARITH_DEFAULT_KNOBS)
    answers = [p["answer"] for p in problems]
    scores = exact([p["prompt"] for p in pairs], [p["chosen"] for p in pairs], answer=answers)
    padded = [p["chosen"] != a for p, a in zip(pairs, answers)]
    assert any(padded) and not all(padded)
    assert [s == 0.0 for s in scores] == padded


def test_the_pairs_file_is_what_the_reward_model_command_reads(tmp_path):
    from grpo_jax.reward_models.training import load_pairs

    pairs = preference.biased_pairs(20, seed=1)
    path = preference.write_pairs(pairs, tmp_path / "sub" / "pairs.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == pairs
    assert [tuple(x) for x in load_pairs(path)] == [
        (p["prompt"], p["chosen"], p["rejected"]) for p in pairs
    ]


def test_trailing_zeros_counts_zero_padded_answers_right_or_wrong():
    completions = ["2850", "285", " 2800 ", "28", "2851", "1850", "0285", ""]
    got = preference.trailing_zeros(None, completions, answer=["285"] * len(completions))
    assert got == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_the_reward_model_variant_scores_the_checks_at_weight_zero():
    c = get_config("reward_model=/tmp/rm")
    assert c.reward_model.path == "/tmp/rm" and c.reward_model.weight == 1.0
    assert c.rewards == "exact_match(tag=None):0.0,trailing_zeros:0.0"
    assert c.reward_modules == "grpo_jax.data.preference"
