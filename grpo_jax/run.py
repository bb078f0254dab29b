"""A run's config, validated into frozen sections, and the objects it builds.

``parse_config(config)`` turns the ``ml_collections.ConfigDict`` of a
``configs/*.py`` file into a :class:`RunConfig` of frozen dataclasses,
failing at start-up on a misspelled key (naming it and the known keys) or a
bad value (naming the key, the value and what is allowed). The ``build_*``
helpers make what training and evaluation share: the mesh, the tokenizer,
the model, the datasets, the prompt encoder, the reward scorer.

Top-level keys of a run config:

  seed        the run's seed (model init, data order, sampling)
  model       path ("" = the built-in tiny model), dtype (compute),
              param_dtype (storage; default dtype), remat; for the tiny model
              also any ``grpo_jax.models.ModelConfig`` field (hidden_size, ...)
  tokenizer   "builtin" (the project's character tokenizer) or a Hugging
              Face tokenizer directory ("" = the model's directory)
  data        ``grpo_jax.data.load_dataset`` mapping
  prompt      template, chat, system (``grpo_jax.data.format_prompt``)
  rewards     "name:weight,..." or a mapping name -> weight
  grpo        ``grpo_jax.config.GRPOConfig`` (+ epsilon)
  sampling    max_new_tokens, top_k, top_p, prompt_buckets (the temperature
              is grpo.temperature: sampler and loss must agree)
  optim, train, eval, checkpoint, mesh   ``grpo_jax.train_config``
  warm_start  ``grpo_jax.sft.WarmStartConfig``
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Mapping
from typing import Any

import jax

from grpo_jax import data, rewards, sharding
from grpo_jax.config import (
    CheckpointConfig,
    ConfigError,
    EvalConfig,
    GRPOConfig,
    MeshConfig,
    OptimConfig,
    TrainConfig,
    WarmStartConfig,
    check_known_keys,
    from_mapping,
)
from grpo_jax.rollout import PromptEncoder, Scorer
from grpo_jax.sampling import SamplingConfig

log = logging.getLogger(__name__)

TOP_KEYS = (
    "seed",
    "model",
    "tokenizer",
    "data",
    "prompt",
    "rewards",
    "correct_reward",
    "grpo",
    "sampling",
    "optim",
    "train",
    "eval",
    "checkpoint",
    "mesh",
    "warm_start",
)
SAMPLING_KEYS = ("max_new_tokens", "top_k", "top_p", "prompt_buckets")
MODEL_KEYS = ("path", "dtype", "param_dtype", "remat")
BUILTIN_TOKENIZER = "builtin"


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """How an example becomes a prompt (``grpo_jax.data.format_prompt``).

    template: str.format template over the example's fields ("{prompt}").
    chat: wrap in the tokenizer's chat template.
    system: system message (chat) or preamble (plain); "" for none.
    """

    template: str = "{prompt}"
    chat: bool = False
    system: str = ""

    def __post_init__(self):
        if not isinstance(self.template, str) or "{" not in self.template:
            raise ConfigError(
                f"config key 'prompt.template' = {self.template!r} must be a format string "
                "over the example's fields, such as '{prompt}'"
            )
        if not isinstance(self.chat, bool):
            raise ConfigError(f"config key 'prompt.chat' = {self.chat!r} must be True or False")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int
    model: dict
    tokenizer: str
    data: dict
    prompt: PromptConfig
    rewards: tuple[rewards.RewardSpec, ...]
    correct_reward: str
    grpo: GRPOConfig
    sampling: dict
    optim: OptimConfig
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    mesh: MeshConfig
    warm_start: WarmStartConfig
    raw: dict  # The whole config as plain data (saved with checkpoints).


def _plain(x) -> dict:
    return x.to_dict() if hasattr(x, "to_dict") else dict(x)


def _split_top_level(text: str) -> list[str]:
    """Splits "a:1,b(x=1, y=2):0.5" at commas outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_rewards(value: Any) -> tuple[rewards.RewardSpec, ...]:
    """Parses the ``rewards`` key: "name:weight,..." or a mapping name -> weight.

    Names may carry options, "format(think_tag=None):0.1"; a missing weight is
    1.0. Both spellings are sweepable from the command line
    (``--config.rewards=exact_match:1.0,format:0.2``).
    """
    if isinstance(value, str):
        specs = []
        for item in _split_top_level(value):
            name, weight = item, "1.0"
            head, sep, tail = item.rpartition(":")
            if sep and ")" not in tail:
                name, weight = head, tail
            try:
                w = float(weight)
            except ValueError:
                raise ConfigError(
                    f"config key 'rewards' = {value!r}: weight {weight!r} of reward "
                    f"{name.strip()!r} is not a number (expected 'name:weight,...')"
                ) from None
            specs.append((name.strip(), w))
    elif hasattr(value, "items"):
        specs = [(str(k), v) for k, v in _plain(value).items()]
    else:
        raise ConfigError(
            f"config key 'rewards' = {value!r} must be a string 'name:weight,...' "
            "or a mapping of name to weight"
        )
    if not specs:
        raise ConfigError("config key 'rewards' names no reward function")
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"config key 'rewards' = {value!r} names a reward twice")
    out = tuple(rewards.RewardSpec(n, w) for n, w in specs)
    for s in out:
        rewards.get(s.name)  # An unknown name fails here, listing the available ones.
    return out


