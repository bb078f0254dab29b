"""A multi-turn run through the trainer: configs/multiturn.py runs, and resumes exactly."""

import importlib.util
import json
import pathlib

import jax
import numpy as np
import pytest
from helpers_config import apply_overrides
from helpers_resume import train_killed_at, without_timings

from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(**overrides):
    spec = importlib.util.spec_from_file_location("mt_cfg", ROOT / "configs" / "multiturn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = {
        "train.steps": 4,
        "eval.every": 0,
        "eval.num_samples": 0,
        "checkpoint.every": 2,
        "checkpoint.async_save": False,
    }
    return apply_overrides(mod.get_config("runlocal"), {**run, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1], ids=lambda k: f"max_staleness={k}")
def test_multiturn_run_resumes_exactly(tmp_path, k):
    """On-policy (k = 0), and with each step's episodes played one update ahead (k = 1: the
    checkpoint of step 2 holds step 3's batch, played by version 1)."""
    cfg = _config(**{"train.max_staleness": k})
    whole = train(cfg, tmp_path / "whole")
    records = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for r in records[1:]:
        assert r["env/turns_mean"] >= 1 and r["env/errors"] == 0
    assert "pass_at_1" in whole["after"] and "turns_mean" in whole["after"]
    samples = (tmp_path / "whole" / "samples" / "step_0000002.txt").read_text()
    assert "guess 0-9:" in samples

    # Between the checkpoints at 2 and 4: step 3 is lost.
    train_killed_at(cfg, tmp_path / "killed", 3)
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    try:
        inflight = [(x["step"], x["version"]) for x in ck.restore_meta(2).get("inflight") or []]
    finally:
        ck.close()
    assert inflight == ([(3, 1)] if k else [])
    train(cfg, tmp_path / "killed")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert without_timings(resumed) == without_timings(records)
    staleness = [None, 0.0, 1.0, 1.0, 1.0] if k else [None] * 5
    assert [r.get("pipeline/staleness") for r in resumed] == staleness

    from grpo_jax.run import builders
    from grpo_jax.run import config as config_lib

    run = config_lib.parse_config(cfg)
    tok = builders.build_tokenizer(run, tmp_path / "whole")
    like = builders.build_model(run, tok, builders.build_mesh(run))[1]

    def params(wd):
        ck = Checkpointer(wd / "checkpoints")
        try:
            return ck.restore_params(params_like=like), ck.latest_step()
        finally:
            ck.close()

    (a, sa), (b, sb) = params(tmp_path / "whole"), params(tmp_path / "killed")
    assert sa == sb == 4
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (
        json.loads((tmp_path / "killed" / "summary.json").read_text())["after"]
        == json.loads((tmp_path / "whole" / "summary.json").read_text())["after"]
    )


@pytest.mark.slow
def test_a_multiturn_run_on_the_paged_engine_trains_on_its_own_log_probs(tmp_path):
    """configs/multiturn.py with sampling.engine = "paged": the episodes play on the paged
    pool (grpo_jax/sampling/paged_turns.py), the first update's ratio is 1 (the trainer rescores the
    engine's transcripts with the parameters that played them), and evaluation, on the
    static kernel, gives what the static run's gives before training."""
    paged = _config(**{"train.steps": 2, "checkpoint.every": 0, "sampling.engine": "paged",
                       "sampling.page_size": 8})  # fmt: skip
    static = _config(**{"train.steps": 1, "checkpoint.every": 0})
    got = train(paged, tmp_path / "paged")
    want = train(static, tmp_path / "static")
    records = read_metrics(tmp_path / "paged" / "metrics.jsonl")
    first = records[1]
    assert abs(first["train/ratio_max"] - 1.0) < 1e-4 and abs(first["train/ratio_min"] - 1.0) < 1e-4
    assert first["env/turns_mean"] > 1 and first["env/errors"] == 0
    assert got["before"] == want["before"]
