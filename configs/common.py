"""The base every run config starts from, and the parsing of a config's argument.

Each ``configs/*.py`` file calls :func:`base` and sets only what its run
changes; :func:`parse_arg` reads the ``:arg`` of ``--config=configs/x.py:arg``
("model=qwen3-0.6b,runlocal") into typed values, and every config file has a
``runlocal`` variant: the same run, shrunk to seconds or a minute on a CPU.
A config file only describes a run: files a variant needs (a tiny checkpoint,
synthetic data) are named by "tiny:..." values that the library makes when the
run starts (``grpo_jax.runlocal``).

The keys and their meaning: docs/architecture.md and the dataclasses of
``grpo_jax/config.py``.
"""

from __future__ import annotations

import dataclasses

from ml_collections import ConfigDict, config_dict

from grpo_jax.config import EnvSection, HealthConfig


def parse_arg(arg: str | None, *, where: str, **defaults) -> ConfigDict:
    """ "model=qwen3-0.6b,runlocal" -> ConfigDict(model="qwen3-0.6b", runlocal=True).

    ``defaults`` names every allowed key with its default; a bare name sets a
    bool key to True; an unknown key fails naming ``where`` and the known keys.
    """
    out = ConfigDict(dict(defaults))
    for part in (p.strip() for p in (arg or "").split(",")):
        if not part:
            continue
        key, sep, value = (s.strip() for s in part.partition("="))
        if key not in defaults:
            raise ValueError(
                f"{where}: unknown argument {part!r} in {arg!r}; known: {sorted(defaults)}"
            )
        if isinstance(defaults[key], bool):
            if sep:
                raise ValueError(f"{where}: {key!r} is a flag and takes no value ({arg!r})")
            out[key] = True
        elif not sep:
            raise ValueError(f"{where}: {key!r} needs a value, '{key}=...' ({arg!r})")
        else:
            out[key] = value
    return out


