r"""Multi-turn GRPO on the CPU: the tiny model learns to find a hidden number from feedback.

    python -m grpo_jax.main --config=configs/multiturn.py --workdir=/tmp/grpo_guess

The environment ``guess_number`` (``grpo_jax/envs/guess_number.py``) hides a number
from 0 to 9 and opens with "guess 0-9:". Each model turn (at most 2 tokens, or up to
its EOS) is a guess; the environment answers "H" (higher), "L" (lower) or "?" (no
digit) and the model guesses again, up to 4 turns. Finding the number on turn k
scores 1 - (k-1)/4; not finding it scores 0. The whole exchange is one transcript:
the model's tokens carry the loss, the environment's are context only
(docs/multiturn.md).

The hidden number of an example is its synthetic-arithmetic answer mod 10 (a sum of
two one-digit numbers), so train and test episodes come from disjoint problems; the
model starts from random weights (no warm start), with the built-in character
tokenizer. summary.json holds the held-out greedy success rate ("pass_at_1") and the
sampled one before and after, and the wall time.

Variants (``--config=configs/multiturn.py:<arg>``):
  runlocal  seconds: a few steps and small evaluations (tests use it).
  moe       the model's MLPs as mixtures of 4 experts of half the MLP width, top 2
            (docs/moe.md); with ``--config.grpo.router_replay=rollout`` the episodes'
            routes, observation tokens' included, are replayed. Combines: ``runlocal,moe``.

Override anything, e.g. ``--config.seed=1 --config.env.max_turns=3``.
"""

from ml_collections import ConfigDict

from grpo_jax.cli import config_module

common = config_module("common", beside=__file__)


def get_config(arg: str | None = None) -> ConfigDict:
    a = common.parse_arg(arg, where="configs/multiturn.py", runlocal=False, smoke=False, moe=False)
    c = common.base()

    c.model.hidden_size = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16
    c.model.mlp_dim = 192
    c.model.rope_theta = 100.0
    c.model.max_position_embeddings = 64

    # The examples only carry the hidden numbers (answer mod 10).
    c.data = ConfigDict()
    c.data.source = "synthetic"
    c.data.task = "arithmetic"
    c.data.n_operands = 2
    c.data.min_digits = 1
    c.data.max_digits = 2
    c.data.ops = "+"
    c.data.n_train = 4000
    c.data.n_test = 256
    c.data.seed = c.get_ref("seed")

    c.env.name = "guess_number(low=0, high=9, max_turns=4)"
    c.env.max_turn_tokens = 2
    c.env.max_tokens = 16  # 4 turns of 2 tokens + 3 one-token answers, 5 to spare
    c.env.max_obs_tokens = 2
    c.env.timeout_s = 5.0

    # The episode's reward is the environment's; these name the single-turn scorer,
    # which an environment run does not use.
    c.rewards = "exact_match(tag=None):1.0"
    c.correct_reward = "exact_match(tag=None)"

    c.sampling.max_new_tokens = 16  # the warm start's targets; rows of episodes are env.max_tokens
    c.sampling.prompt_buckets = (16,)

    c.optim.learning_rate = 2e-3
    c.optim.warmup_steps = 5

    c.train.steps = 600
    c.train.batch_size = 16

    c.eval.every = 200
    c.eval.num_problems = 256
    c.eval.num_samples = 4

    c.checkpoint.every = 200
    c.mesh.num_devices = 1

    if a.runlocal or a.smoke:
        c.model.hidden_size = 32
        c.model.num_layers = 1
        c.model.num_heads = 2
        c.model.num_kv_heads = 1
        c.model.mlp_dim = 64
        c.data.n_train = 200
        c.data.n_test = 32
        c.grpo.G = 4
        c.train.steps = 3
        c.train.batch_size = 4
        c.train.samples_every = 2
        c.eval.every = 2
        c.eval.num_problems = 8
        c.eval.batch_size = 8
        c.eval.num_samples = 2
        c.eval.k = 2
        c.checkpoint.every = 2
    if a.moe:
        c.model.num_experts = 4
        c.model.experts_per_token = 2
        c.model.moe_mlp_dim = c.model.mlp_dim // 2
    return c
