"""Training a reward model: the Bradley-Terry loss and gradient by hand, held-out accuracy on
synthetic pairs, the command (JSONL and TFDS pairs), and the export that transformers and the
loader read. (Reading the pairs: tests/data/test_data_pairs.py.)"""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_classifier_scores, load_hf_classifier
from helpers_jit import scores as jit_scores

from grpo_jax.learner.optimizer import OptimConfig
from grpo_jax.reward_models import RewardModel, load_reward_model
from grpo_jax.reward_models.training import (
    bradley_terry,
    encode_pairs,
    pair_loss,
    save_reward_model,
)
from grpo_jax.train_reward_model import evaluate_pairs, split_pairs, train_pairs


def test_bradley_terry_loss_and_gradient_by_hand():
    r_c, r_r = jnp.array([1.0, -0.5]), jnp.array([0.0, 0.5])
    # -log sigmoid(d) for d = 1, -1: log(1 + e^-1), log(1 + e^1); the mean of the two.
    want = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(1.0))) / 2
    np.testing.assert_allclose(bradley_terry(r_c, r_r), want, rtol=1e-6)
    g_c, g_r = jax.grad(bradley_terry, argnums=(0, 1))(r_c, r_r)
    sig = lambda x: 1 / (1 + math.exp(-x))
    # dL/dr_c,i = -sigmoid(r_r,i - r_c,i) / B, and dL/dr_r = -dL/dr_c.
    np.testing.assert_allclose(g_c, [-sig(-1.0) / 2, -sig(1.0) / 2], rtol=1e-6)
    np.testing.assert_allclose(g_r, -g_c, rtol=1e-6)
    # Large margins stay finite (softplus, not log(sigmoid)).
    assert np.isfinite(bradley_terry(jnp.array([-200.0]), jnp.array([200.0])))


def _pairs(numbers):
    """Prefer the tagged answer: chosen "<answer>s</answer>", rejected the bare "s"."""
    return [(f"{a}+{b}=", f"<answer>{a + b}</answer>", f"{a + b}") for a, b in numbers]


@pytest.fixture(scope="module")
def trained(builtin_tokenizer, tiny_model_config):
    rng = np.random.default_rng(0)
    train, heldout = split_pairs(_pairs(rng.integers(0, 50, (80, 2))), 0.25, seed=0)
    model = RewardModel(tiny_model_config, 1, rngs=nnx.Rngs(0))
    buckets = (32,)
    before = evaluate_pairs(model, builtin_tokenizer, heldout, batch_size=20, buckets=buckets)
    model, history = train_pairs(
        model,
        builtin_tokenizer,
        train,
        steps=30,
        batch_size=8,
        optim=OptimConfig(learning_rate=3e-3),
        buckets=buckets,
        log=lambda _: None,
    )
    after = evaluate_pairs(model, builtin_tokenizer, heldout, batch_size=20, buckets=buckets)
    return model, heldout, before, after, history


# Thirty training steps and two evaluations: ~15 s cold.
@pytest.mark.slow
def test_heldout_accuracy_well_above_chance(trained):
    _, heldout, before, after, history = trained
    assert len(heldout) == 20
    assert after["accuracy"] >= 0.9, (before, after)
    assert after["loss"] < before["loss"] and after["loss"] < 0.3
    assert all(h["finite"] for h in history)


@pytest.mark.slow  # over 1.25 s on a 2-core CPU
def test_pair_loss_is_bradley_terry_of_the_scores(builtin_tokenizer, tiny_model_config):
    # Any parameters will do (an untrained model): the loss is a function of the scores.
    model = RewardModel(tiny_model_config, 1, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)
    heldout = _pairs(rng.integers(0, 50, (3, 2)))
    batch = encode_pairs(builtin_tokenizer, heldout[:3], (32,))
    r = np.asarray(jit_scores(model, batch["tokens"], batch["mask"]))[:, 0]
    # Compiled (op by op the model compiles a hundred small programs).
    loss, acc = jax.jit(pair_loss, static_argnums=1)(nnx.state(model), nnx.graphdef(model), batch)
    np.testing.assert_allclose(loss, bradley_terry(r[:3], r[3:]), rtol=1e-6)
    np.testing.assert_allclose(acc, np.mean(r[:3] > r[3:]), rtol=1e-6)  # float32 accuracy


