"""The golden step (tests/integration/test_golden_step.py) with train.packing = "on": the
tiny default's one step, packed, reports the padded step's metrics."""

import io
import json
import math

import pytest
from helpers_config import smoke_config
from test_golden_step import EXACT, GOLDEN, RUN


@pytest.mark.slow
@pytest.mark.parametrize("microbatch_tokens", [0, 32])
def test_the_packed_golden_step_matches_the_padded_metrics(tmp_path, microbatch_tokens):
    """One packed micro-batch per minibatch (0: the padded micro-batch's slots), and
    micro-batches of one packed row (32 slots: several, their count rounded up)."""
    from grpo_jax.run.train import train

    run = dict(RUN, **{"train.packing": "on", "train.microbatch_tokens": microbatch_tokens})
    train(smoke_config(**run), tmp_path, stream=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (got,) = [r for r in rows if "train/loss" in r]
    assert 0 < got["perf/pack_fill"] <= 1
    got = {k: v for k, v in got.items() if not k.startswith(("perf/", "eval/"))}
    assert sorted(got) == sorted(GOLDEN)
    for key, want in GOLDEN.items():
        if key.startswith(EXACT):
            assert got[key] == want, key
        else:
            assert math.isfinite(got[key]) and got[key] == pytest.approx(want, rel=1e-5), key


@pytest.mark.slow
def test_resume_after_kill_is_exact_with_packing(tmp_path):
    """tests/integration/test_train_loop.py's exact resume, packed in micro-batches of one
    row: the plan is a function of the batch alone, so the resumed run's records equal the
    whole run's, the packing's fill included."""
    from helpers_config import SHORT_RUN
    from helpers_resume import train_killed_at, without_timings

    from grpo_jax.run.train import train
    from grpo_jax.run.writers import read_metrics

    cfg = smoke_config(**SHORT_RUN, **{"train.packing": "on", "train.microbatch_tokens": 32})
    train(cfg, tmp_path / "whole", stream=io.StringIO())
    train_killed_at(cfg, tmp_path / "killed", 3, stream=io.StringIO())
    train(cfg, tmp_path / "killed", stream=io.StringIO())
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    packed = lambda rs: [
        (r["perf/pack_fill"], r["perf/pack_micro_batches"]) for r in rs if "train/loss" in r
    ]
    assert packed(resumed) == packed(whole) and len(packed(whole)) == 4
    summary = lambda d: json.loads((tmp_path / d / "summary.json").read_text())["after"]
    assert summary("killed") == summary("whole")


@pytest.mark.slow
def test_a_packed_lora_step_equals_the_padded(tmp_path):
    """LoRA (the reference is the base with the adapters off, scored packed under the base's
    graph) and longer packed rows (a whole group a row): the golden step's run, packed,
    reports the padded run's figures."""
    from grpo_jax.run.train import train

    lora = {"model.lora.rank": 2, "model.lora.alpha": 4.0}
    records = {}
    for name, extra in (
        ("padded", {}),
        ("packed", {"train.packing": "on", "train.pack_row_tokens": 160}),
    ):
        train(smoke_config(**RUN, **lora, **extra), tmp_path / name, stream=io.StringIO())
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        (records[name],) = [r for r in map(json.loads, rows) if "train/loss" in r]
    a, b = records["padded"], records["packed"]
    assert a["train/kl"] > 0 and a["policy/kl_old_new"] > 0  # the adapters moved
    for key in a:
        if key.startswith(("rollout/", "rewards/")):
            assert b[key] == a[key], key
        elif key.startswith(("train/", "policy/")):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
