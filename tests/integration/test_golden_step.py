"""A golden one-step regression: every metric of one GRPO step of the tiny default.

The tiny default (``configs/default.py:smoke``) with a fixed seed, no warm start,
a reward with variance on an untrained model's completions (the over-length
penalty), beta > 0 (the reference pass), mu = 2 passes over two minibatches and a
large learning rate so that the ratios move and both clip sides bind. The numbers
below were produced by the trainer before it was split into setup / collect /
update / report, and the split reproduced them bit for bit; they change only
when a change means to change what one step computes (then update them and say
why in the commit). Since then: the correctness reward is logged under its own
name, and every step logs the unscored and clipped counts of each reward; the token
means (clip fractions, entropy, KL, ratio mean) weigh the four updates by their tokens
instead of equally (the clip fractions are now exact counts over the 2 x 219 tokens).
"""

import json
import math

import pytest
from helpers_config import smoke_config

GOLDEN = {
    # lr 0.01 moves the policy far enough in one step to raise this health alarm.
    "alarms/clip_frac_spike": 1.0,
    # No top-k / top-p / min-p: the sampled distribution is pi_old itself, exactly.
    "behavior/abs_log_diff_max": 0.0,
    "behavior/abs_log_diff_mean": 0.0,
    "policy/abs_log_ratio_mean": 0.34278807044029236,
    "policy/kl_old_new": 0.07935584336519241,
    "policy/ratio_max": 2.639235496520996,
    "policy/ratio_min": 0.4581854045391083,
    "rewards/mean": -0.8458333369344473,
    "rewards/overlong/clipped": 0.0,
    "rewards/overlong/errors": 0.0,
    "rewards/overlong/mean": -0.8458333369344473,
    "rewards/overlong/std": 0.2745893343581365,
    "rewards/overlong/unscored_frac": 0.0,
    "rewards/overlong[correct]/clipped": 0.0,
    "rewards/overlong[correct]/errors": 0.0,
    "rewards/overlong[correct]/mean": 0.0,
    "rewards/overlong[correct]/std": 0.0,
    "rewards/overlong[correct]/unscored_frac": 0.0,
    "rewards/std": 0.2745893343581365,
    "rewards/unscored_frac": 0.0,
    "rollout/duplicate_frac": 0.0,
    "rollout/frac_zero_var_groups": 0.25,
    "rollout/group_reward_var": 0.059097219647632745,
    "rollout/invalid_format_frac": 0.3125,
    "rollout/length_max": 16.0,
    "rollout/length_mean": 13.6875,
    "rollout/pass_rate": 0.0,
    "rollout/sampled_tokens_total": 219.0,  # 16 rows x length_mean 13.6875
    "rollout/truncated_frac": 0.75,
    "step": 1,
    "train/clip_frac_high": 0.052511416375637054,  # 23 of 2 x 219 tokens
    "train/clip_frac_low": 0.2054794579744339,  # 90 of 2 x 219 tokens
    "train/entropy": 4.590114593505859,
    "train/epoch": 0.0,
    "train/grad_norm": 0.6650742292404175,
    "train/kl": 0.02424202859401703,
    "train/loss": -0.059593115001916885,
    "train/lr": 0.009999999776482582,
    "train/ratio_max": 2.336198568344116,
    "train/ratio_mean": 0.957433819770813,
    "train/ratio_min": 0.555741548538208,
    "train/skipped_in_row": 0.0,
    "train/skipped_total": 0.0,
    "train/skipped_updates": 0.0,
    "train/updates": 4.0,
}
# Counts, rewards and rollout statistics are exact; float32 training metrics may
# differ in the last bits on another CPU.
EXACT = ("rollout/", "rewards/", "train/updates", "train/skipped", "train/epoch", "step")


RUN = {
    "warm_start.enabled": False,
    "eval.at_start": False,
    "eval.every": 0,
    "train.steps": 1,
    "rewards": "overlong(max_len=16,buffer=15):1.0",
    "correct_reward": "overlong",
    "sampling.max_new_tokens": 16,
    "grpo.beta": 0.04,
    "grpo.mu": 2,
    "train.minibatch_size": 8,
    "optim.learning_rate": 0.01,
    "optim.warmup_steps": 0,
    "checkpoint.every": 0,
}


@pytest.mark.slow
def test_one_step_of_the_tiny_default_matches_its_golden_metrics(tmp_path):
    import io

    from grpo_jax.run.train import train

    train(smoke_config(**RUN), tmp_path, stream=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (got,) = [r for r in rows if "train/loss" in r]
    got = {k: v for k, v in got.items() if not k.startswith(("perf/", "eval/"))}
    assert sorted(got) == sorted(GOLDEN)
    # What makes the golden values a meaningful check: both clip sides bind, the
    # policy moved, the KL term is live, and some groups have reward variance.
    assert GOLDEN["train/clip_frac_low"] > 0 and GOLDEN["train/clip_frac_high"] > 0
    assert GOLDEN["train/kl"] > 0 and 0 < GOLDEN["rollout/frac_zero_var_groups"] < 1
    for key, want in GOLDEN.items():
        if key.startswith(EXACT):
            assert got[key] == want, key
        else:
            assert math.isfinite(got[key]) and got[key] == pytest.approx(want, rel=1e-5), key