@pytest.mark.slow  # a transformers round trip: ~40 s cold; the fast tier keeps the Qwen2 parity
def test_export_loads_in_transformers_and_back(trained, builtin_tokenizer, tmp_path):
    model, heldout, *_ = trained
    out = save_reward_model(model, tmp_path / "rm", tokenizer=builtin_tokenizer)
    batch = encode_pairs(builtin_tokenizer, heldout[:4], (32,))
    ours = np.asarray(jit_scores(model, batch["tokens"], batch["mask"]))
    back = np.asarray(jit_scores(load_reward_model(out), batch["tokens"], batch["mask"]))
    np.testing.assert_allclose(back, ours, atol=1e-6)
    positions = np.maximum(np.cumsum(batch["mask"], axis=1) - 1, 0)
    hf = hf_classifier_scores(
        load_hf_classifier(out), batch["tokens"], batch["mask"], position_ids=positions
    )
    np.testing.assert_allclose(hf, ours, atol=1e-5)
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"
    ]


def test_the_export_lists_its_files_checksums_and_a_flipped_byte_refuses_to_load(
    builtin_tokenizer, tiny_model_config, tmp_path
):
    from grpo_jax.core.errors import IntegrityError

    model = RewardModel(tiny_model_config, 1, rngs=nnx.Rngs(0))
    out = save_reward_model(model, tmp_path / "rm", tokenizer=builtin_tokenizer)
    listed = [line.split("  ")[1] for line in (out / "SHA256SUMS").read_text().splitlines()]
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(listed)
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=out).returncode == 0
    load_reward_model(out)
    weights = bytearray((out / "model.safetensors").read_bytes())
    weights[len(weights) // 2] ^= 0x01
    (out / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(IntegrityError, match="model.safetensors differs from its checksum"):
        load_reward_model(out)
    (out / "SHA256SUMS").unlink()  # a directory saved without them (transformers') loads
    load_reward_model(out)


@pytest.mark.slow
def test_command_trains_and_saves(tmp_path):
    rng = np.random.default_rng(1)
    pairs = tmp_path / "pairs.jsonl"
    rows = _pairs(rng.integers(0, 50, (60, 2)))
    pairs.write_text(
        "".join(json.dumps(dict(zip(("prompt", "chosen", "rejected"), r))) + "\n" for r in rows)
    )
    out = tmp_path / "rm"
    cmd = [sys.executable, "-m", "grpo_jax.train_reward_model", f"--pairs={pairs}", f"--out={out}"]
    cmd += ["--steps=15", "--batch_size=8", "--learning_rate=1e-3", "--heldout_frac=0.2"]
    # The texts ("12+34=<answer>46</answer>") fit 32 tokens: half the default smallest bucket.
    done = subprocess.run([*cmd, "--buckets=32"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "reward_model.json").read_text())
    assert summary["heldout_pairs"] == 12 and summary["train_pairs"] == 48
    assert summary["heldout_after"]["accuracy"] >= 0.9, summary
    assert load_reward_model(out).num_labels == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    cmd = [sys.executable, "-m", "grpo_jax.train_reward_model", f"--pairs={bad}", f"--out={out}2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "bad.jsonl:1:" in done.stderr


@pytest.mark.slow  # two launches of the command
def test_command_trains_on_a_prepared_tfds_dataset(tmp_path):
    import helpers_tfds

    data_dir = helpers_tfds.prepare(tmp_path / "tfds")
    out = tmp_path / "rm"
    cmd = [sys.executable, "-m", "grpo_jax.train_reward_model", "--pairs=tfds:tiny_prefs"]
    cmd += [f"--data_dir={data_dir}", "--fields=question,response_j,response_k"]
    cmd += [f"--out={out}", "--steps=2", "--batch_size=4", "--heldout_frac=0.25"]
    done = subprocess.run([*cmd, "--buckets=16,32"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "reward_model.json").read_text())
    assert summary["pairs"] == "tfds:tiny_prefs[train]"
    assert (summary["train_pairs"], summary["heldout_pairs"]) == (9, 3)  # the 12 train rows
    done = subprocess.run([*cmd, "--split=dev"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "split 'dev'" in done.stderr.strip().splitlines()[-1]


class _Stopped(Exception):
    pass


@pytest.mark.slow  # four short trainings of the tiny classifier: ~15 s cold
def test_a_stopped_training_resumes_to_the_parameters_of_one_never_stopped(
    builtin_tokenizer, tiny_model_config, tmp_path
):
    """On a mesh of 4 devices, checkpoints every 3 of 6 steps; stopped after step 4, the
    same call resumes from step 3 and ends bit for bit where the run never stopped did."""
    from grpo_jax.core import sharding
    from grpo_jax.core.errors import CheckpointError
    from grpo_jax.run.checkpoints import Checkpointer

    pairs = _pairs(np.random.default_rng(2).integers(0, 50, (40, 2)))
    mesh = sharding.make_mesh({"fsdp": -1}, jax.devices()[:4])
    kw = dict(steps=6, batch_size=4, optim=OptimConfig(learning_rate=3e-3), buckets=(32,))
    kw.update(log=lambda _: None, mesh=mesh, checkpoint_every=3, fingerprint="these pairs")
    fresh = lambda: RewardModel(tiny_model_config, 1, rngs=nnx.Rngs(0))
    leaves = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))

    whole, history = train_pairs(
        fresh(), builtin_tokenizer, pairs, checkpoints=tmp_path / "a", **kw
    )
    assert any("fsdp" in str(x.sharding.spec) for x in leaves(whole))  # trained sharded

    def stop(step):
        if step == 4:
            raise _Stopped

    with pytest.raises(_Stopped):
        train_pairs(
            fresh(), builtin_tokenizer, pairs, checkpoints=tmp_path / "b", on_step=stop, **kw
        )
    ck = Checkpointer(tmp_path / "b")
    assert ck.all_steps() == [3]
    ck.close()
    resumed, history_b = train_pairs(
        fresh(), builtin_tokenizer, pairs, checkpoints=tmp_path / "b", **kw
    )
    assert history_b == history and len(history) == 6
    for a, b in zip(leaves(whole), leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Another run's checkpoints are not resumed from.
    other = {**kw, "fingerprint": "other pairs"}
    with pytest.raises(CheckpointError, match="other pairs or settings"):
        train_pairs(fresh(), builtin_tokenizer, pairs, checkpoints=tmp_path / "b", **other)

    # The same training on one device, without checkpoints: the same model to rounding.
    one, history_1 = train_pairs(
        fresh(), builtin_tokenizer, pairs, **{**kw, "mesh": None, "checkpoint_every": 0}
    )
    np.testing.assert_allclose(
        [h["loss"] for h in history_1], [h["loss"] for h in history], rtol=1e-4
    )
    for a, b in zip(leaves(whole), leaves(one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # three short trainings of the tiny classifier
def test_a_checkpoint_with_flipped_bytes_is_set_aside_and_training_resumes_from_the_one_before(
    builtin_tokenizer, tiny_model_config, tmp_path
):
    from helpers_resume import flip_bytes

    pairs = _pairs(np.random.default_rng(3).integers(0, 50, (40, 2)))
    said = []
    kw = dict(steps=6, batch_size=4, optim=OptimConfig(learning_rate=3e-3), buckets=(32,))
    kw.update(log=said.append, checkpoint_every=2, fingerprint="these pairs")
    fresh = lambda: RewardModel(tiny_model_config, 1, rngs=nnx.Rngs(0))
    ck = tmp_path / "checkpoints"

    def stop(step):
        if step == 6:
            raise _Stopped

    _, whole = train_pairs(fresh(), builtin_tokenizer, pairs, **kw)
    with pytest.raises(_Stopped):
        train_pairs(fresh(), builtin_tokenizer, pairs, checkpoints=ck, on_step=stop, **kw)
    flip_bytes(ck / "6", "params")
    said.clear()
    _, resumed = train_pairs(fresh(), builtin_tokenizer, pairs, checkpoints=ck, **kw)
    assert said[0].startswith(f"checkpoint step 6 in {ck} could not be restored (")
    assert said[0].endswith(f"; set aside in {ck}.unrestorable, resuming from step 4")
    # The tiny model's arrays are small zstd frames: bytes flipped in a frame's header fail
    # TensorStore's decompression, naming the file, before the array's checksum is compared
    # (about one run in fifteen); elsewhere they decompress, and the checksum catches them.
    by_checksum = said[0].startswith(f"checkpoint step 6 in {ck} could not be restored (params")
    by_checksum &= "differs from the checksum saved with it (damaged on disk)" in said[0]
    by_decoder = "Error reading" in said[0] and f'at local file "{ck}/6/params/"' in said[0]
    assert by_checksum or by_decoder, said[0]
    assert said[1] == f"resumed from the checkpoint of step 4 in {ck}"
    assert resumed == whole  # the same losses, step for step
    assert (tmp_path / "checkpoints.unrestorable" / "6").is_dir()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"batch_size": 0}, "--batch_size=0 must be >= 1"),
        ({"batch_size": -3}, "--batch_size=-3 must be >= 1"),
        ({"steps": 0}, "--steps=0 must be >= 1"),
        ({"learning_rate": float("nan")}, "--learning_rate=nan must be a number > 0"),
        ({"learning_rate": 0.0}, "--learning_rate=0.0 must be a number > 0"),
        ({"heldout_frac": 1.0}, "--heldout_frac=1.0 must lie strictly between 0 and 1"),
        ({"seed": -1}, "--seed=-1 must be >= 0"),
        ({"checkpoint_every": -1}, "--checkpoint_every=-1 must be >= 0"),
        ({"out": "file"}, "--out={tmp}/file is a file; the reward model is written as a directory"),
        ({"out": "file/rm"}, "--out={tmp}/file/rm: {tmp}/file is a file, not a directory"),
    ],
)
def test_bad_settings_are_refused_before_any_work(tmp_path, monkeypatch, changes, message):
    from grpo_jax import train_reward_model as reward_model

    def no_work(*args, **kwargs):
        raise AssertionError("the pairs were read before the settings were checked")

    monkeypatch.setattr(reward_model, "load_pairs", no_work)
    (tmp_path / "file").write_text("")
    kwargs = {**changes, "out": tmp_path / changes.get("out", "rm")}
    with pytest.raises(ValueError) as info:
        reward_model.train_reward_model(tmp_path / "pairs.jsonl", log=print, **kwargs)
    assert str(info.value) == message.format(tmp=tmp_path)


def test_pairs_are_checked_against_what_the_model_reads(tmp_path, builtin_tokenizer, caplog):
    import logging
    from types import SimpleNamespace

    from grpo_jax.core.errors import MalformedRowError
    from grpo_jax.data.pairs import load_pairs
    from grpo_jax.train_reward_model import check_pairs

    path = tmp_path / "pairs.jsonl"
    rows = [("1+1=", "2", "3"), ("1+2=", "3", "4" * 40), ("2+2=", "4 ✓", "5")]
    path.write_text(
        "".join(json.dumps(dict(zip(("prompt", "chosen", "rejected"), r))) + "\n" for r in rows)
    )
    pairs = load_pairs(path)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=40))
    with pytest.raises(
        MalformedRowError,
        match=r"pairs.jsonl:2: prompt \+ rejected is 45 tokens .* more than the 32 tokens of the "
        r"largest of --buckets=16,32$",
    ):
        check_pairs(pairs, builtin_tokenizer, model, (16, 32))
    with pytest.raises(
        MalformedRowError, match=r"more than the 40 positions of the model's context"
    ):
        check_pairs(pairs, builtin_tokenizer, model, (16, 64))
    wide = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    with caplog.at_level(logging.WARNING):
        check_pairs(pairs, builtin_tokenizer, wide, (64,))  # every pair fits
    assert any(f"'✓' (1 text(s), first {path}:3)" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # three launches of the command
def test_command_refuses_bad_flags_and_pairs_in_one_line_with_exit_status_2(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [(f"{a}+1=", str(a + 1), str(a)) for a in range(10)] + [("1+1=", "2" * 5000, "3")]
    pairs.write_text(
        "".join(json.dumps(dict(zip(("prompt", "chosen", "rejected"), r))) + "\n" for r in rows)
    )
    cmd = [sys.executable, "-m", "grpo_jax.train_reward_model", f"--out={tmp_path / 'rm'}"]
    for args, message in [
        ([f"--pairs={pairs}", "--batch_size=0"], "error: --batch_size=0 must be >= 1"),
        ([f"--pairs={tmp_path}"], f"error: preference pairs file {tmp_path} is a directory"),
        ([f"--pairs={pairs}", "--buckets=16,32"], f"error: {pairs}:11: prompt + chosen is over"),
    ]:
        done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not (tmp_path / "rm").exists()


@pytest.mark.slow
def test_a_sharded_training_step_reduces_no_activations(builtin_tokenizer, tiny_model_config):
    """The Bradley-Terry step on fsdp 4: what the devices all-reduce is the gradients (each a
    parameter's shape) and the metrics' scalars. Jitted without the mesh set, the step split
    the model's width over fsdp and all-reduced every pair's activations ([256, 64]: 8 rows
    of 32 tokens)."""
    import re

    from grpo_jax.core import sharding
    from grpo_jax.learner.optimizer import init_state, make_optimizer
    from grpo_jax.reward_models.training import encode_pairs
    from grpo_jax.train_reward_model import _placed, _step

    mesh = sharding.make_mesh({"fsdp": -1}, jax.devices()[:4])
    tx, _ = make_optimizer(OptimConfig(learning_rate=1e-3), 2)
    graphdef, params = nnx.split(RewardModel(tiny_model_config, 1, rngs=nnx.Rngs(0)))
    state = init_state(_placed(params, mesh, 4), tx, mesh)
    pairs = _pairs(np.random.default_rng(0).integers(0, 50, (4, 2)))
    batch = jax.device_put(
        encode_pairs(builtin_tokenizer, pairs, (32,)), sharding.batch_sharding(mesh)
    )
    text = _step(graphdef, tx, 0, state, mesh).lower(state, batch).compile().as_text()
    sizes = {x.size for x in jax.tree.leaves(params)}  # a gradient may be reshaped
    reduced = [
        tuple(int(d) for d in dims.split(",") if d)
        for line in text.splitlines()
        if re.search(r" all-reduce(?:-start)?\(", line)
        for dims in re.findall(r"f32\[([\d,]*)\]", line.split(" all-reduce")[0])
    ]
    assert reduced and not {d for d in reduced if d and math.prod(d) not in sizes}
