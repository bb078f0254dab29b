"""Loading and saving Hugging Face checkpoints: config.json + safetensors.

``from_pretrained`` builds the model abstractly and places each parameter's shard straight
from the memory-mapped checkpoint tensor (``jax.make_array_from_callback``), so no full
second copy of the model exists on the host; ``save_pretrained`` streams config.json and
safetensors that transformers and vLLM load (docs/models.md, "Hugging Face checkpoints").
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from grpo_jax.models.config import DEFAULT_ATTENTION
from grpo_jax.models.hf_config import (
    checkpoint_dtype,
    config_from_hf,
    generation_eos_ids,
    read_config_json,
)
from grpo_jax.models.hf_config_export import config_to_hf
from grpo_jax.models.hf_weights import IGNORED_SUFFIXES, LM_HEADS, PREFIXES, weight_table
from grpo_jax.models.mxfp4 import with_mxfp4
from grpo_jax.models.partitioning import check_layout, param_shardings
from grpo_jax.models.safetensors_io import CheckpointError, SafetensorsCheckpoint, write_checkpoint
from grpo_jax.models.transformer import Transformer

log = logging.getLogger(__name__)


def _find_prefix(ckpt: SafetensorsCheckpoint, directory: pathlib.Path) -> tuple[str, str]:
    for prefix in PREFIXES:
        if f"{prefix}embed_tokens.weight" in ckpt:
            lm_head = next((h for h in LM_HEADS if h in ckpt), LM_HEADS[0])
            return prefix, lm_head
    some = sorted(ckpt.keys())[:5]
    raise CheckpointError(
        f"{directory}: missing tensor 'model.embed_tokens.weight' (the checkpoint's tensors "
        f"start {some})"
    )


def check_unused(ckpt, used: set[str], prefix: str, tied: bool, directory) -> None:
    """A text-model tensor the table does not use means the config and weights disagree."""
    unused = [
        k
        for k in ckpt.keys()
        if k not in used
        and (k.startswith(prefix) or k in LM_HEADS)
        and not k.endswith(IGNORED_SUFFIXES)
        and not (tied and k in LM_HEADS)  # Some tied checkpoints store the head anyway.
    ]
    if unused:
        raise CheckpointError(
            f"{directory}: {len(unused)} checkpoint tensor(s) not used by the model that "
            f"config.json describes, e.g. {sorted(unused)[:5]}; does config.json match the weights?"
        )


def open_checkpoint(path: str | os.PathLike, **fields):
    """(directory, config.json, ModelConfig, checkpoint, tensor prefix, LM-head name) of ``path``.

    ``fields`` override the config (dtype, remat, ...). The end-of-sequence ids
    are config.json's plus any more that generation_config.json lists.
    """
    directory = pathlib.Path(path)
    hf = read_config_json(directory)
    cfg = config_from_hf(hf, source=str(directory / "config.json"), **fields)
    eos = cfg.eos_token_ids + tuple(
        i for i in generation_eos_ids(directory) if i not in cfg.eos_token_ids
    )
    if eos != cfg.eos_token_ids:
        cfg = cfg.replace(eos_token_id=eos)
    ckpt = with_mxfp4(SafetensorsCheckpoint(directory))  # MXFP4 experts read dequantised
    prefix, lm_head = _find_prefix(ckpt, directory)
    return directory, hf, cfg, ckpt, prefix, lm_head


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    mesh: Mesh | None = None,
    layout: str = "fsdp",
    remat: bool = False,
    attention: str = DEFAULT_ATTENTION,
    scan_layers: bool = False,
) -> Transformer:
    """The model of a local Hugging Face checkpoint directory (nothing is downloaded).

    Args:
      path: directory with config.json and model.safetensors, or
        model.safetensors.index.json plus its shards.
      dtype: compute dtype (float32 or bfloat16).
      param_dtype: storage dtype of the parameters; default ``dtype``.
      mesh, layout: place each parameter directly in its ``layout`` sharding
        over ``mesh`` (default: the first device, unsharded).
      remat: rematerialise each layer in the backward pass.
      attention: the attention implementation (``ModelConfig.attention``).
      scan_layers: stack the layers' parameters and run them as a scan; the
        checkpoint's per-layer tensors are stacked as they are placed (each
        device reads its shard of every layer, nothing else).

    The end-of-sequence ids are config.json's plus any more that
    generation_config.json lists (instruct models' end-of-turn tokens).

    Raises CheckpointError naming the file and the problem: no directory or
    config.json, unsupported model_type or RoPE type, a truncated or corrupt
    safetensors file (naming the tensor), a missing tensor, a shape mismatch,
    or unused text-model tensors.
    """
    check_layout(layout)
    directory, hf, cfg, ckpt, prefix, lm_head = open_checkpoint(
        path,
        dtype=dtype,
        param_dtype=param_dtype if param_dtype is not None else dtype,
        remat=remat,
        attention=attention,
        scan_layers=scan_layers,
    )
    table = weight_table(cfg, prefix, lm_head)
    check_unused(ckpt, {e.hf_name for e in table}, prefix, cfg.tie_embeddings, directory)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), layout=layout))
    model = load_into(abstract, ckpt, table, directory, mesh=mesh, layout=layout)
    log.info("loaded %d tensors from %s (%s)", len(table), directory, checkpoint_dtype(hf))
    return model


def load_into(abstract: nnx.Module, ckpt, table, directory, *, mesh=None, layout="fsdp"):
    """``abstract`` (an ``nnx.eval_shape`` module) filled from ``ckpt`` through ``table``.

    Each parameter is placed straight into its ``layout`` sharding over ``mesh``
    (default: the first device); every parameter of the module must have an
    entry. Raises CheckpointError for a missing tensor or a shape mismatch.
    """
    scan_layers = abstract.config.scan_layers
    graphdef, abstract_state = nnx.split(abstract)
    if mesh is not None:
        shardings = dict(nnx.to_flat_state(param_shardings(abstract_state, mesh, layout)))
    variables = dict(nnx.to_flat_state(abstract_state))

    # Per parameter: (layer of a scanned model, expert) -> the tensor that fills that slice.
    views: dict[tuple, dict[tuple[int, ...], np.ndarray]] = {}
    for entry in table:
        if entry.hf_name not in ckpt:
            raise CheckpointError(
                f"{directory}: missing tensor {entry.hf_name!r} (for parameter "
                f"{'.'.join(map(str, entry.path))})"
            )
        if ckpt.shape(entry.hf_name) != entry.hf_shape:
            raise CheckpointError(
                f"{ckpt.file_of(entry.hf_name)}: tensor {entry.hf_name!r} has shape "
                f"{ckpt.shape(entry.hf_name)}, but config.json implies {entry.hf_shape}"
            )
        path, layer = param_path(entry.path, scan_layers)
        # Lazy view of the memory-mapped tensor.
        views.setdefault(path, {})[_slice_key(layer, entry)] = entry.to_param(ckpt[entry.hf_name])
    loaded = {}
    for path, by_layer in views.items():
        var = variables[path]
        sharding = (
            shardings[path].get_value()
            if mesh is not None
            else SingleDeviceSharding(jax.devices()[0])
        )
        array = jax.make_array_from_callback(
            tuple(var.shape), sharding, functools.partial(_read, by_layer, var.dtype)
        )
        loaded[path] = var.replace(array)
    if set(loaded) != set(variables):  # The table and the model must describe the same params.
        raise AssertionError(f"weight table misses {sorted(set(variables) - set(loaded))}")
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def param_path(table_path: tuple, scan_layers: bool) -> tuple[tuple, int | None]:
    """(the model's parameter path, layer or None) of a weight-table path.

    The table names each layer's tensors ``("layers", i, ...)``; a scanned
    model holds them stacked at ``("layers", ...)``, layer i at index i.
    """
    if scan_layers and table_path[0] == "layers":
        return ("layers", *table_path[2:]), int(table_path[1])
    return tuple(table_path), None


def _slice_key(layer: int | None, entry) -> tuple[int, ...]:
    """The leading indices (layer of a scanned model, expert) an entry's tensor fills."""
    return tuple(i for i in (layer, entry.expert) if i is not None)


def _read(by_key: dict, dtype, index: tuple) -> np.ndarray:
    """One device's shard ``index`` of a parameter from its checkpoint views, keyed by the
    leading indices they fill (``()``: the whole parameter; (layer,), (expert,) or
    (layer, expert): stacked slices)."""
    if () in by_key:
        return np.asarray(by_key[()][index], dtype=dtype)
    inner: dict[int, dict] = {}
    for key, view in by_key.items():
        inner.setdefault(key[0], {})[key[1:]] = view
    picks = range(len(inner))[index[0]]
    return np.stack([_read(inner[i], dtype, index[1:]) for i in picks])


def _to_host(x: jax.Array) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "B": 1,
    }
    s = size.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    raise ValueError(f"max_shard_size {size!r}: expected bytes or a string like '5GB'")


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    dtype=None,
    max_shard_size: int | str = "5GB",
    tokenizer=None,
) -> pathlib.Path:
    """Writes ``model`` as a Hugging Face checkpoint directory and returns its path.

    Files: config.json, generation_config.json, model.safetensors (or
    model-0000i-of-0000n.safetensors + model.safetensors.index.json above
    ``max_shard_size``), and the ``tokenizer``'s files when one is given.
    ``dtype`` is the saved weights' dtype (default: the parameters' dtype).
    Tensors go to the host one at a time; on several hosts every process
    must call this (the gathers are collective) and process 0 writes.
    """
    cfg = model.config
    save_dtype = jnp.dtype(dtype if dtype is not None else cfg.param_dtype)
    config = config_to_hf(cfg, dtype=save_dtype.name)
    directory = pathlib.Path(path)
    table = weight_table(cfg)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))

    def produce(name):
        path, layer = param_path(by_name[name].path, cfg.scan_layers)
        value = params[path][...]
        for i in _slice_key(layer, by_name[name]):
            value = value[i]
        return by_name[name].to_hf(_to_host(value))

    by_name = {e.hf_name: e for e in table}
    specs = [(e.hf_name, e.hf_shape, save_dtype) for e in table]
    if jax.process_index() != 0:
        for name, _, _ in specs:  # Take part in every collective gather, write nothing.
            produce(name)
        return directory
    write_checkpoint(directory, specs, produce, max_shard_bytes=_parse_size(max_shard_size))
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        k: config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config[k] is not None
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
