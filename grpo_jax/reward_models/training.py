"""Training a reward model on preference pairs: the data, the Bradley-Terry loss, the export.

    pairs = grpo_jax.data.pairs.load_pairs("pairs.jsonl")   # [(prompt, chosen, rejected), ...]
    loss, acc = pair_loss(params, graphdef, batch, label=0)
    save_reward_model(model, "/out/rm", tokenizer=tok)   # transformers reads it, and we do

The loss is :func:`bradley_terry`'s; docs/learned_rewards.md, "Training one".
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.core import integrity
from grpo_jax.models import ModelConfig, Transformer
from grpo_jax.models.hf import param_path
from grpo_jax.models.hf_config_export import config_to_hf
from grpo_jax.models.safetensors_io import INDEX_FILE, write_checkpoint
from grpo_jax.reward_models.model import RewardModel, reward_table
from grpo_jax.sampling.static import pad_prompts


def bradley_terry(r_chosen_B: jax.Array, r_rejected_B: jax.Array) -> jax.Array:
    """mean(-log sigmoid(r_c - r_r)), computed as softplus(r_r - r_c) (no overflow).

    The Bradley-Terry model of a preference: P(chosen > rejected) = sigmoid(r_c - r_r), with
    r the reward model's score of prompt + response; per pair

        L = -log sigmoid(r_c - r_r) = softplus(r_r - r_c),
        dL/dr_c = -sigmoid(r_r - r_c) = -dL/dr_r.

    A pair counts as right (pairwise accuracy) when r_c > r_r.
    """
    return jnp.mean(jax.nn.softplus(r_rejected_B - r_chosen_B))


def encode_pairs(tokenizer, pairs, buckets) -> dict[str, np.ndarray]:
    """Tokens of prompt + chosen (rows 0..B-1) and prompt + rejected (rows B..2B-1),
    left-padded together to one bucket."""
    texts = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    tokens, mask = pad_prompts([list(x) for x in ids], pad_id=_pad_id(tokenizer), buckets=buckets)
    return {"tokens": tokens, "mask": mask}


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def pair_loss(params, graphdef, batch, label: int = 0):
    """(Bradley-Terry loss, pairwise accuracy) of a batch from :func:`encode_pairs`."""
    r_2B = nnx.merge(graphdef, params).scores(batch["tokens"], batch["mask"])[:, label]
    r_chosen, r_rejected = jnp.split(r_2B, 2)
    return bradley_terry(r_chosen, r_rejected), jnp.mean(r_chosen > r_rejected)


def from_causal_lm(lm: Transformer, num_labels: int = 1, seed: int = 0) -> RewardModel:
    """A reward model with ``lm``'s decoder (its LM head dropped) and a fresh random head."""
    rm = RewardModel(lm.config, num_labels, rngs=nnx.Rngs(seed), layout=lm.layout)
    backbone = dict(nnx.to_flat_state(nnx.state(lm, nnx.Param)))
    backbone.pop(("lm_head",), None)
    nnx.update(rm, nnx.from_flat_state(backbone))
    return rm


def save_reward_model(model: RewardModel, path, *, tokenizer=None) -> pathlib.Path:
    """Writes ``model`` as a Hugging Face ``*ForSequenceClassification`` directory.

    config.json (the family's architecture with ``ForSequenceClassification``,
    ``num_labels`` through ``id2label``, the tokenizer's pad id when the model
    names none), model.safetensors with the backbone's
    tensors under ``model.`` and ``score.weight``, the tokenizer's files, and
    SHA256SUMS of them all (``sha256sum -c`` reads it; the loader verifies it).
    transformers' ``AutoModelForSequenceClassification`` and
    :func:`~grpo_jax.reward_models.load_reward_model` load it.
    """
    cfg: ModelConfig = model.config
    dtype = jnp.dtype(cfg.param_dtype)
    config = config_to_hf(cfg, dtype=dtype.name)
    config["architectures"] = [
        config["architectures"][0].replace("CausalLM", "SequenceClassification")
    ]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
    if config.get("pad_token_id") is None and tokenizer is not None:
        # transformers scores a batch of more than one row only when it knows the pad id.
        config["pad_token_id"] = _pad_id(tokenizer)
    table = reward_table(cfg, model.num_labels)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    by_name = {e.hf_name: e for e in table}

    def produce(name):
        p, layer = param_path(by_name[name].path, cfg.scan_layers)
        value = np.asarray(jax.device_get(params[p][...]))
        return by_name[name].to_hf(value if layer is None else value[layer])

    directory = pathlib.Path(path)
    weights = write_checkpoint(directory, [(e.hf_name, e.hf_shape, dtype) for e in table], produce)
    written = {w.name for w in weights} | {"config.json"}
    if len(weights) > 1:
        written.add(INDEX_FILE)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        saved = tokenizer.save_pretrained(str(directory))  # transformers': the files written
        written |= {pathlib.Path(f).name for f in saved or () if pathlib.Path(f).is_file()}
    integrity.write_sums(directory, written)  # load_reward_model verifies them
    return directory