def base() -> ConfigDict:
    """Every section with the library's defaults; model, data, prompt, rewards and
    sampling.max_new_tokens are each config file's own."""
    c = ConfigDict()
    c.seed = 0
    # Modules or .py files whose import registers your own reward functions
    # ("my_pkg.rewards,/path/rewards.py"); their names may then appear in `rewards`.
    c.reward_modules = ""

    c.model = ConfigDict()
    c.model.path = ""  # "" is the built-in tiny model.
    # None: the checkpoint's (float32 for the tiny model); param_dtype is the storage dtype
    # (a LoRA run's frozen base may be "bfloat16"), None: dtype's. remat recomputes each
    # layer in the backward pass (None: off).
    c.model.dtype = config_dict.placeholder(str)
    c.model.param_dtype = config_dict.placeholder(str)
    c.model.remat = config_dict.placeholder(bool)
    # "einsum" (reference), "blockwise" (memory linear in the context) or "dot_product".
    c.model.attention = "einsum"
    c.model.scan_layers = False  # True: the layers run as one scan (compile time flat in depth).
    # LoRA (docs/lora.md): adapters of this rank on a frozen base; 0 trains every parameter.
    c.model.lora = ConfigDict()
    c.model.lora.rank = 0
    c.model.lora.alpha = 16.0
    c.model.lora.dropout = 0.0
    c.model.lora.targets = "q,k,v,o,gate,up,down"  # names or regexes over q_proj, ..., down_proj
    c.tokenizer = "builtin"

    c.prompt = ConfigDict()
    c.prompt.template = "{prompt}"
    c.prompt.chat = False
    c.prompt.system = ""

    c.grpo = ConfigDict()
    c.grpo.G = 8
    c.grpo.beta = 0.0
    c.grpo.epsilon = 0.2
    # Each clip side on its own (DAPO's clip-higher: epsilon_high = 0.28); unset: epsilon.
    c.grpo.epsilon_low = config_dict.placeholder(float)
    c.grpo.epsilon_high = config_dict.placeholder(float)
    c.grpo.mu = 1
    c.grpo.kl_estimator = "k3"
    c.grpo.reduction = "grpo"
    c.grpo.advantage_estimator = "grpo"
    c.grpo.advantage_eps = 1e-4
    c.grpo.temperature = 1.0  # Sampling and loss temperature.
    # The policy term by name (docs/objective.md): clip, cispo, sapo, gmpo, clip_cov, kl_cov.
    c.grpo.policy_loss = "clip"
    c.grpo.dual_clip_c = config_dict.placeholder(float)  # > 1 bounds A < 0 terms; unset: off
    c.grpo.sapo_tau_pos = 1.0
    c.grpo.sapo_tau_neg = 1.05
    c.grpo.cov_frac = 2e-4
    c.grpo.cov_lb = 1.0
    c.grpo.cov_ub = 5.0
    c.grpo.kl_cov_coef = 1.0
    c.grpo.passk_k = 1  # k of the "passk" advantage estimator
    # Correction for sampling from q != pi_old (top-k/top-p/min-p, sampler precision):
    # "none", "tis" (weights min(pi_old/q, C)) or "mis" (weights outside [1/C, C] masked).
    c.grpo.behavior_correction = "none"
    c.grpo.behavior_level = "token"  # or "sequence"
    c.grpo.behavior_cap = 2.0  # C
    c.grpo.old_logps = "sampler"  # or "recompute": pi_old rescored by the update's own path

    c.sampling = ConfigDict()
    c.sampling.top_k = 0
    c.sampling.top_p = 1.0
    c.sampling.min_p = 0.0
    # Stop strings: a completion ends once it emits one's token encoding (kept in it).
    c.sampling.stop = ()

    c.optim = ConfigDict()
    c.optim.learning_rate = 3e-4
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.end_lr_factor = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.0
    c.optim.max_grad_norm = 1.0
    c.optim.grad_accum = 1

    c.train = ConfigDict()
    c.train.steps = 100
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
    c.train.logits_chunk = 0
    c.train.dynamic_sampling = False  # DAPO: keep groups whose rewards vary, draw more rounds
    c.train.max_sampling_rounds = 3
    c.train.sampled_tokens_budget = 0  # stop after this many sampled completion tokens (0: off)
    c.train.max_staleness = 0  # k >= 1: sample with parameters up to k updates old, pipelined
    c.train.compilation_cache_dir = ""  # a directory: compiled programs reused by relaunches

    c.eval = ConfigDict()
    c.eval.every = 50
    c.eval.at_start = True
    c.eval.num_problems = 500
    c.eval.batch_size = 256
    c.eval.num_samples = 0
    c.eval.k = 4
    c.eval.temperature = 1.0
    c.eval.split = "test"

    c.checkpoint = ConfigDict()
    c.checkpoint.every = 50
    c.checkpoint.keep = 2
    c.checkpoint.async_save = True
    c.checkpoint.resume_from = 0  # 0: the newest step
    c.checkpoint.allow_changed_config = False

    c.mesh = ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.num_devices = 0
    c.mesh.layout = "fsdp"
    c.mesh.memory_budget_gb = 0.0  # 0: what the accelerator reports.
    c.mesh.sampler_devices = 0  # > 0: a sampler mesh of these devices beside the learner's

    c.warm_start = ConfigDict()
    c.warm_start.enabled = False

    # Training-health alarms: the thresholds' defaults and meaning are HealthConfig's
    # (grpo_jax/config.py), listed here so that each can be set on the command line
    # (--config.health.entropy_floor=0.05, --config.health.stop_on_alarm=True).
    c.health = ConfigDict(dataclasses.asdict(HealthConfig()))

    # Multi-turn rollouts with an environment (docs/multiturn.md); name "" is single-turn.
    c.env = ConfigDict(dataclasses.asdict(EnvSection()))
    return c
