r"""The CPU default: a tiny model learns reversed-digit addition, warm start then GRPO.

    python -m grpo_jax.main --config=configs/default.py --workdir=/tmp/grpo_tiny

A ~0.8M-parameter Qwen2-style model with the project's character tokenizer
on synthetic 3-digit addition whose solution writes every number least
significant digit first ("123+459=" -> "<think>321+954=285</think>
<answer>285</answer>"). A supervised warm start on worked solutions runs
until greedy validation pass@1 reaches ``warm_start.target_pass_at_1``
(cached in the workdir); GRPO then sees only prompts and reference answers
and learns from the exact-match and format rewards. summary.json holds greedy
pass@1 on 512 held-out problems before and after GRPO.

Variants (``--config=configs/default.py:<arg>``):
  smoke   seconds, for tests: a smaller model, a few steps, small evaluations.

Override anything, e.g. ``--config.seed=1 --config.grpo.beta=0.04
--config.rewards=exact_match:1.0,format:0.2``.
"""

from ml_collections import ConfigDict


def get_config(arg: str | None = None) -> ConfigDict:
    c = ConfigDict()
    c.seed = 0

    # Any grpo_jax.models.ModelConfig field overrides tiny_config's; path loads
    # a Hugging Face checkpoint instead.
    c.model = ConfigDict(
        dict(
            path="",
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            mlp_dim=384,
            max_position_embeddings=128,
        )
    )
    c.tokenizer = "builtin"
    c.data = ConfigDict(
        dict(
            source="synthetic",
            task="arithmetic",
            n_operands=2,
            min_digits=3,
            max_digits=3,
            ops="+",
            reverse_digits=True,
            n_train=20_000,
            n_test=512,
        )
    )
    # The data seed follows the run seed (a FieldReference: --config.seed moves both).
    c.data.seed = c.get_ref("seed")
    c.prompt = ConfigDict(dict(template="{prompt}", chat=False, system=""))
    c.rewards = "exact_match:1.0,format:0.1"
    c.correct_reward = "exact_match"

    c.grpo = ConfigDict(
        dict(
            G=8,
            beta=0.0,
            epsilon=0.2,
            mu=1,
            kl_estimator="k3",
            reduction="grpo",
            advantage_estimator="grpo",
            advantage_eps=1e-4,
            temperature=1.0,
        )
    )
    c.sampling = ConfigDict(dict(max_new_tokens=56, top_k=0, top_p=1.0, prompt_buckets=(16, 32)))
    c.optim = ConfigDict(
        dict(
            learning_rate=2e-4,
            schedule="constant",
            warmup_steps=5,
            end_lr_factor=0.0,
            b1=0.9,
            b2=0.99,
            eps=1e-8,
            weight_decay=0.0,
            max_grad_norm=1.0,
            grad_accum=1,
        )
    )
    c.train = ConfigDict(
        dict(
            steps=200,
            batch_size=32,
            minibatch_size=0,
            log_every=1,
            samples_every=25,
            num_samples_logged=4,
            max_nonfinite_in_row=5,
            no_signal_steps=10,
            track_update=True,
            update_kl_warn=0.05,
            reward_timeout_s=5.0,
        )
    )
    c.eval = ConfigDict(
        dict(
            every=50,
            at_start=True,
            num_problems=512,
            batch_size=256,
            num_samples=0,
            k=4,
            temperature=1.0,
            split="test",
        )
    )
    c.checkpoint = ConfigDict(dict(every=50, keep=2, async_save=True))
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1, num_devices=0, layout="fsdp"))
    c.warm_start = ConfigDict(
        dict(
            enabled=True,
            max_steps=3000,
            min_steps=0,
            target_pass_at_1=0.25,
            eval_every=50,
            val_problems=256,
            batch_size=64,
            learning_rate=1e-3,
            warmup_steps=20,
            weight_decay=0.0,
            max_grad_norm=1.0,
            cache=True,
        )
    )

    if arg == "smoke":
        c.model.update(
            dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
        )
        c.data.update(dict(min_digits=1, max_digits=2, n_train=400, n_test=32))
        c.sampling.max_new_tokens = 48
        c.train.update(dict(steps=3, batch_size=4, samples_every=2))
        c.grpo.G = 4
        c.eval.update(dict(every=2, num_problems=16, batch_size=16, num_samples=4, k=2))
        c.checkpoint.every = 2
        c.warm_start.update(
            dict(max_steps=4, eval_every=2, val_problems=16, batch_size=8, target_pass_at_1=1.0)
        )
        c.mesh.num_devices = 1
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of configs/default.py; known: 'smoke'")
    return c
