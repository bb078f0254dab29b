"""The parameter tensors of a model and what one device holds of each under a layout.

The inventory behind the memory plan (``grpo_jax.run.memory``): every parameter tensor is
read, with its shape, dtype and logical axis names, from the model itself (an abstract
``grpo_jax.models.Transformer`` built by ``nnx.eval_shape``, nothing allocated), and
sharded by the layout's rules (``grpo_jax.core.sharding.LAYOUTS``) the way
``grpo_jax.models.param_shardings`` shards it: a dimension is split over its mesh axes
only when they divide it. LoRA adapters are derived from the tensors they adapt.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

from grpo_jax.core.sharding import LAYOUTS, logical_to_spec
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.transformer import Transformer

# The sizes a model config must have (any other ModelConfig field is optional).
MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "tie_embeddings",
)


def _model_sizes(cfg) -> dict:
    missing = [f for f in MODEL_FIELDS if not hasattr(cfg, f)]
    if missing:
        raise TypeError(
            f"memory.estimate needs a model config with {list(MODEL_FIELDS)}; "
            f"{type(cfg).__name__} lacks {missing}"
        )
    return {f: getattr(cfg, f) for f in MODEL_FIELDS}


def as_model_config(cfg):
    """``cfg`` as a ``grpo_jax.models.ModelConfig``.

    A ModelConfig is returned as it is. Any other object needs the fields of
    ``MODEL_FIELDS``; the ModelConfig fields it also has (qkv_bias, out_bias,
    mlp_bias, qk_norm, sandwich_norm, activation, family, ...) are taken
    over, the rest keep their defaults (switches off, family "llama").
    """
    if isinstance(cfg, ModelConfig):
        return cfg
    _model_sizes(cfg)
    fields = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(ModelConfig)
        if hasattr(cfg, f.name)
    }
    fields.setdefault("family", "llama")
    return ModelConfig(**fields)


@functools.lru_cache(maxsize=16)
def _model_params(cfg) -> tuple[tuple[str, tuple[int, ...], str, tuple[str | None, ...]], ...]:
    from flax import nnx

    # Abstract: shapes, dtypes and metadata only, no parameter is allocated.
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return tuple(
        (
            ".".join(str(k) for k in path),
            tuple(v.shape),
            str(v.dtype),
            tuple(v.get_metadata().get("logical_axes") or ()),
        )
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    )


def param_tensors(cfg) -> list[tuple[str, tuple[int, ...], str, tuple[str | None, ...]]]:
    """(name, shape, dtype, logical axes) of every parameter tensor of the model ``cfg`` builds.

    Read from the model itself: ``grpo_jax.models.Transformer`` built
    abstractly (``nnx.eval_shape``) from ``as_model_config`` of ``cfg``, each
    ``nnx.Param``'s shape, dtype and ``logical_axes`` metadata, named by its
    path ("embed", "layers.0.attn.q_proj", ...). A tied LM head is the
    embedding and appears once.
    """
    return list(_model_params(as_model_config(cfg)))


def param_count(cfg) -> int:
    """Number of parameters (a tied LM head counted once)."""
    return sum(math.prod(shape) for _, shape, _, _ in param_tensors(cfg))


def _ways(axes, mesh_shape: Mapping[str, int]) -> int:
    flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(mesh_shape.get(a, 1) for a in flat)  # an absent axis: size 1


def shard_numel(shape, logical_axes, mesh_shape: Mapping[str, int], layout: str) -> int:
    """Elements one device holds of a tensor with these logical axes under ``layout``.

    A dimension whose mesh axes do not divide it stays whole (replicated), as
    in ``grpo_jax.models.partitioning.fit_spec``.
    """
    spec = tuple(logical_to_spec(logical_axes, layout))
    n = 1
    for i, size in enumerate(shape):
        ways = _ways(spec[i] if i < len(spec) else None, mesh_shape)
        n *= size // ways if size % ways == 0 else size
    return n


def tensor_ways(size: int, logical: str, mesh_shape, layout: str) -> int:
    ways = _ways(LAYOUTS[layout].get(logical), mesh_shape)
    return ways if size % ways == 0 else 1


def lora_tensors(tensors, rank: int, targets) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(name, shape, logical axes) of the LoRA adapters of ``tensors`` (``param_tensors``).

    A projection W [*in, *out] (o_proj has two input dimensions, the others one;
    a stacked layer axis leads both) gets A [*in, r] and B [r, *out]. A mixture's expert
    weight [E, in, out] gets one adapter per expert, A [E, in, r] and B [E, r, out], split
    over the "experts" axis as the weight is.
    """
    out = []
    for name, shape, _, axes in tensors:
        proj = name.rsplit(".", 1)[-1]
        if proj not in targets:
            continue
        lead = 1 if axes and axes[0] == "layers" else 0
        lead += 1 if lead < len(axes) and axes[lead] == "experts" else 0
        n_in = lead + (2 if proj == "o_proj" else 1)
        out.append((f"{name}_lora_a", (*shape[:n_in], rank), (*axes[:n_in], "lora")))
        out.append(
            (
                f"{name}_lora_b",
                (*shape[:lead], rank, *shape[n_in:]),
                (*axes[:lead], "lora", *axes[n_in:]),
            )
        )
    return out
