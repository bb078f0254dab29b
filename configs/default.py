r"""The CPU default: a tiny model learns 3-digit addition, warm start then GRPO.

    python -m grpo_jax.main --config=configs/default.py --workdir=/tmp/grpo_tiny

A ~0.8M-parameter Qwen2-style model with the project's character tokenizer
(``grpo_jax.models.builtin_tokenizer``) on synthetic 3-digit addition with
every number written least significant digit first: "321+954=" is 123 + 459
and its answer "285" is 582. The completion is the bare answer.

Why reversed, operands too: each answer digit then comes after the digits
that carry into it (Lee et al. 2023), and, the model having rotary (relative)
positions, answer digit j sits at the same distance from operand digits j for
every j, so attention finds them at once. With the prompt in the usual order
the warm start sits on a long plateau and GRPO gains little; with only the
answer reversed the plateau is longer still. A small ``rope_theta`` (100)
gives the short sequences sharper positions.

1. Warm start: supervised next-token training on the answers until answers
   sampled at temperature 1 (what GRPO will see) are right for 15% of 256
   held-back training problems: a validation criterion, not a step count.
   Cached in <workdir>/warm_start.
2. GRPO (B = 32 prompts x G = 8 samples, clip 0.2, beta = 0, mu = 1, a
   small learning rate) sees prompts and reference answers only and learns
   from an exact-match reward and a digits-only format reward.

summary.json holds greedy pass@1 on 512 held-out problems (never trained on)
before and after GRPO, and the wall time.

Variants (``--config=configs/default.py:<arg>``):
  smoke   seconds, for tests: a smaller model, a few steps, small evaluations.

Override anything, e.g. ``--config.seed=1 --config.grpo.beta=0.04
--config.rewards=exact_match(tag=None):1.0``.
"""

from ml_collections import ConfigDict


def get_config(arg: str | None = None) -> ConfigDict:
    c = ConfigDict()
    c.seed = 0

    # Any grpo_jax.models.ModelConfig field overrides tiny_config's; a non-empty
    # path loads a Hugging Face checkpoint instead.
    c.model = ConfigDict()
    c.model.path = ""
    c.model.hidden_size = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 384
    c.model.rope_theta = 100.0
    c.model.max_position_embeddings = 64
    c.tokenizer = "builtin"

    c.data = ConfigDict()
    c.data.source = "synthetic"
    c.data.task = "arithmetic"
    c.data.n_operands = 2
    c.data.min_digits = 3
    c.data.max_digits = 3
    c.data.ops = "+"
    c.data.reverse_digits = True
    c.data.reverse_operands = True
    c.data.n_train = 20_000
    c.data.n_test = 512
    # The data seed follows the run seed (a FieldReference: --config.seed moves both).
    c.data.seed = c.get_ref("seed")

    c.prompt = ConfigDict()
    c.prompt.template = "{prompt}"
    c.prompt.chat = False
    c.prompt.system = ""

    # "name:weight,...": the completion is the bare answer, so exact match of the
    # whole completion, plus a small reward for writing digits only.
    c.rewards = "exact_match(tag=None):1.0,format(pattern='[0-9]+'):0.1"
    c.correct_reward = "exact_match(tag=None)"

    c.grpo = ConfigDict()
    c.grpo.G = 8
    c.grpo.beta = 0.0
    c.grpo.epsilon = 0.2
    c.grpo.mu = 1
    c.grpo.kl_estimator = "k3"
    c.grpo.reduction = "grpo"
    c.grpo.advantage_estimator = "grpo"
    c.grpo.advantage_eps = 1e-4
    c.grpo.temperature = 1.0

    c.sampling = ConfigDict()
    c.sampling.max_new_tokens = 6  # 4 digits + EOS, one slot to spare
    c.sampling.top_k = 0
    c.sampling.top_p = 1.0
    c.sampling.prompt_buckets = (9, 16, 32)

    c.optim = ConfigDict()
    c.optim.learning_rate = 2e-4
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 5
    c.optim.end_lr_factor = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.0
    c.optim.max_grad_norm = 1.0
    c.optim.grad_accum = 1

    c.train = ConfigDict()
    c.train.steps = 200
    c.train.batch_size = 32
    c.train.minibatch_size = 0
    c.train.log_every = 1
    c.train.samples_every = 25
    c.train.num_samples_logged = 4
    c.train.max_nonfinite_in_row = 5
    c.train.no_signal_steps = 10
    c.train.track_update = True
    c.train.update_kl_warn = 0.05
    c.train.reward_timeout_s = 5.0
    c.train.logits_chunk = 0  # Score all completion tokens at once (a 100-token vocabulary).

    c.eval = ConfigDict()
    c.eval.every = 50
    c.eval.at_start = True
    c.eval.num_problems = 512
    c.eval.batch_size = 256
    c.eval.num_samples = 8
    c.eval.k = 4
    c.eval.temperature = 1.0
    c.eval.split = "test"

    c.checkpoint = ConfigDict()
    c.checkpoint.every = 50
    c.checkpoint.keep = 2
    c.checkpoint.async_save = True

    c.mesh = ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.num_devices = 0
    c.mesh.layout = "fsdp"
    c.mesh.memory_budget_gb = 0.0  # 0: what the accelerator reports.

    c.warm_start = ConfigDict()
    c.warm_start.enabled = True
    c.warm_start.target = "answer"
    c.warm_start.max_steps = 3000
    c.warm_start.min_steps = 0
    # Stop when GRPO's own samples (temperature 1) are right 15% of the time: enough
    # groups with a correct sample to learn from. Greedy pass@1 is then higher.
    c.warm_start.metric = "sampled"
    c.warm_start.val_samples = 4
    c.warm_start.target_pass_at_1 = 0.15
    c.warm_start.eval_every = 10
    c.warm_start.val_problems = 256
    c.warm_start.batch_size = 64
    c.warm_start.learning_rate = 1e-3
    c.warm_start.warmup_steps = 20
    c.warm_start.weight_decay = 0.0
    c.warm_start.max_grad_norm = 1.0
    c.warm_start.cache = True

    if arg == "smoke":
        c.model.hidden_size = 32
        c.model.num_layers = 1
        c.model.num_heads = 2
        c.model.num_kv_heads = 1
        c.model.head_dim = 16
        c.model.mlp_dim = 64
        c.data.min_digits = 1
        c.data.max_digits = 2
        c.data.n_train = 400
        c.data.n_test = 32
        c.grpo.G = 4
        c.train.steps = 3
        c.train.batch_size = 4
        c.train.samples_every = 2
        c.eval.every = 2
        c.eval.num_problems = 16
        c.eval.batch_size = 16
        c.eval.num_samples = 4
        c.eval.k = 2
        c.checkpoint.every = 2
        c.warm_start.max_steps = 4
        c.warm_start.eval_every = 2
        c.warm_start.val_problems = 16
        c.warm_start.batch_size = 8
        c.warm_start.target_pass_at_1 = 1.0
        c.mesh.num_devices = 1
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of configs/default.py; known: 'smoke'")
    return c
