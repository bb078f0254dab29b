"""A rollout engine of its own, in this one file: registered by name, selected with
``sampling.engine``, and trained with (grpo_jax/sampling/engines.py; docs/engine.md, "Engines").

``greedy_anchor`` wraps the static sampler with a rule of its own: each group's first
completion is the greedy one and the other G - 1 are drawn as the sampling settings say, so
every group measures its samples against what the policy answers without sampling.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_config import SHORT_RUN, smoke_config
from helpers_episodes import EOS, PROMPTS, _envs, _model, decode, encode_obs

from grpo_jax.core import sharding as sharding_lib
from grpo_jax.core.errors import ConfigError
from grpo_jax.rollout import episodes
from grpo_jax.run import config as config_lib
from grpo_jax.run import memory
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics
from grpo_jax.sampling import engines, static
from grpo_jax.sampling.static import SampleOutput, SamplingConfig, pad_prompts

NAME = "greedy_anchor"


class AnchorStats(NamedTuple):
    greedy_rows: int
    drawn_rows: int


class GreedyAnchor(engines.Engine):
    """Sample 0 of each group greedy, samples 1 .. G-1 drawn (two static sampler calls)."""

    def generate(self, graphdef, params, tokens_BxP, mask_BxP, key, cfg, *, num_samples, mesh=None):
        b, g = np.shape(tokens_BxP)[0], num_samples
        call = lambda c, n: static.generate(
            graphdef, params, tokens_BxP, mask_BxP, key, c, num_samples=n, mesh=mesh
        )
        greedy = call(dataclasses.replace(cfg, greedy=True), 1)
        if g == 1:
            return greedy, AnchorStats(b, 0)
        drawn = call(cfg, g - 1)

        def interleave(first_B, rest):  # [B, ...] and [B*(G-1), ...] -> [B*G, ...]
            rest = rest.reshape(b, g - 1, *rest.shape[1:])
            return jnp.concatenate([first_B[:, None], rest], axis=1).reshape(b * g, *rest.shape[2:])

        # A field the static engine leaves None (its routes, without routing replay) stays None.
        out = SampleOutput(
            *(None if x is None else interleave(x, y) for x, y in zip(greedy, drawn, strict=True))
        )
        if mesh is not None:  # rows back in the batch layout, whole groups per shard
            put = lambda x: jax.device_put(x, sharding_lib.batch_sharding(mesh, x.ndim))
            out = SampleOutput(*(None if x is None else put(x) for x in out))
        return out, AnchorStats(b, b * (g - 1))

    def check(self, sampling, model, *, completion, completion_key):
        if sampling.top_k == 1:
            raise ConfigError(
                f"config key 'sampling.top_k' = 1 leaves the {NAME} engine nothing to draw: "
                "every row would be the greedy one; use 0 or at least 2"
            )

    def kv_bytes(self, cfg, model_cfg, *, prompts, samples, due, mesh_shape):
        # The two calls run one after the other: the drawn rows' cache is the larger one.
        shards = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
        rows = -(-prompts * max(samples - 1, 1) // shards)
        slots = max(cfg.prompt_buckets) + cfg.max_new_tokens
        width = jnp.dtype(model_cfg.compute_dtype).itemsize
        per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim
        return rows * slots * per_token * width

    def metrics(self, stats):
        return {"engine/greedy_rows": sum(s.greedy_rows for s in stats)}


engines.register_engine(NAME, GreedyAnchor())


def test_the_engine_is_registered_by_name_beside_the_built_in_ones():
    assert isinstance(engines.get_engine(NAME), GreedyAnchor)
    assert engines.engine_names()[:2] == ("static", "paged") and NAME in engines.engine_names()
    engines.register_engine(NAME, GreedyAnchor())  # its module read again: replaced
    with pytest.raises(ValueError, match="'static' is taken by StaticEngine"):
        engines.register_engine("static", GreedyAnchor())
    assert isinstance(engines.get_engine("static"), engines.StaticEngine)


@pytest.mark.slow  # compiles the static sampler for both calls
def test_its_first_sample_of_each_group_is_the_greedy_completion(tiny_policy):
    cfg = SamplingConfig(max_new_tokens=6, prompt_buckets=(8,), temperature=1.0, engine=NAME)
    toks, mask = pad_prompts([[5, 9, 2], [7], [1, 2, 3, 4]], pad_id=0, buckets=(8,))
    graphdef, params = tiny_policy
    key = jax.random.key(3)
    out, stats = engines.get_engine(NAME).generate(
        graphdef, params, toks, mask, key, cfg, num_samples=4
    )
    assert stats == AnchorStats(3, 9)
    assert out.tokens.shape == (12, 6) and out.prompt_tokens.shape == (12, 8)
    greedy = static.generate(
        graphdef, params, toks, mask, key, dataclasses.replace(cfg, greedy=True), num_samples=1
    )
    np.testing.assert_array_equal(np.asarray(out.tokens)[::4], greedy.tokens)
    np.testing.assert_array_equal(np.asarray(out.prompt_tokens)[::4], toks)
    drawn = np.asarray(out.tokens).reshape(3, 4, 6)[:, 1:]
    assert len({tuple(r) for r in drawn.reshape(9, 6)}) > 1  # the others are drawn


def test_an_unknown_engine_is_one_line_listing_the_registered_ones():
    with pytest.raises(ConfigError) as info:
        config_lib.parse_config(smoke_config(**{"sampling.engine": "vllm"}))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("config key 'sampling.engine' = 'vllm' is not a registered engine")
    assert f"registered: static, paged, {NAME}" in message


def test_its_own_config_check_runs_when_the_config_is_parsed():
    run = config_lib.parse_config(smoke_config(**{"sampling.engine": NAME}))
    assert run.sampling.engine == NAME and run.sampling.sampler().engine == NAME
    with pytest.raises(ConfigError, match=f"'sampling.top_k' = 1 leaves the {NAME} engine"):
        config_lib.parse_config(smoke_config(**{"sampling.engine": NAME, "sampling.top_k": 1}))
    # Partial rollouts need an engine that carries rows between its runs.
    with pytest.raises(ConfigError, match=f"needs sampling.engine = 'paged' \\(it is '{NAME}'\\)"):
        config_lib.parse_config(
            smoke_config(
                **{
                    "sampling.engine": NAME,
                    "sampling.partial_rollouts": True,
                    "train.max_staleness": 1,
                }
            )
        )


def test_the_memory_plan_counts_the_engines_own_cache(tiny_model_config):
    run = config_lib.parse_config(smoke_config(**{"sampling.engine": NAME, "eval.batch_size": 4}))
    static_run = config_lib.parse_config(smoke_config(**{"eval.batch_size": 4}))
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    model = tiny_model_config
    own = engines.get_engine(NAME).kv_bytes(
        run.sampling.sampler(), model, prompts=4, samples=4, due=4, mesh_shape=mesh
    )
    planned = memory.plan_run(run, model, mesh).kv_cache
    assert planned == own  # 12 drawn rows at once, more than evaluation's 4
    # The static engine's cache holds all 16 rows.
    assert memory.plan_run(static_run, model, mesh).kv_cache == own * 16 // 12


@pytest.mark.slow  # compiles the multi-turn kernel twice (the engine's name is a static argument)
def test_multi_turn_episodes_play_on_the_static_kernel_with_it():
    graphdef, params = _model("llama")
    toks, mask = pad_prompts(PROMPTS, pad_id=0, buckets=(8,))
    cfg = episodes.MultiTurnConfig(max_tokens=24, max_turns=3, max_obs_tokens=4, max_turn_tokens=5)

    def play(engine):
        s = SamplingConfig(
            max_new_tokens=1, eos_ids=EOS, pad_id=0, prompt_buckets=(8,), engine=engine
        )
        return episodes.run_episodes(
            graphdef, params, _envs(2), toks, mask, jax.random.key(0), sampling=s, cfg=cfg,
            encode_observation=encode_obs, decode=decode, num_samples=2,
        )  # fmt: skip

    mine, static_ = play(NAME), play("static")
    for f in ("tokens_NxT", "mask_NxT", "logps_NxT", "lengths_N", "rewards_N", "turns_N"):
        np.testing.assert_array_equal(getattr(mine, f), getattr(static_, f), err_msg=f)


@pytest.mark.slow  # trains the smoke config for three steps
def test_a_run_selects_it_by_name_and_trains(tmp_path):
    overrides = {
        **SHORT_RUN,
        "train.steps": 3,
        "checkpoint.every": 0,
        "sampling.engine": NAME,
        # A reward that differs within a group from the start (the length), so there is
        # something to learn without the warm start.
        "rewards": "overlong(max_len=16,buffer=15):1.0",
    }
    train(smoke_config(**overrides), tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert r["engine/greedy_rows"] == 4  # B = 4 groups, one greedy row each
        assert np.isfinite(r["train/loss"])
    # The updates after the warm-up's first (at learning rate 0) moved the policy on the
    # engine's samples.
    assert all(r["policy/abs_log_ratio_mean"] > 1e-4 for r in records[2:])
    # The trainer scores the engine's samples with the parameters that drew them.
    assert abs(records[1]["train/ratio_max"] - 1.0) < 1e-4
