"""Tunix side of ``benchmarks/grpo_step.py``: GRPOLearner on CPU, timed per step.

Run by the driver with ``.bench_venvs/tunix/bin/python`` as

    python benchmarks/_grpo_step_tunix.py WORKLOAD.json

The checkpoint is loaded with Tunix's own safetensors loader on a one-device
("fsdp", "tp") mesh: the tiny Qwen2 models with
``tunix.models.qwen2.params.create_model_from_safe_tensors``, Gemma 3
(``model_type`` "gemma3_text", the 270M model) with
``tunix.models.gemma3.params_safetensors.create_model_from_safe_tensors``,
its ``ModelConfig`` built from config.json (which matches Tunix's own
``ModelConfig.gemma3_270m`` preset but for ``param_dtype``: float32 here,
as every system runs); the learner runs inside ``with mesh:`` (Tunix 0.1.7 fails
while sharding the optimizer under ``jax.set_mesh``). The actor, the rollout
model and (when beta > 0) the reference share the mesh, Tunix's colocated
setup. Rollout is Tunix's "vanilla" engine (its jitted KV-cache sampler).

One step (``num_iterations=1``, full-batch mini-batch) = sample B*G
completions, reward, advantages, one optimizer update; with
``num_iterations=1`` Tunix, like TRL, runs no separate old-policy forward.
Completions are forced to T tokens by an EOS id (-1) that no token has.
Steps are timed by wrapping the learner's ``_run_global_step`` and blocking
on the actor's parameters when it returns (Tunix dispatches asynchronously).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _grpo_step_common as common  # noqa: E402


def qwen2_config(checkpoint: str):
    from tunix.models.qwen2 import model as qwen2

    with open(os.path.join(checkpoint, "config.json")) as f:
        hf = json.load(f)
    heads = hf["num_attention_heads"]
    return qwen2.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf.get("rope_theta") or hf.get("rope_parameters", {}).get("rope_theta")),
        norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf.get("tie_word_embeddings", False),
    )


def gemma3_config(checkpoint: str):
    """Tunix's Gemma 3 ModelConfig of a Hugging Face gemma3_text config.json, float32."""
    import jax.numpy as jnp
    from tunix.models.gemma3 import model as gemma3

    with open(os.path.join(checkpoint, "config.json")) as f:
        hf = json.load(f)
    layers = hf["num_hidden_layers"]
    pattern = gemma3.GEMMA3_ATTENTION_PATTERN
    want = [
        "full_attention"
        if pattern[i % len(pattern)] == gemma3.AttentionType.GLOBAL
        else "sliding_attention"
        for i in range(layers)
    ]
    if hf.get("layer_types") and list(hf["layer_types"]) != want:
        raise RuntimeError(
            f"tunix: the checkpoint's layer_types {hf['layer_types']} differ from Tunix's "
            f"fixed Gemma 3 pattern {want}"
        )
    if hf.get("query_pre_attn_scalar", hf["head_dim"]) != hf["head_dim"]:
        raise RuntimeError("tunix: query_pre_attn_scalar != head_dim is not mapped here")
    rope = hf.get("rope_parameters") or {}
    global_theta = rope.get("full_attention", {}).get("rope_theta", hf.get("rope_theta"))
    local_theta = rope.get("sliding_attention", {}).get(
        "rope_theta", hf.get("rope_local_base_freq")
    )
    return gemma3.ModelConfig(
        num_layers=layers,
        num_embed=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        sliding_window_size=hf["sliding_window"],
        local_base_frequency=int(local_theta),
        global_base_frequency=int(global_theta),
        param_dtype=jnp.float32,
    )


