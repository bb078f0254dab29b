"""DAPO dynamic sampling: the signal test, group selection, the loop, exact resume, the budget."""

import io
import json

import jax
import numpy as np
import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_resume import train_killed_at, without_timings

from grpo_jax.rollout import rounds as rollout
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.writers import read_metrics

# ---------------------------------------------------------------------------
# Which groups carry signal.


def test_group_has_signal_is_an_exact_test_on_the_rewards():
    assert not rollout.group_has_signal(np.array([1.0, 1.0, 1.0, 1.0]))
    assert rollout.group_has_signal(np.array([1.0, 1.0, 0.0, 1.0]))
    # Equal rewards whose normalisation leaves float noise: a std threshold would
    # have to guess a tolerance; the exact comparison needs none.
    same = np.full(3, 0.1)
    assert np.std(same) > 0  # 1.4e-17: numpy's mean of three 0.1s is not 0.1
    assert not rollout.group_has_signal(same)
    tiny = np.array([0.3, 0.3 + 2**-52 * 0.3])  # one ulp apart: a real (tiny) difference
    assert rollout.group_has_signal(tiny)
    # Unscored (NaN) rewards are left out, as the advantages leave them out.
    assert not rollout.group_has_signal(np.array([np.nan, 1.0, 1.0]))
    assert rollout.group_has_signal(np.array([np.nan, 0.0, 1.0]))
    assert not rollout.group_has_signal(np.array([np.nan, np.nan]))
    assert not rollout.group_has_signal(np.array([np.nan, 2.0]))


def test_select_groups_keeps_the_first_with_signal_and_pads_with_the_rest():
    sig, flat = [0.0, 1.0], [1.0, 1.0]
    r0 = np.array([flat, sig, flat])  # round 0: group 1 has signal
    r1 = np.array([sig, sig, flat])  # round 1: groups 0 and 1
    kept, fillers = rollout.select_groups([r0, r1], 3)
    assert kept == [(0, 1), (1, 0), (1, 1)] and fillers == []
    kept, fillers = rollout.select_groups([r0, r1], 2)  # surplus signal is not used
    assert kept == [(0, 1), (1, 0)] and fillers == []
    kept, fillers = rollout.select_groups([r0], 3)  # short: padded with groups without signal
    assert kept == [(0, 1)] and fillers == [(0, 0), (0, 2)]


# ---------------------------------------------------------------------------
# The loop.


DYNAMIC = {
    **SHORT_RUN,
    # Length-dependent rewards: an untrained model gives some groups variance, not all.
    "rewards": "overlong(max_len=16,buffer=15):1.0",
    "correct_reward": "overlong",
    "sampling.max_new_tokens": 16,
    "train.dynamic_sampling": True,
    "train.max_sampling_rounds": 3,
}


def _spied_run(workdir, monkeypatch, **updates):
    """Trains ``DYNAMIC`` with ``updates``, recording what each step's collect_dynamic
    returned."""
    from grpo_jax.run.train import train

    batches = []
    real = rollout.collect_dynamic

    def spy(r, params, draw, key, **kw):
        batch, host = real(r, params, draw, key, **kw)
        batches.append(
            (
                np.asarray(jax.device_get(batch.rewards_N)),
                np.asarray(jax.device_get(batch.weights_N)),
                np.asarray(jax.device_get(batch.advantages_N)),
                host.metrics,
                draw.__self__.state_dict()["position"],  # draw: the data iterator's next
            )
        )
        return batch, host

    monkeypatch.setattr(rollout, "collect_dynamic", spy)
    train(smoke_config(**{**DYNAMIC, **updates}), workdir, stream=io.StringIO())
    monkeypatch.undo()
    return batches


def _check_batches(batches, max_rounds):
    """Every step's invariants; -> (steps that padded, steps that filled B in > 1 round)."""
    G, B = 4, 4  # the smoke config's
    drawn = padded = refilled = 0
    for rewards_N, weights_N, adv_N, m, position in batches:
        r_BxG, w_BxG = rewards_N.reshape(B, G), weights_N.reshape(B, G)
        assert np.all(w_BxG == w_BxG[:, :1])  # weights are per group
        for r_G, w in zip(r_BxG, w_BxG[:, 0], strict=True):
            assert rollout.group_has_signal(r_G) == (w == 1.0), (r_G, w)
        kept = int(w_BxG[:, 0].sum())
        assert m["dynamic/groups_kept"] == kept and m["dynamic/groups_padded"] == B - kept
        assert np.all(adv_N.reshape(B, G)[kept:] == 0)  # fillers: no advantage either
        assert m["dynamic/groups_drawn"] == m["dynamic/rounds"] * B
        assert (
            m["dynamic/groups_dropped"] + m["dynamic/groups_with_signal"]
            == m["dynamic/groups_drawn"]
        )
        # Fewer than B kept only when every round was spent.
        assert kept == B or m["dynamic/rounds"] == max_rounds
        padded += kept < B
        refilled += kept == B and m["dynamic/rounds"] > 1
        drawn += int(m["dynamic/rounds"]) * B
        assert position == drawn  # one epoch is 200 prompts: no rollover yet
    return padded, refilled


