"""A LoRA run with adapters on the experts of tiny:qwen3_moe (docs/lora.md, "The experts"):
it trains the expert adapters, a killed run resumes exactly, the checkpoint holds the adapters
only, the merged export gives the policy's logits, and the PEFT export is refused in one
line."""

import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from helpers_config import SHORT_RUN, smoke_config
from helpers_jit import logits as jitted_logits
from helpers_resume import resumes_exactly

from grpo_jax.models import lora
from grpo_jax.run import builders, runlocal
from grpo_jax.run import config as config_lib
from grpo_jax.run.checkpoints import Checkpointer

pytestmark = pytest.mark.slow  # three short runs of the whole loop

# The smoke config's sizes are the built-in model's; tiny:qwen3_moe brings its own.
BUILTIN_SIZES = (
    "head_dim", "hidden_size", "max_position_embeddings", "mlp_dim", "num_heads",
    "num_kv_heads", "num_layers", "rope_theta",
)  # fmt: skip


def _config():
    c = smoke_config(
        **SHORT_RUN,
        **{
            "grpo.beta": 0.04,
            "optim.learning_rate": 1e-2,
            # Half of the completions hold a digit below 5: reward variance in the groups.
            "rewards": "exact_match(tag=None):1.0,format(pattern='.*[0-4].*'):0.5",
            "model.lora.rank": 2,
            "model.lora.alpha": 4.0,
            "model.lora.dropout": 0.1,
            "model.lora.targets": "q,v,experts",
        },
    )
    for key in BUILTIN_SIZES:
        if key in c.model:
            del c.model[key]
    c.model.path = "tiny:qwen3_moe"
    return c


def test_expert_adapters_train_resume_exactly_and_export_merged(tmp_path):
    cfg = _config()
    whole = resumes_exactly(cfg, tmp_path)
    assert whole[1]["train/kl"] == 0.0  # B starts at zero: the policy is the base

    run = runlocal.resolve(config_lib.parse_config(cfg))  # tiny:qwen3_moe's directory
    tok = builders.build_tokenizer(run, tmp_path / "whole")
    mesh = builders.build_mesh(run)
    _, fresh, lora_run = builders.build_policy(run, tok, mesh)
    adapters = lora.trainable(fresh)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(adapters)}
    assert {n for n in names if "_experts_lora_" in n} == {
        f"layers.0.mlp.{w}_experts_lora_{ab}" for w in ("gate", "up", "down") for ab in "ab"
    }
    ck = Checkpointer(tmp_path / "whole" / "checkpoints")
    meta = ck.restore_meta(4)
    saved = ck.restore_params(4, params_like=adapters)
    ck.close()
    assert meta["lora_base"] == lora_run.identity(lora.split(fresh)[0])
    assert {".".join(map(str, p)) for p, _ in nnx.to_flat_state(saved)} == names
    for (path, x), (_, y) in zip(
        nnx.to_flat_state(adapters), nnx.to_flat_state(saved), strict=True
    ):  # every adapter trained, the experts' included
        assert not np.array_equal(np.asarray(x.get_value()), np.asarray(y.get_value())), path

    # Merged export: W + s A B expert by expert, a plain Qwen3-MoE checkpoint.
    from grpo_jax.export import export_hf
    from grpo_jax.models import from_pretrained

    gd, policy, _ = builders.restore_policy(run, tok, mesh, tmp_path / "whole" / "checkpoints")
    tokens = np.random.default_rng(0).integers(4, 90, (2, 6)).astype(np.int32)
    ours = jitted_logits(nnx.merge(gd, policy), tokens)
    base = jitted_logits(nnx.merge(lora_run.base_graphdef, lora.split(policy)[0]), tokens)
    assert np.abs(ours - base).max() > 1e-4  # the adapters moved the policy off the base
    out = export_hf(tmp_path / "whole", tmp_path / "merged")
    np.testing.assert_allclose(jitted_logits(from_pretrained(out), tokens), ours, atol=1e-5)

    # PEFT's format cannot name the experts' stacked weights: one line, status 2, nothing written.
    peft = tmp_path / "peft"
    done = subprocess.run(
        [sys.executable, "-m", "grpo_jax.export", f"--workdir={tmp_path / 'whole'}",
         f"--out={peft}", "--format=peft"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr  # (the rest of stderr is the loader's log)
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "model.lora.targets" in line and "down_experts" in line and "--format=merged" in line
    assert not peft.exists() or not any(peft.iterdir())