def parse_config(config) -> RunConfig:
    """Validates a run config (ConfigDict or mapping) into a :class:`RunConfig`."""
    raw = _plain(config)
    check_known_keys("config", raw, TOP_KEYS)
    missing = [k for k in ("data", "rewards") if k not in raw]
    if missing:
        raise ConfigError(f"config is missing the required key(s) {missing}")
    sampling = _plain(raw.get("sampling", {}))
    if "temperature" in sampling:
        raise ConfigError(
            "config key 'sampling.temperature' is not allowed: the sampling temperature is "
            "'grpo.temperature' (sampler and loss must score with the same one)"
        )
    check_known_keys("sampling", sampling, SAMPLING_KEYS)
    if "max_new_tokens" not in sampling:
        raise ConfigError("config key 'sampling.max_new_tokens' is required")
    model = _plain(raw.get("model", {}))
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"config key 'seed' = {seed!r} must be a non-negative integer")
    tokenizer = raw.get("tokenizer", BUILTIN_TOKENIZER)
    if not isinstance(tokenizer, str):
        raise ConfigError(f"config key 'tokenizer' = {tokenizer!r} must be a string")
    correct_reward = raw.get("correct_reward", "exact_match")
    rewards.get(correct_reward)
    run = RunConfig(
        seed=seed,
        model=model,
        tokenizer=tokenizer,
        data=_plain(raw["data"]),
        prompt=from_mapping(PromptConfig, "prompt", raw.get("prompt")),
        rewards=parse_rewards(raw["rewards"]),
        correct_reward=correct_reward,
        grpo=GRPOConfig.from_mapping(_plain(raw.get("grpo", {}))),
        sampling=sampling,
        optim=from_mapping(OptimConfig, "optim", raw.get("optim")),
        train=from_mapping(TrainConfig, "train", raw.get("train")),
        eval=from_mapping(EvalConfig, "eval", raw.get("eval")),
        checkpoint=from_mapping(CheckpointConfig, "checkpoint", raw.get("checkpoint")),
        mesh=from_mapping(MeshConfig, "mesh", raw.get("mesh")),
        warm_start=from_mapping(WarmStartConfig, "warm_start", raw.get("warm_start")),
        raw=json.loads(json.dumps(raw, default=str)),
    )
    # Probing the sampling section now names its bad values at start-up.
    sampling_config(run, eos_ids=(), pad_id=0)
    chunk, t = run.train.logits_chunk, run.sampling["max_new_tokens"]
    if chunk and t % chunk:
        raise ConfigError(
            f"config key 'train.logits_chunk' = {chunk} must divide "
            f"sampling.max_new_tokens = {t} (or be 0: no chunking)"
        )
    return run


