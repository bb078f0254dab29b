"""Routing replay in a run: the CPU default's ``smoke,moe`` variant (4 experts, top 2) with
``grpo.router_replay = "rollout"`` and one step of staleness, so that each checkpoint holds a
batch in flight with its recorded routes. Killed after step 3 and resumed from step 2's
checkpoint, it logs what the uninterrupted run logs (docs/moe.md). And a multi-turn run of
configs/multiturn.py's with that mixture and replay on."""

import importlib.util
import math
import pathlib

import numpy as np
import pytest
from helpers_config import SHORT_RUN, apply_overrides
from helpers_resume import train_killed_at, without_timings

from configs.default import get_config
from grpo_jax.rollout import episodes
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

MOE_KEYS = (
    "moe/route_flip_frac",
    "moe/route_flip_layer_frac",
    "moe/abs_log_ratio_unreplayed",
    "moe/expert_load_imbalance",
    "moe/first_ratio_dev",
)


def _config():
    overrides = {**SHORT_RUN, "grpo.router_replay": "rollout", "train.max_staleness": 1}
    return apply_overrides(get_config("smoke,moe"), overrides)


@pytest.mark.slow
def test_kill_and_resume_with_routing_replay_equals_the_uninterrupted_run(tmp_path):
    cfg = _config()
    train(cfg, tmp_path / "whole")
    train_killed_at(cfg, tmp_path / "killed", 3)
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    assert ck.all_steps() == [2]
    meta = ck.restore_meta(2)
    ck.close()
    (inflight,) = meta["inflight"]  # step 3's batch, its routes [N, P + T, R, K] in int8
    shape, dtype = inflight["shapes"]["routes_NxSxRxK"]
    assert dtype == "int8" and shape[2:] == [1, 2]  # one sparse layer, top 2
    train(cfg, tmp_path / "killed")
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    for r in whole[1:]:
        assert all(math.isfinite(r[k]) for k in MOE_KEYS), r
        assert r["moe/expert_load_imbalance"] >= 1.0


@pytest.mark.slow
def test_kill_and_resume_with_routing_replay_and_partial_rollouts(tmp_path):
    """Partial rollouts on the paged engine with replay: carried rows keep their routes in
    the checkpoint (the groups in flight), and the run killed after step 3 and resumed from
    step 2 logs what the uninterrupted run logs."""
    partial = {"sampling.engine": "paged", "sampling.partial_rollouts": True}
    partial.update({"sampling.page_size": 4, "sampling.prefill_chunk": 8})
    cfg = apply_overrides(_config(), partial)
    train(cfg, tmp_path / "whole")
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert sum(r["partial/carried_rows"] for r in whole[1:]) > 0  # rows did carry over
    train_killed_at(cfg, tmp_path / "killed", 3)
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    assert ck.all_steps() == [2]
    shape, dtype = ck.restore_meta(2)["inflight"]["partial"]["shapes"]["routes_NxSxRxK"]
    ck.close()
    assert dtype == "int8" and shape[3:] == [1, 2]  # [groups, G, W + T, R, K]
    train(cfg, tmp_path / "killed")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    for r in whole[1:]:
        assert all(math.isfinite(r[k]) for k in MOE_KEYS), r


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        # A reward that varies within groups, so that some are kept and have tokens.
        {
            "train.dynamic_sampling": True,
            "train.max_staleness": 0,
            "rewards": "exact_match(tag=None):1.0,format(pattern='.*[0-4].*'):0.5",
        },
        {"mesh.sampler_devices": 4, "mesh.num_devices": 8},
        {"sampling.engine": "paged"},
        {"sampling.engine": "paged", "sampling.partial_rollouts": True},
    ],
    ids=["dynamic_sampling", "sampler_mesh", "paged_engine", "partial_rollouts"],
)
def test_routes_travel_with_dynamic_sampling_and_from_a_sampler_mesh(tmp_path, overrides):
    """Dynamic sampling's rounds (prompts of several widths, gathered into one batch), a
    sampler mesh of its own (the batch copied to the learner's), the paged engine and its
    partial rollouts (rows carried between runs) carry the routes too: the replayed first
    update's ratio stays within rounding of 1 with pi_old rescored."""
    cfg = apply_overrides(_config(), {"train.steps": 2, "grpo.old_logps": "recompute", **overrides})
    train(cfg, tmp_path)
    for r in read_metrics(tmp_path / "metrics.jsonl")[1:]:
        assert all(math.isfinite(r[k]) for k in MOE_KEYS), r
        assert r["moe/first_ratio_dev"] <= 1e-5


def _multiturn_config(overrides):
    path = pathlib.Path(__file__).resolve().parents[2] / "configs" / "multiturn.py"
    spec = importlib.util.spec_from_file_location("mt_cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    run = {"train.steps": 3, "eval.every": 0, "eval.num_samples": 0, "checkpoint.every": 0}
    replay = {"grpo.router_replay": "rollout", "grpo.old_logps": "recompute"}
    return apply_overrides(mod.get_config("runlocal,moe"), {**run, **replay, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [{}, {"sampling.engine": "paged", "train.max_staleness": 1}],
    ids=["static", "paged_staleness_1"],
)
def test_a_multi_turn_run_replays_its_episodes_routes(tmp_path, monkeypatch, overrides):
    """configs/multiturn.py's ``runlocal,moe``: guess_number episodes on a tiny mixture (one
    sparse layer, top 2 of 4), on each
    engine (the paged one a step ahead, its batch in flight with its routes): every batch
    carries the routes of every position its episodes fed, the environment's answers
    included, and the replayed first ratio is 1 to rounding with pi_old rescored."""
    batches = []
    collect = episodes.collect

    def kept(*args, **kw):
        batch, host = collect(*args, **kw)
        batches.append(batch)
        return batch, host

    monkeypatch.setattr(episodes, "collect", kept)
    train(_multiturn_config(overrides), tmp_path)
    assert len(batches) == 3
    for b in batches:
        routes, mask = np.asarray(b.routes_NxSxRxK), np.asarray(b.mask_NxT)
        p, t = b.prompt_tokens_NxP.shape[1], mask.shape[1]
        assert routes.shape == (mask.shape[0], p + t, 1, 2) and routes.dtype == np.int8
        last = t - 1 - np.argmax(mask[:, ::-1], axis=1)  # each transcript's last token
        fed = np.arange(t)[None] < last[:, None]
        assert (fed & ~mask).sum() > 0  # observations were fed
        assert (routes[:, p:][fed] >= 0).all() and (routes[:, p:][~fed] == -1).all()
    for r in read_metrics(tmp_path / "metrics.jsonl")[1:]:
        assert r["env/turns_mean"] > 1 and r["env/errors"] == 0
        assert all(math.isfinite(r[k]) for k in MOE_KEYS), r
        assert r["moe/first_ratio_dev"] <= 1e-5
