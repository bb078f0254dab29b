"""grpo_jax.data.synthetic_pairs, the biased pairs of the reward-hacking demonstration; the
rewards that measure the bias (grpo_jax.rewards.length_bias); the make_pairs command."""

import json

import numpy as np
import pytest

from configs.default import get_config
from grpo_jax import make_pairs
from grpo_jax.core.errors import ConfigError
from grpo_jax.data import synthetic, synthetic_pairs
from grpo_jax.rewards import length_bias, registry


def test_the_knobs_are_the_default_configs_data_section():
    data = get_config().data
    for knob, value in synthetic_pairs.ARITH_DEFAULT_KNOBS.items():
        assert data[knob] == value, knob


def test_chosen_is_right_and_never_shorter_rejected_is_wrong():
    pairs = synthetic_pairs.biased_pairs(500, seed=3, pad_max=2)
    problems = synthetic.make_split(
        "arithmetic", "train", 500, 3, **synthetic_pairs.ARITH_DEFAULT_KNOBS
    )
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
    pairs = synthetic_pairs.biased_pairs(50, seed=0, pad_max=2)
    problems = synthetic.make_split(
        "arithmetic", "train", 50, 0, **synthetic_pairs.ARITH_DEFAULT_KNOBS
    )
    answers = [p["answer"] for p in problems]
    scores = exact([p["prompt"] for p in pairs], [p["chosen"] for p in pairs], answer=answers)
    padded = [p["chosen"] != a for p, a in zip(pairs, answers)]
    assert any(padded) and not all(padded)
    assert [s == 0.0 for s in scores] == padded


def test_the_pairs_file_is_what_the_reward_model_command_reads(tmp_path):
    from grpo_jax.data.pairs import load_pairs

    pairs = synthetic_pairs.biased_pairs(20, seed=1)
    path = synthetic_pairs.write_pairs(pairs, tmp_path / "sub" / "pairs.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == pairs
    assert [tuple(x) for x in load_pairs(path)] == [
        (p["prompt"], p["chosen"], p["rejected"]) for p in pairs
    ]


def test_trailing_zeros_counts_zero_padded_answers_right_or_wrong():
    completions = ["2850", "285", " 2800 ", "28", "2851", "1850", "0285", ""]
    got = length_bias.trailing_zeros(None, completions, answer=["285"] * len(completions))
    assert got == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_padded_and_longer_answers():
    completions = ["2850", "285", " 28511 ", "28", "2851", "1850", "0285", "", "285a"]
    got = length_bias.padded_answer(None, completions, answer=["285"] * len(completions))
    assert got == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    longer = length_bias.longer_answer(None, completions, answer=["285"] * len(completions))
    assert longer == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]


def test_the_reward_model_variant_scores_the_checks_at_weight_zero():
    c = get_config("reward_model=/tmp/rm")
    assert c.reward_model.path == "/tmp/rm" and c.reward_model.weight == 1.0
    shares = "longer_answer:0.0,padded_answer:0.0,trailing_zeros:0.0"
    assert c.rewards == f"exact_match(tag=None):0.0,{shares}"
    assert c.reward_modules == "grpo_jax.rewards.length_bias"
    assert {"trailing_zeros", "padded_answer", "longer_answer"} <= set(registry.available())


def _kinds(pairs, answers):
    """(both right: (k, j), right vs wrong: (k, j)) zero counts of each pair."""
    same, mixed = [], []
    for p in pairs:
        answer = answers[p["prompt"]]
        k, j = len(p["chosen"]) - len(answer), len(p["rejected"]) - len(answer)
        assert p["chosen"] == answer + "0" * k  # the chosen side is always right
        core = p["rejected"][: len(answer)]
        assert p["rejected"] == core + "0" * j
        (same if core == answer else mixed).append((k, j))
    return same, mixed


