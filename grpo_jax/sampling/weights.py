"""The sampler's own copy of the policy's weights in another dtype (``sampling.param_dtype``).

    w = sampler_weights(graphdef, params, "bfloat16")
    tokens = generate(w.graphdef, w(params), ...)

``w.graphdef`` is the policy's graph with its ``ModelConfig`` computing and storing in that
dtype; ``w.cast`` is one jitted cast of every floating ``nnx.Param``. The trained parameters
never change. docs/engine.md, "Sampling with a copy of the weights in another dtype", says
why (decoding's speed is the weights' bytes) and what the copy changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SamplerWeights:
    """A graphdef computing in ``dtype`` and the cast that makes its parameters.

    Attributes:
      graphdef: the policy's graph, its ``ModelConfig`` with ``dtype`` and
        ``param_dtype`` set to ``dtype``.
      dtype: the copy's dtype name ("bfloat16", "float16" or "float32").
      cast: jitted, params -> the copy (floating ``nnx.Param`` leaves in ``dtype``).
    """

    graphdef: object
    dtype: str
    cast: Callable

    def __call__(self, params):
        """``params`` as the copy: cast, unless every floating parameter already is."""
        if all(_is_cast(v, self.dtype) for v in _variables(params)):
            return params
        return self.cast(params)


def _variables(params):
    return jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _floating_param(v) -> bool:
    return isinstance(v, nnx.Param) and jnp.issubdtype(v.value.dtype, jnp.floating)


def _is_cast(v, dtype: str) -> bool:
    return not _floating_param(v) or v.value.dtype == jnp.dtype(dtype)


def _with_dtype(module_cfg: ModelConfig, dtype: str) -> ModelConfig:
    return dataclasses.replace(module_cfg, dtype=dtype, param_dtype=dtype)


def _cast_variable(v, dtype):
    return v.replace(v.value.astype(dtype)) if _floating_param(v) else v


def copy_dtype(requested: str, model_cfg) -> str | None:
    """The dtype of the sampler's copy: ``requested`` (``sampling.param_dtype``), or None when
    it is "" or the model already computes and stores in it (nothing to copy).

    ``model_cfg``: a ``ModelConfig`` or any object with ``dtype`` and ``param_dtype``
    (absent: float32, the memory plan's hand-written configs).
    """
    own = tuple(getattr(model_cfg, k, None) or "float32" for k in ("dtype", "param_dtype"))
    return requested if requested and own != (requested, requested) else None


def sampler_weights(graphdef, params, dtype: str) -> SamplerWeights:
    """The sampler's copy for ``(graphdef, params)`` (``nnx.split`` of the policy) in ``dtype``.

    ``params`` only lends the graph its structure (nothing is cast here).
    Raises ValueError when the graph holds no ``ModelConfig``: nothing would
    compute in ``dtype``.
    """
    model = nnx.merge(graphdef, params)
    replaced = 0
    for _, module in nnx.iter_modules(model):
        for name, value in list(vars(module).items()):
            if isinstance(value, ModelConfig):
                setattr(module, name, _with_dtype(value, dtype))
                replaced += 1
    if not replaced:
        raise ValueError("sampler_weights: the policy's graph holds no ModelConfig to set")
    new_graphdef, _ = nnx.split(model)
    dt = jnp.dtype(dtype)
    is_var = lambda x: isinstance(x, nnx.Variable)
    cast = jax.jit(lambda p: jax.tree.map(lambda v: _cast_variable(v, dt), p, is_leaf=is_var))
    return SamplerWeights(graphdef=new_graphdef, dtype=jnp.dtype(dtype).name, cast=cast)
