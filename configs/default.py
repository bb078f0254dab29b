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
  runlocal  seconds: a smaller model, a 20-step warm start that teaches the
            answer format, a few GRPO steps, small evaluations (tests use it);
            ``smoke`` is the same variant.
  moe       the model's MLPs as mixtures of 4 experts of half the MLP width, top 2 (as
            many active MLP parameters per token as the dense model; docs/moe.md). Combines
            with the others: ``runlocal,moe``.
  reward_model=DIR  GRPO on the reward model in DIR alone (raw score, weight 1);
            exact match and three shares of the bias (answers longer than the
            reference, right answers followed by anything, answers padded with
            zeros) are scored with weight 0 (docs/learned_rewards.md: the
            reward-hacking demonstration).

Override anything, e.g. ``--config.seed=1 --config.grpo.beta=0.04
--config.rewards=exact_match(tag=None):1.0``.
"""

from ml_collections import ConfigDict

from grpo_jax.cli import config_module

common = config_module("common", beside=__file__)


def get_config(arg: str | None = None) -> ConfigDict:
    a = common.parse_arg(
        arg, where="configs/default.py", runlocal=False, smoke=False, moe=False, reward_model=""
    )
    c = common.base()

    # Any grpo_jax.models.ModelConfig field overrides tiny_config's.
    c.model.hidden_size = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.mlp_dim = 384
    c.model.rope_theta = 100.0
    c.model.max_position_embeddings = 64

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

    # "name:weight,...": the completion is the bare answer, so exact match of the
    # whole completion, plus a small reward for writing digits only.
    c.rewards = "exact_match(tag=None):1.0,format(pattern='[0-9]+'):0.1"
    c.correct_reward = "exact_match(tag=None)"

    c.sampling.max_new_tokens = 6  # 4 digits + EOS, one slot to spare
    c.sampling.prompt_buckets = (9, 16, 32)

    c.optim.learning_rate = 2e-4
    c.optim.warmup_steps = 5

    c.train.steps = 200

    c.eval.num_problems = 512
    c.eval.num_samples = 8

    c.warm_start.enabled = True
    c.warm_start.target = "answer"
    c.warm_start.max_steps = 3000
    # Stop when GRPO's own samples (temperature 1) are right 15% of the time: enough
    # groups with a correct sample to learn from. Greedy pass@1 is then higher.
    c.warm_start.metric = "sampled"
    c.warm_start.target_pass_at_1 = 0.15
    c.warm_start.eval_every = 10

    if a.reward_model:
        # GRPO on a learned reward alone (docs/learned_rewards.md, the reward-hacking
        # demonstration): the reward model's raw score is the whole training reward; exact
        # match, weight 0, is still scored and is the pass rate the alarm watches.
        c.reward_model.path = a.reward_model
        c.reward_model.weight = 1.0
        c.reward_model.normalize = "none"
        c.reward_model.buckets = (16, 32)
        c.reward_model.batch_size = 128
        # Weight 0 too, the bias's shares: completions longer than their answer (the
        # labeller's taste), right answers followed by anything, answers padded with zeros
        # (the pairs' own examples of it).
        c.reward_modules = "grpo_jax.rewards.length_bias"
        c.rewards = (
            "exact_match(tag=None):0.0,longer_answer:0.0,padded_answer:0.0,trailing_zeros:0.0"
        )

    if a.runlocal or a.smoke:
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
        # A fixed 20 steps at a high learning rate: enough for the tiny model to answer in
        # the format (digits, then EOS; untrained, nearly every completion runs to
        # max_new_tokens and the truncation alarm fires), not to add: no pass@1 target.
        c.warm_start.max_steps = 20
        c.warm_start.min_steps = 20
        c.warm_start.target_pass_at_1 = 0.0
        c.warm_start.learning_rate = 1e-2
        c.warm_start.warmup_steps = 5
        c.warm_start.eval_every = 10
        c.warm_start.val_problems = 16
        c.warm_start.batch_size = 8
        c.mesh.num_devices = 1
    if a.moe:
        c.model.num_experts = 4
        c.model.experts_per_token = 2
        c.model.moe_mlp_dim = c.model.mlp_dim // 2
    return c
