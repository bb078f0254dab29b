"""The pipelined, off-policy loop (train.max_staleness = k >= 1) on 8 fake CPU devices.

Versions: the batch used at step s must come from parameter version
v(s) = max(0, s - 1 - k) (updates applied), i.e. staleness s - 1 - v in [0, k].
The end-to-end tests sample each batch again from the checkpointed
parameters of that version, with the step's key, and require the very same
tokens and log-probs, so a batch labelled with a version really came from it.
"""

import math

import jax
import numpy as np
import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_resume import (
    _assert_same_params,
    _params_like,
    _restore,
    train_killed_at,
    without_timings,
)

from grpo_jax.rollout import sources
from grpo_jax.rollout import staleness as pipeline
from grpo_jax.run import builders
from grpo_jax.run import config as config_lib
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.config import ConfigError
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics


def test_sampled_version_is_k_behind_and_never_negative():
    assert [pipeline.sampled_version(s, 1) for s in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [pipeline.sampled_version(s, 2) for s in range(1, 6)] == [0, 0, 0, 1, 2]
    for k in (1, 2, 3):
        for s in range(1, 10):
            assert 0 <= s - 1 - pipeline.sampled_version(s, k) <= k


def test_the_sampler_takes_the_first_devices_and_the_learner_the_rest():
    devices = jax.devices()
    assert len(devices) == 8
    learner, sampler = builders.learner_and_sampler_devices(devices, 4)
    assert sampler == devices[:4] and learner == devices[4:]
    assert builders.learner_and_sampler_devices(devices, 0) == (devices, [])
    mesh = builders.sampler_mesh(sampler)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="leaves no learner device"):
        builders.learner_and_sampler_devices(devices, 8)


PIPELINE = {
    **SHORT_RUN,
    # Length-dependent rewards: groups have reward variance, so every update moves the policy.
    "rewards": "overlong(max_len=16,buffer=15):1.0",
    "correct_reward": "overlong",
    "sampling.max_new_tokens": 16,
    # No warmup: the smoke config's warmup gives step 1 a learning rate of 0, which would leave
    # version 1 equal to version 0.
    "optim.warmup_steps": 0,
}


def _config(**updates):
    return smoke_config(**{**PIPELINE, **updates})


@pytest.mark.parametrize(
    "updates, match",
    [
        ({"train.max_staleness": -1}, "train.max_staleness"),
        (
            {"train.max_staleness": 1, "train.dynamic_sampling": True, "mesh.sampler_devices": 4},
            "'mesh.sampler_devices' = 4 does not combine with train.dynamic_sampling",
        ),
        ({"mesh.sampler_devices": 4}, "needs train.max_staleness >= 1"),
    ],
)
def test_bad_pipeline_settings_fail_naming_the_key(updates, match):
    with pytest.raises(ConfigError, match=match):
        config_lib.parse_config(_config(**updates))


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    keys = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for k, v in old.items():
        jax.config.update(k, v)


# Both placements use the 8 fake devices (the smoke config itself runs on 1). Each batch shard
# holds whole groups, and the smoke batch of B = 4 groups does not divide over the one mesh's 8
# data shards, so the one mesh trains on B = 8 (one group per device). The split mesh keeps
# B = 4: devices 0-3 sample (data 4, parameters replicated), devices 4-7 learn (data 4).
PLACEMENTS = {
    "one_mesh": {"mesh.num_devices": 8, "train.batch_size": 8},
    "split_4_4": {"mesh.sampler_devices": 4, "mesh.num_devices": 8},
}


def _record_batches(monkeypatch):
    """Records every batch the single-turn source samples: (the source, InFlight)."""
    seen = []
    take = sources.SingleTurn.take

    def spy(self, step):
        f = take(self, step)
        seen.append((self, f))
        return f

    monkeypatch.setattr(sources.SingleTurn, "take", spy)
    return seen