@pytest.mark.slow
def test_kept_groups_have_signal_and_the_iterator_advances_by_what_was_drawn(tmp_path, monkeypatch):
    # Up to 3 rounds: steps that fill the batch in a second round.
    batches = _spied_run(tmp_path / "three", monkeypatch)
    assert len(batches) == 4
    padded, refilled = _check_batches(batches, max_rounds=3)
    assert refilled > 0
    records = read_metrics(tmp_path / "three" / "metrics.jsonl")
    sampled = [r["dynamic/sampled_tokens"] for r in records if "dynamic/sampled_tokens" in r]
    total = [r["rollout/sampled_tokens_total"] for r in records if "dynamic/rounds" in r]
    assert total == list(np.cumsum(sampled))
    # One round: steps whose flat groups are padded at weight 0.
    batches = _spied_run(
        tmp_path / "one", monkeypatch, **{"train.max_sampling_rounds": 1, "train.steps": 2}
    )
    padded, _ = _check_batches(batches, max_rounds=1)
    assert padded > 0


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1], ids=lambda k: f"max_staleness={k}")
def test_resume_after_a_kill_equals_the_uninterrupted_run(tmp_path, builtin_tokenizer, k):
    """On-policy (k = 0) and with the batch of each step sampled one update ahead (k = 1:
    the checkpoint of step 2 holds step 3's batch, sampled by version 1)."""
    from test_train_loop import _final_params

    from grpo_jax.run import builders
    from grpo_jax.run import config as config_lib
    from grpo_jax.run.train import train

    cfg = smoke_config(**{**DYNAMIC, "train.max_staleness": k})
    train(cfg, tmp_path / "whole", stream=io.StringIO())

    # After the checkpoint at 2: step 3 is lost and redrawn.
    train_killed_at(cfg, tmp_path / "killed", 3, stream=io.StringIO())
    train(cfg, tmp_path / "killed", stream=io.StringIO())
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    assert sum(r.get("dynamic/rounds", 0) for r in whole) > 4  # more than one round was drawn
    staleness = [None, 0.0, 1.0, 1.0, 1.0] if k else [None] * 5
    assert [r.get("pipeline/staleness") for r in resumed] == staleness
    run = config_lib.parse_config(cfg)
    like = builders.build_model(run, builtin_tokenizer, builders.build_mesh(run))[1]
    a, sa = _final_params(tmp_path / "whole", like)
    b, sb = _final_params(tmp_path / "killed", like)
    assert sa == sb == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    try:
        meta = ck.restore_meta(4)
        at_2 = ck.restore_meta(2)
    finally:
        ck.close()
    assert meta["schedule"]["sampled_tokens"] == whole[-1]["rollout/sampled_tokens_total"]
    inflight = [(x["step"], x["version"]) for x in at_2.get("inflight") or []]
    assert inflight == ([(3, 1)] if k else [])


@pytest.mark.slow
def test_the_sampled_tokens_budget_stops_the_run(tmp_path):
    from grpo_jax.run.train import train

    out = io.StringIO()
    summary = train(
        smoke_config(**{**DYNAMIC, "train.sampled_tokens_budget": 1000, "train.steps": 50}),
        tmp_path,
        stream=out,
    )
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "dynamic/rounds" in r]
    totals = [r["rollout/sampled_tokens_total"] for r in records]
    # It stops after the first step that reaches the budget, and not before.
    assert totals[-1] >= 1000 and all(t < 1000 for t in totals[:-1])
    assert summary["steps"] == len(records) < 50
    # ... and says so, with the figures, on the console and in summary.json.
    said = [line for line in out.getvalue().splitlines() if line.startswith("stopping")]
    assert said == [
        f"stopping after step {len(records)} of 50: train.sampled_tokens_budget is spent "
        f"({int(totals[-1])} completion tokens sampled, budget 1000)"
    ]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == len(records)
    assert on_disk["ended_by"] == "train.sampled_tokens_budget"
    assert on_disk["sampled_tokens"] == totals[-1]


@pytest.mark.slow
def test_a_step_without_signal_raises_no_entropy_alarm(tmp_path):
    # A constant reward and one round: every group is a weight-0 filler, the update sees no
    # token, and its entropy is no value (null), not 0 (which set off entropy_collapse).
    from grpo_jax.run.train import train

    c = smoke_config(**{**DYNAMIC, "train.max_sampling_rounds": 1, "train.steps": 2})
    c.rewards = "overlong(max_len=64,buffer=1):1.0"  # 0 for every completion of <= 16 tokens
    c.checkpoint.every = 0
    c.health.entropy_window = 1
    train(c, tmp_path, stream=io.StringIO())
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["dynamic/groups_kept"] for r in records] == [0.0, 0.0]
    assert all(r["train/entropy"] is None for r in records)
    assert not any("alarms/entropy_collapse" in r for r in records)
