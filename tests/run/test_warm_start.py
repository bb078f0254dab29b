"""The supervised warm start: batch layout, masked loss, stop criterion, cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.default import get_config
from grpo_jax.learner import optimizer
from grpo_jax.objective.logprobs import completion_logits
from grpo_jax.run import builders as run_lib
from grpo_jax.run import warm_start as sft
from grpo_jax.run.config import ConfigError, parse_config


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    run = parse_config(get_config("smoke"))
    tok = run_lib.build_tokenizer(run, tmp_path_factory.mktemp("wd"))
    mesh = run_lib.build_mesh(run)
    graphdef, params = run_lib.build_model(run, tok, mesh)
    return run, tok, mesh, graphdef, params, run_lib.build_encoder(run, tok)


EXAMPLES = [
    {"prompt": "12+3=", "answer": "51", "solution": "<answer>51</answer>"},
    {"prompt": "1+1=", "answer": "2", "solution": "<answer>2</answer>"},
]


def test_batch_layout_masks_the_prompt(parts):
    _, tok, _, _, _, enc = parts
    b = sft.sft_batch(EXAMPLES, enc, 6, "answer")
    # Prompts left-padded to the bucket, with BOS; targets right-padded, EOS included.
    assert b["prompt_tokens"].shape == (2, 9)
    assert tok.decode(b["prompt_tokens"][0][b["prompt_mask"][0]]) == "<bos>12+3="
    assert b["prompt_mask"][1].sum() == 5 and not b["prompt_mask"][1][:4].any()
    assert b["tokens"][0].tolist()[:3] == tok("51", add_special_tokens=False).input_ids + [2]
    assert b["mask"].sum(1).tolist() == [3, 2]
    with pytest.raises(ConfigError, match=r"the solution of example 0 .* has 20 tokens with EOS"):
        sft.sft_batch(EXAMPLES, enc, 6, "solution")
    with pytest.raises(ConfigError, match="needs a 'solution' field in every training example"):
        sft.sft_batch([{"prompt": "1+1=", "answer": "2"}], enc, 6, "solution")


@pytest.mark.slow
def test_loss_is_the_mean_nll_of_the_target_tokens(parts):
    _, tok, _, graphdef, params, enc = parts
    b = sft.sft_batch(EXAMPLES, enc, 6, "answer")
    loss, aux = sft.sft_loss(params, b, graphdef=graphdef)
    # By hand: one forward over [prompt | target], log-softmax, pick the targets.
    model = nnx.merge(graphdef, params)
    full = np.concatenate([b["prompt_tokens"], b["tokens"]], 1)
    mask = np.concatenate([b["prompt_mask"], b["mask"]], 1)
    logp = jax.nn.log_softmax(model(jnp.asarray(full), mask_BxT=jnp.asarray(mask)), -1)
    p = b["prompt_tokens"].shape[1]
    nll = [
        -float(logp[i, p - 1 + t, b["tokens"][i, t]])
        for i in range(2)
        for t in range(6)
        if b["mask"][i, t]
    ]
    assert float(loss) == pytest.approx(np.mean(nll), rel=1e-5)
    logits = completion_logits(
        graphdef, params, b["prompt_tokens"], b["prompt_mask"], b["tokens"], b["mask"]
    )
    hits = (np.argmax(logits, -1) == b["tokens"]) & b["mask"]
    assert float(aux["token_accuracy"]) == pytest.approx(hits.sum() / b["mask"].sum())


@pytest.mark.slow
def test_stops_on_the_validation_criterion_and_caches(parts, tmp_path):
    run, _, mesh, graphdef, params, enc = parts
    examples = [dict(ex, answer=str(i % 10)) for i, ex in enumerate(EXAMPLES * 8)]
    scores = iter([0.1, 0.2, 0.5, 0.9])
    seen = []
    cfg = sft.WarmStartConfig(
        enabled=True,
        max_steps=20,
        eval_every=2,
        batch_size=4,
        target_pass_at_1=0.5,
        target="answer",
        metric="sampled",
    )
    out, info = sft.warm_start(
        graphdef,
        params,
        examples,
        [],
        cfg=cfg,
        encoder=enc,
        max_new_tokens=6,
        validate=lambda p: {"greedy": 0.0, "sampled": next(scores)},
        seed=0,
        mesh=mesh,
        param_shardings=jax.tree.map(lambda x: x.sharding, params),
        log_fn=lambda step, m: seen.append((step, m["sft/val_pass_at_1"])),
    )
    assert info["steps"] == 6 and info["reached_target"] and info["val_pass_at_1"] == 0.5
    assert seen == [(2, 0.1), (4, 0.2), (6, 0.5)]
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params), strict=True)
    )

    sft.save_cache(tmp_path, out, dict(info, fingerprint="abc"))
    assert sft.load_cached(tmp_path, params, "other") is None  # a changed config retrains
    back, binfo = sft.load_cached(tmp_path, params, "abc")
    assert binfo["steps"] == 6
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sft.fingerprint({"a": 1, "b": [2]}) == sft.fingerprint({"b": [2], "a": 1})


@pytest.mark.slow
def test_nonfinite_step_is_skipped_with_params_and_moments_unchanged(parts):
    _, _, mesh, graphdef, params, enc = parts
    cfg = sft.WarmStartConfig(learning_rate=1e-2, warmup_steps=0)
    tx, schedule = optimizer.make_optimizer(cfg.optim(), cfg.max_steps)
    state = optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    step = jax.jit(functools.partial(sft.sft_step, graphdef=graphdef, tx=tx, schedule=schedule))
    good = sft.sft_batch(EXAMPLES, enc, 6, "answer")
    # An id outside the vocabulary embeds as NaN (jnp.take fills): the loss is not finite.
    vocab = nnx.merge(graphdef, params).config.vocab_size
    bad = dict(good, prompt_tokens=np.where(good["prompt_mask"], vocab + 7, 0).astype(np.int32))
    # A real step first, so the skipped one has non-zero Adam moments to keep.
    state, m0 = step(state, good)
    assert np.isfinite(float(m0["sft/loss"]))
    before = jax.device_get((state.params, state.opt_state))
    for i in (1, 2):
        state, m = step(state, bad)
        assert not np.isfinite(float(m["sft/loss"]))
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before[0]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)  # the parameters
        for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(before[1]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)  # and both Adam moments
        assert (int(state.skipped), int(state.skipped_in_row), int(state.updates)) == (i, i, 1)
    state, m = step(state, good)
    assert np.isfinite(float(m["sft/loss"]))
    assert (int(state.step), int(state.updates), int(state.skipped_in_row)) == (4, 2, 0)


def test_config_errors():
    with pytest.raises(ConfigError, match="'warm_start.metric' = 'loss' is not one of"):
        sft.WarmStartConfig(metric="loss")
    with pytest.raises(ConfigError, match="'warm_start.min_steps' = 5 must be <= 2"):
        sft.WarmStartConfig(max_steps=2, min_steps=5)


def test_the_warm_start_cache_does_not_depend_on_the_lora_keys():
    """The warm start trains the base alone: a LoRA run resumed with another alpha reuses
    warm_start/ (it used to train it again over the cache); old caches still load."""
    import json

    from grpo_jax.run.base_policy import warm_start_fingerprints

    def fps(**lora):
        c = get_config("smoke")
        c.model.lora.update(lora)
        return warm_start_fingerprints(parse_config(c))

    (fp, legacy), (fp8, legacy8) = fps(rank=2), fps(rank=4, alpha=8.0, dropout=0.1)
    assert fp == fp8 and legacy != legacy8
    assert fps()[0] == fp  # rank 0 (no LoRA) too
    run = parse_config(get_config("smoke"))
    parts = {  # what earlier versions hashed
        "model": run.section("model"),
        "tokenizer": run.tokenizer,
        "data": run.section("data"),
        "prompt": run.section("prompt"),
        "warm_start": run.section("warm_start"),
        "seed": run.seed,
        "max_new_tokens": run.sampling.max_new_tokens,
        "eval": run.section("eval"),
        "correct_reward": run.rewards.correct,
    }
    assert fps()[1] == sft.fingerprint(json.loads(json.dumps(parts)))


@pytest.mark.slow
def test_a_damaged_warm_start_cache_is_an_error_naming_it_and_an_old_one_loads(parts, tmp_path):
    """Flipped bytes are found by the checksums, a truncated file by Orbax; a cache of an
    earlier version (no checksums) loads, saying so."""
    import json

    from helpers_resume import flip_bytes

    from grpo_jax.core.errors import CheckpointError, IntegrityError

    *_, params, _ = parts
    info = {"fingerprint": "abc", "steps": 6, "val_pass_at_1": 0.5}
    cache = tmp_path / "warm_start"

    sft.save_cache(tmp_path, params, info)
    flip_bytes(cache, "params")
    with pytest.raises(IntegrityError, match=r"warm start cache in .*: params\S* differs from th"):
        sft.load_cached(tmp_path, params, "abc")
    with pytest.raises(IntegrityError):
        sft.restore_cache(tmp_path, params)  # export --warm_start reads it too

    sft.save_cache(tmp_path, params, info)
    data = max((cache / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"warm start cache in .* could not be restored \("):
        sft.load_cached(tmp_path, params, "abc")

    sft.save_cache(tmp_path, params, info)
    saved = json.loads((cache / "info.json").read_text())
    (cache / "info.json").write_text(json.dumps(dict(saved, steps=7)))
    with pytest.raises(IntegrityError, match="info.json differs from the checksum"):
        sft.load_cached(tmp_path, params, "abc")
    del saved["integrity"]
    (cache / "info.json").write_text(json.dumps(saved))
    said = []
    back, binfo = sft.load_cached(tmp_path, params, "abc", say=said.append)
    assert binfo == info and said == [
        f"the warm start cache in {cache} was saved without checksums (by an earlier version "
        "of grpo_jax): loaded unverified"
    ]


@pytest.mark.slow
def test_the_sft_step_keeps_rows_split_on_a_mesh(tiny_model_config):
    """With fsdp over 8 devices the step reduces no activation: rows stay split through the
    model. Jitted without the mesh set, the activations took the parameters' fsdp sharding
    and each device computed every row, all-reducing them (logits [24, 6, 100], the MLP's
    [24 x 14, 64], ...)."""
    from helpers_hlo import reduced_activations

    from grpo_jax.core import sharding
    from grpo_jax.models import create_model

    mesh = sharding.make_mesh({"fsdp": 8})
    graphdef, params = nnx.split(create_model(tiny_model_config, seed=0, mesh=mesh, layout="fsdp"))
    tx, schedule = optimizer.make_optimizer(optimizer.OptimConfig(), 4)
    state = optimizer.init_state(params, tx, mesh)
    step = sft.jit_sft_step(graphdef, tx, schedule, jax.tree.map(lambda x: x.sharding, state), mesh)
    rows = sharding.batch_sharding(mesh, 2)
    spec = lambda t, dt: jax.ShapeDtypeStruct((24, t), dt, sharding=rows)  # no model size
    batch = dict(prompt_tokens=spec(8, jnp.int32), prompt_mask=spec(8, jnp.bool_),
                 tokens=spec(6, jnp.int32), mask=spec(6, jnp.bool_))  # fmt: skip
    text = step.lower(state, batch).compile().as_text()
    assert reduced_activations(text, 24, (6, 8, 14)) == []


def test_on_one_device_the_step_is_the_program_jitted_without_the_mesh(tiny_model_config):
    """A one-device mesh has nothing to lay out, so OnMesh leaves the context out: the
    compiled step is the plain jit's, instruction for instruction. Under ``jax.set_mesh``
    the sharding constraints changed XLA's fusions and the last bits of each step, and the
    default run's warm start drifted from its records by its 90th step."""
    from grpo_jax.core import sharding
    from grpo_jax.models import create_model

    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    graphdef, params = nnx.split(create_model(tiny_model_config, seed=0, mesh=mesh))
    tx, schedule = optimizer.make_optimizer(optimizer.OptimConfig(), 4)
    state = optimizer.init_state(params, tx, mesh)
    step = sft.jit_sft_step(graphdef, tx, schedule, jax.tree.map(lambda x: x.sharding, state), mesh)
    spec = lambda t, dt: jax.ShapeDtypeStruct((8, t), dt)
    batch = dict(prompt_tokens=spec(8, jnp.int32), prompt_mask=spec(8, jnp.bool_),
                 tokens=spec(6, jnp.int32), mask=spec(6, jnp.bool_))  # fmt: skip
    plain = step.jitted.lower(state, batch).compile().as_text()  # outside any mesh context
    assert step.lower(state, batch).compile().as_text() == plain