def load_model(checkpoint: str, mesh):
    """The Tunix model of ``checkpoint`` (Qwen2 or Gemma 3), float32, on ``mesh``."""
    import jax.numpy as jnp

    with open(os.path.join(checkpoint, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    if model_type == "qwen2":
        from tunix.models.qwen2 import params as qwen2_params

        return qwen2_params.create_model_from_safe_tensors(
            checkpoint, qwen2_config(checkpoint), mesh
        )
    if model_type in ("gemma3_text", "gemma3"):
        from tunix.models.gemma3 import params_safetensors as gemma3_params

        return gemma3_params.create_model_from_safe_tensors(
            checkpoint, gemma3_config(checkpoint), mesh, dtype=jnp.float32
        )
    raise RuntimeError(f"tunix side: no loader for model_type {model_type!r}")


def main(path: str) -> None:
    wl = common.Workload.from_file(path)
    import grain
    import jax
    import numpy as np
    import optax
    import transformers
    from flax import nnx
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    devices = jax.devices()[:1]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1), ("fsdp", "tp"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(wl.checkpoint)

    with mesh:
        actor = load_model(wl.checkpoint, mesh)
        reference = load_model(wl.checkpoint, mesh) if wl.beta > 0 else None
        params = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.Param)))

        optimizer = optax.chain(
            optax.clip_by_global_norm(wl.max_grad_norm),
            optax.adamw(wl.learning_rate, b1=wl.b1, b2=wl.b2, eps=wl.adam_eps, weight_decay=0.0),
        )
        prompt_len = wl.prompt_len  # grpo_jax's smallest prompt bucket
        roles = {rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.ROLLOUT: mesh}
        if reference is not None:
            roles[rl_cluster_lib.Role.REFERENCE] = mesh
        cluster_config = rl_cluster_lib.ClusterConfig(
            role_to_mesh=roles,
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optimizer,
                eval_every_n_steps=10**9,
                max_steps=wl.total_steps,
                pbar_description=None,
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=wl.T,
                max_prompt_length=prompt_len,
                kv_cache_size=prompt_len + wl.T,
                temperature=wl.temperature,
                top_p=1.0,
                top_k=None,
                eos_tokens=[-1],
                # A jax.Array seed is donated by the sampler and dies after one step;
                # an int becomes PRNGKey(seed) afresh on every call.
                seed=wl.seed,
            ),
        )
        cluster = rl_cluster_lib.RLCluster(
            actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=cluster_config
        )
        algo = grpo_learner.GRPOConfig(
            num_generations=wl.G,
            num_iterations=1,
            beta=wl.beta,
            epsilon=wl.epsilon,
            loss_algo="grpo",
        )

        def digit_fraction(prompts, completions, **_):
            return [common.digit_fraction(c) for c in completions]

        learner = grpo_learner.GRPOLearner(
            rl_cluster=cluster, algo_config=algo, reward_fns=[digit_fraction]
        )

        tokens_per_step: list[int] = []
        sample_s: list[float] = []
        # Returns host token lists, so the sampling is finished when it returns.
        generate = common.timed(cluster.generate, sample_s)

        def counting_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            tokens_per_step.append(sum(len(t) for t in out.tokens))
            return out

        cluster.generate = counting_generate

        clock = common.StepClock()
        run_global_step = learner._run_global_step

        def timed_global_step(*args, **kwargs):
            if clock.t0 is None:
                clock.start()
            out = run_global_step(*args, **kwargs)
            jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))
            clock.tick()
            return out

        learner._run_global_step = timed_global_step

        rows = common.workload_prompts(wl)
        train_ds = (
            grain.MapDataset.source(rows)
            .batch(wl.B)
            # Arrays, not lists: the learner np.repeat()s every leaf G times.
            .map(lambda b: {"prompts": np.asarray(b["prompt"]), "answer": np.asarray(b["answer"])})
        )
        learner.train(train_ds, None)

    want = wl.B * wl.G * wl.T
    if len(tokens_per_step) != wl.total_steps or any(n != want for n in tokens_per_step):
        raise RuntimeError(
            f"tunix: completion tokens per step {tokens_per_step}, expected "
            f"{wl.total_steps} steps of {want}"
        )
    from importlib.metadata import version

    import tunix  # noqa: F401  (version for the record)

    common.emit(
        common.summarize(
            wl,
            clock,
            params=params,
            completion_tokens_per_step=tokens_per_step,
            sample_s_per_step=sample_s,
            extra={
                "versions": {"google-tunix": version("google-tunix"), "jax": jax.__version__},
                "devices": len(devices),
            },
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