def _params_by_version(workdir, run, r):
    """{version: params}: version 0 is the initial model, the others the checkpoints."""
    _, init = builders.build_model(run, r.policy.tokenizer, r.mesh)
    ck = Checkpointer(workdir / "checkpoints")
    try:
        out = {v: ck.restore_params(v, params_like=init) for v in ck.all_steps()}
    finally:
        ck.close()
    return {0: init, **out}


@pytest.mark.slow
@pytest.mark.parametrize(
    "placement, k",
    [("one_mesh", 1), ("one_mesh", 2), ("split_4_4", 1), ("split_4_4", 2)],
    ids=str,
)
def test_each_batch_comes_from_a_version_within_the_bound(tmp_path, monkeypatch, placement, k):
    from grpo_jax.sampling.static import generate

    cfg = _config(
        **{"train.max_staleness": k, "checkpoint.every": 1, "checkpoint.keep": 10},
        **PLACEMENTS[placement],
    )
    seen = _record_batches(monkeypatch)
    train(cfg, tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        s = r["step"]
        assert r["pipeline/version"] == pipeline.sampled_version(s, k)
        assert r["pipeline/staleness"] == s - 1 - r["pipeline/version"]
        assert 0 <= r["pipeline/staleness"] <= k
        # Timings: the waits are clamped at 0, so only their being measured (finite) is
        # checked; the update's own time is not clamped and must be positive.
        for key in ("perf/learner_wait_s", "perf/sampler_wait_s", "perf/step_wall_s"):
            assert math.isfinite(r[key]), (s, key)
        assert 0.0 < r["perf/update_s"] < math.inf
        if s > 1:
            assert r["perf/step_wall_s"] > 0.0
        # The overlap of this update with the next batch's work: measured exactly at the steps
        # that dispatched a next batch (step s + k <= 4); sampling overlap on a split mesh only.
        dispatched = s + k <= 4
        assert ("perf/overlap_host_s" in r) == dispatched
        assert ("perf/overlap_sample_s" in r) == (dispatched and placement == "split_4_4")
    # Host work of the next batch (decoding, rewards) ran while an update ran, and on the split
    # mesh the sampler sampled while the learner updated.
    assert any(r.get("perf/overlap_host_s", 0.0) > 0.0 for r in records)
    if placement == "split_4_4":
        assert any(r.get("perf/overlap_sample_s", 0.0) > 0.0 for r in records)
    assert [f.step for _, f in seen] == [1, 2, 3, 4]
    assert [f.version for _, f in seen] == [pipeline.sampled_version(s, k) for s in (1, 2, 3, 4)]

    sampler = seen[0][0]
    run, r = config_lib.parse_config(cfg), sampler.r
    versions = _params_by_version(tmp_path, run, r)
    G = run.grpo.G
    distinct = 0
    for _, f in seen:
        key = sources.sample_key(sampler.base_key, f.step)
        prompts_BxP = np.asarray(f.batch.prompt_tokens_NxP)[::G]
        mask_BxP = np.asarray(f.batch.prompt_mask_NxP)[::G]

        def again(v, prompts_BxP=prompts_BxP, mask_BxP=mask_BxP, key=key):
            params = sampler.params(versions[v])
            return generate(
                r.policy.graphdef,
                params,
                prompts_BxP,
                mask_BxP,
                key,
                r.sampling,
                num_samples=G,
                mesh=sampler.mesh,
            )

        out = again(f.version)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(f.batch.tokens_NxT))
        np.testing.assert_array_equal(np.asarray(out.logps), np.asarray(f.batch.old_logps_NxT))
        # The check tells versions apart: where the next update moved the parameters,
        # the next version's log-probs differ.
        moved = any(
            not np.array_equal(np.asarray(x), np.asarray(y))
            for x, y in zip(
                jax.tree.leaves(versions[f.version]), jax.tree.leaves(versions[f.version + 1])
            )
        )
        if moved:
            other = again(f.version + 1)
            assert not np.array_equal(np.asarray(other.logps), np.asarray(f.batch.old_logps_NxT))
            distinct += 1
    assert distinct >= 1


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["one_mesh", "split_4_4"])
def test_kill_and_resume_at_k1_equals_the_uninterrupted_run(tmp_path, placement):
    cfg = _config(**{"train.max_staleness": 1}, **PLACEMENTS[placement])
    train(cfg, tmp_path / "whole")

    # Between the checkpoints at 2 and 4: step 3 is lost.
    train_killed_at(cfg, tmp_path / "killed", 3)
    ck = Checkpointer(tmp_path / "killed" / "checkpoints")
    assert ck.all_steps() == [2]
    meta = ck.restore_meta(2)
    ck.close()
    # In flight at step 2: the batch of step 3, sampled by version 1.
    assert [(x["step"], x["version"]) for x in meta["inflight"]] == [(3, 1)]
    train(cfg, tmp_path / "killed")

    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    assert [r.get("pipeline/staleness") for r in resumed] == [None, 0.0, 1.0, 1.0, 1.0]
    like = _params_like(cfg, tmp_path / "whole")
    _assert_same_params(*(_restore(tmp_path / w, like) for w in ("whole", "killed")))