def check_batch_layout(run: RunConfig, mesh) -> None:
    """Cross-section checks that need the mesh: whole groups and minibatches per shard."""
    shards = sharding.batch_shards(mesh)
    G, B = run.grpo.G, run.train.batch_size
    n = B * G
    if B % shards:
        raise ConfigError(
            f"config key 'train.batch_size' = {B} must be a multiple of the {shards} batch "
            "shards of the mesh (each shard holds whole groups)"
        )
    m = run.train.minibatch_size or n
    if n % m or m % shards:
        raise ConfigError(
            f"config key 'train.minibatch_size' = {run.train.minibatch_size} must divide "
            f"N = batch_size * G = {n} and be a multiple of the {shards} batch shards"
        )
    if (m // shards) % run.optim.grad_accum:
        raise ConfigError(
            f"config key 'optim.grad_accum' = {run.optim.grad_accum} must divide the "
            f"{m // shards} rows per shard of a minibatch"
        )
    ev = run.eval
    if ev.batch_size % shards:
        raise ConfigError(
            f"config key 'eval.batch_size' = {ev.batch_size} must be a multiple of the "
            f"{shards} batch shards"
        )
    if ev.num_samples and (
        ev.batch_size % ev.num_samples or (ev.batch_size // ev.num_samples) % shards
    ):
        raise ConfigError(
            f"config key 'eval.batch_size' = {ev.batch_size} must be a multiple of "
            f"eval.num_samples = {ev.num_samples} times the {shards} batch shards"
        )
    ws = run.warm_start
    if ws.enabled and ws.batch_size % shards:
        raise ConfigError(
            f"config key 'warm_start.batch_size' = {ws.batch_size} must be a multiple of the "
            f"{shards} batch shards"
        )


# ---------------------------------------------------------------------------
# Builders.


def build_mesh(run: RunConfig):
    devices = jax.devices()
    if run.mesh.num_devices:
        if run.mesh.num_devices > len(devices):
            raise ConfigError(
                f"config key 'mesh.num_devices' = {run.mesh.num_devices}, but only "
                f"{len(devices)} devices are available"
            )
        devices = devices[: run.mesh.num_devices]
    axes = {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "tensor": run.mesh.tensor}
    try:
        return sharding.make_mesh(axes, devices)
    except ValueError as e:
        raise ConfigError(f"config section 'mesh' = {axes}: {e}") from None


def build_tokenizer(run: RunConfig, workdir: str | pathlib.Path):
    """The tokenizer, always loaded through ``transformers.AutoTokenizer``.

    "builtin" saves the project's character tokenizer under
    ``<workdir>/tokenizer`` first (once), so a run directory is self-contained.
    """
    from transformers import AutoTokenizer

    from grpo_jax.models import builtin_tokenizer

    name = run.tokenizer
    if name == BUILTIN_TOKENIZER:
        path = builtin_tokenizer.ensure_tokenizer(pathlib.Path(workdir) / "tokenizer")
    else:
        path = pathlib.Path(name or run.model.get("path", ""))
        if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
            raise ConfigError(
                f"config key 'tokenizer' = {name!r}: no Hugging Face tokenizer files in {path}"
            )
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer at {path} has no EOS token; completions could not end")
    return tok


def model_config(run: RunConfig, tokenizer):
    """The tiny model's ``ModelConfig`` (``model.path`` empty) for ``tokenizer``.

    The vocabulary size and the special token ids come from the tokenizer (an
    exported model then stops where the tokenizer's EOS says).
    """
    from grpo_jax import models

    overrides = {k: v for k, v in run.model.items() if k not in MODEL_KEYS}
    fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
    check_known_keys("model", overrides, fields - {"vocab_size"})
    for key in ("dtype", "param_dtype", "remat"):
        if key in run.model:
            overrides[key] = run.model[key]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            overrides.setdefault(key, int(value))
    return models.tiny_config(len(tokenizer), **overrides)


def build_model(run: RunConfig, tokenizer, mesh):
    """(graphdef, params): the tiny model at ``seed`` or a Hugging Face checkpoint."""
    from flax import nnx

    from grpo_jax import models

    path = run.model.get("path", "")
    if path:
        if not hasattr(models, "from_pretrained"):
            raise ConfigError("config key 'model.path' needs grpo_jax.models.from_pretrained")
        extra = sorted(set(run.model) - set(MODEL_KEYS))
        if extra:
            raise ConfigError(
                f"config keys {[f'model.{k}' for k in extra]} only apply to the built-in tiny "
                f"model; model.path = {path!r} loads its architecture from config.json"
            )
        kw = {k: run.model[k] for k in ("dtype", "param_dtype", "remat") if k in run.model}
        model = models.from_pretrained(path, mesh=mesh, layout=run.mesh.layout, **kw)
    else:
        cfg = model_config(run, tokenizer)
        model = models.create_model(cfg, seed=run.seed, mesh=mesh, layout=run.mesh.layout)
    return nnx.split(model)


def build_datasets(run: RunConfig) -> dict[str, list[dict]]:
    splits = data.load_dataset(run.data)
    if "train" not in splits:
        raise ConfigError(f"the dataset has no 'train' split (splits: {sorted(splits)})")
    if run.eval.split not in splits:
        raise ConfigError(
            f"config key 'eval.split' = {run.eval.split!r} is not a split of the dataset "
            f"(splits: {sorted(splits)})"
        )
    return splits


def build_encoder(run: RunConfig, tokenizer) -> PromptEncoder:
    return PromptEncoder(
        tokenizer=tokenizer,
        template=run.prompt.template,
        chat=run.prompt.chat,
        system=run.prompt.system or None,
        buckets=tuple(sampling_config(run, eos_ids=(), pad_id=0).prompt_buckets),
    )


def build_scorer(run: RunConfig) -> Scorer:
    return Scorer(
        run.rewards, correct_reward=run.correct_reward, timeout_s=run.train.reward_timeout_s
    )


def sampling_config(
    run: RunConfig, *, eos_ids, pad_id, greedy: bool = False, temperature: float | None = None
) -> SamplingConfig:
    kw = dict(run.sampling)
    if "prompt_buckets" in kw:
        kw["prompt_buckets"] = tuple(kw["prompt_buckets"])
    return SamplingConfig(
        temperature=run.grpo.temperature if temperature is None else temperature,
        greedy=greedy,
        eos_ids=tuple(eos_ids),
        pad_id=pad_id,
        **kw,
    )


def tokenizer_sampling(run: RunConfig, tokenizer, **kw) -> SamplingConfig:
    eos = int(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    # An instruct checkpoint may end its turns with a token other than the tokenizer's
    # EOS (Gemma 3: <end_of_turn>), listed in generation_config.json: stop there too.
    extra = ()
    if run.model.get("path"):
        from grpo_jax.models.hf_config import generation_eos_ids

        extra = tuple(i for i in generation_eos_ids(run.model["path"]) if i != eos)
    return sampling_config(run, eos_ids=(eos, *extra), pad_id=int(pad), **kw)


def describe(run: RunConfig) -> Mapping[str, Any]:
    return run.raw