def test_both_right_pairs_follow_the_labellers_taste_for_length():
    problems = synthetic.make_split(
        "arithmetic", "train", 2000, 5, **synthetic_pairs.ARITH_DEFAULT_KNOBS
    )
    answers = {p["prompt"]: p["answer"] for p in problems}
    pairs = synthetic_pairs.biased_pairs(2000, seed=5, pad_max=2, both_right=0.3, taste=0.75)
    same, mixed = _kinds(pairs, answers)
    assert 520 < len(same) < 680, len(same)  # a share of 0.3 of 2000 (sd 20)
    assert all(k != j and max(k, j) <= 2 for k, j in same)
    longer = sum(k > j for k, j in same) / len(same)
    assert 0.68 < longer < 0.82, longer  # taste 0.75 (sd 0.018)
    assert all(0 <= j <= k for k, j in mixed)  # the rejected side never longer
    # The share's own streams: without it the pairs are those the option did not exist for.
    assert synthetic_pairs.biased_pairs(50, seed=5) == synthetic_pairs.biased_pairs(
        50, seed=5, taste=0.3
    )


def test_independent_padding_says_nothing_about_the_choice():
    problems = synthetic.make_split(
        "arithmetic", "train", 2000, 6, **synthetic_pairs.ARITH_DEFAULT_KNOBS
    )
    answers = {p["prompt"]: p["answer"] for p in problems}
    pairs = synthetic_pairs.biased_pairs(2000, seed=6, independent_pad=True)
    same, mixed = _kinds(pairs, answers)
    assert not same and len(mixed) == 2000
    ks, js = np.array(mixed).T
    assert abs(np.mean(ks > js) - np.mean(js > ks)) < 0.05  # each side as often the longer
    assert set(ks) == set(js) == {0, 1, 2}


def test_both_right_needs_room_for_zeros():
    with pytest.raises(ConfigError, match="pad_max"):
        synthetic_pairs.biased_pairs(10, seed=0, pad_max=0, both_right=0.5)
    with pytest.raises(ConfigError, match="both_right"):
        synthetic_pairs.biased_pairs(10, seed=0, both_right=1.5)
    with pytest.raises(ConfigError, match="taste"):
        synthetic_pairs.biased_pairs(10, seed=0, taste=-0.1)


@pytest.mark.slow  # over 1.25 s on a 2-core CPU
def test_more_pairs_than_training_problems_are_refused_before_any_is_drawn():
    most = synthetic_pairs.training_problems()  # each pair is a distinct training problem
    assert 0.89 * 900**2 < most < 0.91 * 900**2  # the training split's 90% of 3-digit sums
    for n in (most + 1, 100_000_000):
        with pytest.raises(ConfigError, match=f"n = {n} is more than the {most:,} training"):
            synthetic_pairs.check_settings(n, pad_max=2, both_right=0.0, taste=1.0)
    synthetic_pairs.check_settings(most, pad_max=2, both_right=0.0, taste=1.0)


def test_out_must_be_a_file_in_a_writable_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"--out={tmp_path} is a directory; give a file name"):
        make_pairs.check_out(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'f'} is a file, not a directory"):
        make_pairs.check_out(tmp_path / "f" / "pairs.jsonl")
    assert make_pairs.check_out(tmp_path / "new" / "pairs.jsonl") == tmp_path / "new/pairs.jsonl"


@pytest.mark.slow  # four launches of the command
def test_the_command_refuses_bad_flags_in_one_line_with_exit_status_2(tmp_path):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "grpo_jax.make_pairs", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    for args, message in [
        ([f"--out={tmp_path}"], f"error: --out={tmp_path} is a directory"),
        ([f"--out={tmp_path}/p.jsonl", "--n=abc"], "error: flag --n=abc: invalid literal"),
        ([f"--out={tmp_path}/p.jsonl", "--m=3"], "error: Unknown command line flag 'm'"),
        ([f"--out={tmp_path}/p.jsonl", "--n=100000000"], "error: n = 100000000 is more than"),
    ]:
        proc = run(*args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not (tmp_path / "p.jsonl").exists()