def _differ(a, b):
    return any(
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _without_pipeline_keys(records):
    return [{k: v for k, v in r.items() if not k.startswith("pipeline/")} for r in records]


# The k = 0 run of each placement: a split mesh needs k >= 1 (the config refuses it at k = 0),
# so its k = 0 counterpart is the on-policy loop on 4 devices, laid out like the split's
# sampler and learner meshes (data 4, parameters replicated).
ON_POLICY = {"one_mesh": PLACEMENTS["one_mesh"], "split_4_4": {"mesh.num_devices": 4}}


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["one_mesh", "split_4_4"])
def test_k0_is_the_on_policy_loop_and_the_first_k1_step_equals_it(tmp_path, monkeypatch, placement):
    """k = 0 is the on-policy loop: each step's batch is sampled by the version its update
    starts from (version s - 1), with no pipeline/* metrics.

    Step 1 of a k = 1 run has staleness 0: its batch comes from version 0 with step 1's key and
    the first prompts, as the on-policy loop's does, while step 2's batch (also version 0) is
    sampled during step 1's update. So step 1's record (timings and pipeline/* aside) and the
    parameters after it equal the k = 0 run's, bit for bit. Later steps differ by design:
    k = 1 samples step s with version s - 2, k = 0 with version s - 1.
    """
    seen = _record_batches(monkeypatch)
    # Two steps each (the last step's record also holds the final evaluation), a checkpoint
    # after each.
    two_steps = {"train.steps": 2, "checkpoint.every": 1}
    on_policy = _config(**two_steps, **ON_POLICY[placement])
    train(on_policy, tmp_path / "k0")
    assert [(f.step, f.version) for _, f in seen] == [(1, 0), (2, 1)]
    del seen[:]
    k1 = _config(**two_steps, **{"train.max_staleness": 1}, **PLACEMENTS[placement])
    train(k1, tmp_path / "k1")
    assert [(f.step, f.version) for _, f in seen] == [(1, 0), (2, 0)]

    a = read_metrics(tmp_path / "k0" / "metrics.jsonl")
    b = read_metrics(tmp_path / "k1" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    assert not any(k.startswith("pipeline/") for r in a for k in r)
    assert (b[1]["pipeline/staleness"], b[1]["pipeline/version"]) == (0.0, 0.0)
    assert (b[2]["pipeline/staleness"], b[2]["pipeline/version"]) == (1.0, 0.0)
    # Steps 0 (the evaluation before training) and 1.
    assert _without_pipeline_keys(without_timings(b[:2])) == without_timings(a[:2])
    like = _params_like(on_policy, tmp_path / "k0")
    k0_1, k0_2 = (_restore(tmp_path / "k0", like, step=v, latest=2) for v in (1, 2))
    k1_1, k1_2 = (_restore(tmp_path / "k1", like, step=v, latest=2) for v in (1, 2))
    _assert_same_params(k0_1, k1_1)
    assert _differ(k0_1, like)  # step 1 moved the parameters
    # Step 2 trains on batches of different versions (1 and 0), so the runs part there: the
    # comparison above tells them apart.
    assert _differ(k0_2, k1_2)
