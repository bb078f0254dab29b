"""LoRA runs end to end: checkpoints hold the adapters and the base's identity, a killed run
resumes exactly, a changed base is refused, and a workdir exports merged or as PEFT."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from helpers_config import SHORT_RUN, smoke_config
from helpers_jit import logits as jitted_logits
from helpers_resume import train_killed_at, without_timings

from grpo_jax.models import lora
from grpo_jax.run import builders
from grpo_jax.run import config as config_lib
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.train import train
from grpo_jax.run.writers import read_metrics

pytestmark = pytest.mark.slow  # trains the smoke config end to end


LORA_RUN = {
    **SHORT_RUN,
    "grpo.beta": 0.04,
    "optim.learning_rate": 1e-2,
    # The untrained model's answers are never right; half of its completions hold a digit
    # below 5, which gives every step's groups reward variance, so the adapters move
    # whatever this CPU's floating point draws.
    "rewards": "exact_match(tag=None):1.0,format(pattern='.*[0-4].*'):0.5",
}
# Set last, whatever a test overrides.
LORA = {"model.lora.rank": 2, "model.lora.alpha": 4.0, "model.lora.dropout": 0.1}


def _config(**updates):
    return smoke_config(**{**LORA_RUN, **updates, **LORA})


def test_lora_checkpoint_round_trip_exact_resume_and_export(tmp_path, builtin_tokenizer):
    cfg = _config()
    train(cfg, tmp_path / "whole")

    # Between the checkpoints at 2 and 4: step 3 is lost.
    train_killed_at(cfg, tmp_path / "killed", 3)
    train(cfg, tmp_path / "killed")
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(whole)
    assert whole[1]["train/kl"] == 0.0 and whole[-1]["train/kl"] > 0.0  # B starts at 0

    # The checkpoint holds the adapters (and their optimizer state) and the base's identity.
    run = config_lib.parse_config(cfg)
    mesh = builders.build_mesh(run)
    _, params, lora_run = builders.build_policy(run, builtin_tokenizer, mesh)
    adapters = lora.trainable(params)
    finals = []
    for wd in ("whole", "killed"):
        ck = Checkpointer(tmp_path / wd / "checkpoints")
        meta = ck.restore_meta(4)
        saved = ck.restore_params(4, params_like=adapters)
        ck.close()
        finals.append(saved)
        assert meta["lora_base"] == lora_run.identity(lora.split(params)[0])
        assert meta["lora_base"]["path"] == "" and meta["lora_base"]["warm_start"] is None
    # What was written, read from the checkpoint's own tree metadata (not from the restore
    # template): the adapters, every one of them, and nothing of the base.
    import orbax.checkpoint as ocp

    written = ocp.StandardCheckpointer().metadata(
        tmp_path / "whole" / "checkpoints" / "4" / "params"
    )
    keys = lambda tree: {
        ".".join(str(getattr(k, "key", k)) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    saved_names = {n.removesuffix(".value") for n in keys(written.item_metadata)}
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(adapters)}
    assert names and all(n.endswith(("_lora_a", "_lora_b")) for n in names)
    assert saved_names == names
    for x, y in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    moved = [
        not np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(adapters), jax.tree.leaves(finals[0]), strict=True)
    ]
    assert all(moved)

    # Export: merged weights give the policy's logits; PEFT files name every adapter.
    from grpo_jax.export import export_hf
    from grpo_jax.models import from_pretrained

    gd, policy, _ = builders.restore_policy(
        run, builtin_tokenizer, mesh, tmp_path / "whole" / "checkpoints"
    )
    tokens = np.random.default_rng(0).integers(4, 100, (2, 6)).astype(np.int32)
    ours = jitted_logits(nnx.merge(gd, policy), tokens)
    out = export_hf(tmp_path / "whole", tmp_path / "merged")
    np.testing.assert_allclose(jitted_logits(from_pretrained(out), tokens), ours, atol=1e-5)
    out = export_hf(tmp_path / "whole", tmp_path / "peft", format="peft")
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["r"] == 2 and written["lora_dropout"] == 0.1
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * run.model.overrides["num_layers"]


def test_adapters_of_another_base_are_refused(tmp_path, builtin_tokenizer):
    """A resume whose base weights differ (here: another seed's) stops, naming both."""
    cfg = _config(**{"train.steps": 2})
    train(cfg, tmp_path)
    run = config_lib.parse_config(cfg)
    other = config_lib.parse_config(_config(**{"train.steps": 2}))
    other = type(other)(**{**other.__dict__, "seed": 1})  # another base: another seed's model
    mesh = builders.build_mesh(run)
    with pytest.raises(lora.BaseMismatchError, match="fingerprint"):
        builders.restore_policy(other, builtin_tokenizer, mesh, tmp_path / "checkpoints")
    gd, params, _ = builders.restore_policy(run, builtin_tokenizer, mesh, tmp_path / "checkpoints")
    assert gd is not None and params is not None


def test_export_keeps_a_users_config_and_peft_names_the_warm_started_base(tmp_path):
    """A PEFT export of a warm-started run writes the base beside the adapters and names it
    (it said null); an --out holding the user's own config.json is refused, not overwritten."""
    import os

    from grpo_jax.export import ExportError, export_hf
    from grpo_jax.models import from_pretrained

    cfg = _config(**{"warm_start.enabled": True, "train.steps": 1, "checkpoint.every": 1})
    train(cfg, tmp_path / "run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}\n')
    for format in ("merged", "peft"):
        with pytest.raises(ExportError, match="not an earlier export"):
            export_hf(tmp_path / "run", mine, format=format)
    assert [p.name for p in mine.iterdir()] == ["config.json"]
    assert (mine / "config.json").read_text() == '{"mine": 1}\n'

    out = export_hf(tmp_path / "run", tmp_path / "peft", format="peft")
    assert export_hf(tmp_path / "run", out, format="peft") == out  # an export may be redone
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str((out / "base").resolve())
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "adapter_model.safetensors").st_mode & 0o777 == 0o666 & ~umask
    # The base written beside the adapters is the warm-started one the adapters were trained on.
    run = config_lib.parse_config(cfg)
    mesh = builders.build_mesh(run)
    tok = builders.build_tokenizer(run, tmp_path / "run")
    _, policy, lora_run = builders.restore_policy(run, tok, mesh, tmp_path / "run" / "checkpoints")
    base = nnx.merge(lora_run.base_graphdef, lora.split(policy)[0])
    tokens = np.random.default_rng(0).integers(4, 30, (2, 6)).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(from_pretrained(written["base_model_name_or_path"])(tokens)),
        np.asarray(base(tokens)),
        atol=1e-6,
    )
