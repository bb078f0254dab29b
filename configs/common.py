"""The base every run config starts from, and the parsing of a config's argument.

Each ``configs/*.py`` file loads this module with
``common = grpo_jax.cli.config_module("common", beside=__file__)`` (a config file is
loaded by its path, so its folder need not be importable), calls :func:`base` and sets
only what its run changes; :func:`parse_arg` reads the ``:arg`` of ``--config=configs/x.py:arg``
("model=qwen3-0.6b,runlocal") into typed values, and every config file has a
``runlocal`` variant: the same run, shrunk to seconds or a minute on a CPU.
A config file only describes a run: files a variant needs (a tiny checkpoint,
synthetic data) are named by "tiny:..." values that the library makes when the
run starts (``grpo_jax.run.runlocal``).

The keys, their defaults and their meaning are the dataclasses' of
``grpo_jax.run.config`` (each section's docstring): :func:`base` builds every section
from those typed defaults, so a default is stated once, in the library.
"""

from __future__ import annotations

import dataclasses
import typing

from ml_collections import ConfigDict, config_dict

from grpo_jax.objective.config import EPSILON
from grpo_jax.run.config import (
    BUILTIN_TOKENIZER,
    CheckpointConfig,
    EnvSection,
    EvalConfig,
    GRPOConfig,
    HealthConfig,
    JudgeSection,
    LoRAConfig,
    MeshConfig,
    ModelSection,
    OptimConfig,
    PromptConfig,
    RewardModelSection,
    SamplingSection,
    TeacherConfig,
    TrainConfig,
    WarmStartConfig,
)


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


def section(cls, *, leave_out=(), **changes) -> ConfigDict:
    """The typed defaults of the dataclass ``cls`` as a ConfigDict, ``changes`` applied.

    Every field is a key, so each can be set on the command line
    (``--config.train.steps=50``); a field whose value is None is a typed placeholder
    (``config_dict.placeholder``), which the command line may set too. ``leave_out``:
    fields that are not keys of the section.
    """
    hints = typing.get_type_hints(cls)
    out = ConfigDict()
    for f in dataclasses.fields(cls):
        if f.name in leave_out:
            continue
        if f.name in changes:
            value = changes[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            continue  # no default: the config file's own (sampling.max_new_tokens)
        if dataclasses.is_dataclass(value):
            value = section(type(value))
        elif value is None:
            kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
            value = config_dict.placeholder(kinds[0])
        out[f.name] = value
    return out


def base() -> ConfigDict:
    """Every section with the library's defaults (the dataclasses of ``grpo_jax.run.config``);
    model.path, data, prompt, rewards and sampling.max_new_tokens are each config file's own.

    What this base states beyond the typed defaults, and why: ``grpo.epsilon`` (the run
    config's key for both clip sides, which stay unset and inherit it) and
    ``model.lora.targets`` as a comma-separated string (what the command line writes).
    """
    c = ConfigDict()
    c.seed = 0
    # Modules or .py files whose import registers your own reward functions
    # ("my_pkg.rewards,/path/rewards.py"); their names may then appear in `rewards`.
    c.reward_modules = ""
    c.tokenizer = BUILTIN_TOKENIZER
    # model.path "" is the built-in tiny model; docs/lora.md for model.lora.
    lora_targets = ",".join(LoRAConfig().targets)
    c.model = section(ModelSection, leave_out=("overrides",))
    c.model.lora = section(LoRAConfig, targets=lora_targets)
    c.prompt = section(PromptConfig)
    # The clip range of both sides; epsilon_low / epsilon_high (DAPO's clip-higher:
    # epsilon_high = 0.28) set one side on its own.
    c.grpo = section(GRPOConfig, epsilon_low=None, epsilon_high=None)
    c.grpo.epsilon = EPSILON
    c.sampling = section(SamplingSection)
    c.optim = section(OptimConfig)
    c.train = section(TrainConfig)
    c.eval = section(EvalConfig)
    c.checkpoint = section(CheckpointConfig)
    c.mesh = section(MeshConfig)
    c.warm_start = section(WarmStartConfig)
    # Training-health alarms: the thresholds' meaning is HealthConfig's docstring
    # (--config.health.entropy_floor=0.05, --config.health.stop_on_alarm=True).
    c.health = section(HealthConfig)
    # Multi-turn rollouts with an environment (docs/multiturn.md); name "" is single-turn.
    c.env = section(EnvSection)
    # A learned reward beside `rewards` (docs/learned_rewards.md); path "" is none.
    c.reward_model = section(RewardModelSection)
    # An LLM judge's expected score beside them; path "" is none, "reference" the reference.
    c.judge = section(JudgeSection)
    # On-policy distillation: path "" is none, "reference" the reference (docs/objective.md).
    c.teacher = section(TeacherConfig)
    return c
