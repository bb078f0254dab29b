"""TRL side of ``benchmarks/grpo_step.py``: GRPOTrainer on CPU, timed per step.

Run by the driver with ``.bench_venvs/trl/bin/python`` as

    python benchmarks/_grpo_step_trl.py WORKLOAD.json

One GRPO step of TRL's ``GRPOTrainer`` (``num_iterations=1``,
``steps_per_generation=1``, ``per_device_train_batch_size = B*G``) is one
``transformers.generate`` of B*G completions, the reward, the advantages and
one AdamW update; with ``num_iterations=1`` TRL scores pi_old with the
detached current policy, so no extra old-policy forward runs (as in grpo_jax,
which records pi_old's log-probs while sampling). Every completion is forced
to T tokens with ``min_new_tokens=T`` (EOS suppressed until then).

Settings that differ from TRL's defaults, each to do the same work as the
other systems: ``use_cpu=True, bf16=False`` (float32 on CPU),
``gradient_checkpointing=False`` (nobody else recomputes activations),
``loss_type="grpo"`` (the paper's per-sequence mean), constant learning rate.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _grpo_step_common as common  # noqa: E402


def main(path: str) -> None:
    wl = common.Workload.from_file(path)
    import torch

    if wl.threads:
        torch.set_num_threads(wl.threads)
    import datasets
    import transformers
    import trl

    transformers.logging.set_verbosity_error()
    torch.manual_seed(wl.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(wl.checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(wl.checkpoint, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())

    rows = common.workload_prompts(wl)
    train = datasets.Dataset.from_list(rows)
    tokens_per_step: list[int] = []

    def digit_fraction(prompts, completions, completion_ids, **_):
        # Called once per step on the step's B*G completions: count their tokens here.
        tokens_per_step.append(sum(len(c) for c in completion_ids))
        return [common.digit_fraction(c) for c in completions]

    clock = common.StepClock()

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    args = trl.GRPOConfig(
        output_dir=os.path.join(os.path.dirname(path), "trl_out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=wl.B * wl.G,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=wl.G,
        num_iterations=1,
        max_completion_length=wl.T,
        generation_kwargs={"min_new_tokens": wl.T},
        temperature=wl.temperature,
        top_p=1.0,
        top_k=0,
        beta=wl.beta,
        epsilon=wl.epsilon,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=wl.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=wl.b1,
        adam_beta2=wl.b2,
        adam_epsilon=wl.adam_eps,
        max_grad_norm=wl.max_grad_norm,
        optim="adamw_torch",
        max_steps=wl.total_steps,
        shuffle_dataset=False,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        log_completions=False,
        disable_tqdm=True,
        seed=wl.seed,
        dataloader_num_workers=0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[digit_fraction],
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    # TRL generates through the model's own generate (no wrapper on one CPU process).
    sample_s: list[float] = []
    model.generate = common.timed(model.generate, sample_s)
    trainer.train()
    if len(tokens_per_step) != wl.total_steps:
        raise RuntimeError(
            f"trl: reward ran {len(tokens_per_step)} times, expected {wl.total_steps}"
        )
    want = wl.B * wl.G * wl.T
    if any(n != want for n in tokens_per_step):
        raise RuntimeError(
            f"trl: completion tokens per step {tokens_per_step}, expected {want} each"
        )
    common.emit(
        common.summarize(
            wl,
            clock,
            params=params,
            completion_tokens_per_step=tokens_per_step,
            sample_s_per_step=sample_s,
            extra={
                "versions": {"trl": trl.__version__, "torch": torch.__version__},
                "torch_threads": torch.get_num_threads(),
            },
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
