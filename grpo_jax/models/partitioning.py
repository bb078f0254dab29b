"""Logical-axis annotations of the model, and the shardings they give on a mesh.

Every parameter is an ``nnx.Param`` carrying ``logical_axes`` metadata, one name per
dimension; :func:`grpo_jax.core.sharding.logical_to_spec` maps the names to mesh axes under a
layout, and activations are constrained the same way when a mesh is set. A dimension its
mesh axes do not divide stays replicated (docs/models.md, "Sharding: logical axes").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.core.sharding import LAYOUTS, MESH_AXES, logical_to_spec


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sharding layout {layout!r}; known layouts are {sorted(LAYOUTS)}")


def fit_spec(spec: P, shape: Sequence[int], mesh_shape) -> P:
    """``spec`` with every dimension its mesh axes do not divide set to replicated; axes the
    mesh lacks (an "expert" axis of size 1 is left out of the mesh) are dropped."""
    out = []
    for i, axes in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if any(a not in mesh_shape for a in flat):
            flat = tuple(a for a in flat if a in mesh_shape)
            axes = flat[0] if len(flat) == 1 else (flat or None)
        ways = math.prod(mesh_shape[a] for a in flat)
        out.append(axes if flat and shape[i] % ways == 0 else None)
    return P(*out)


def logical_sharding(
    names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, layout: str = "fsdp"
) -> NamedSharding:
    """NamedSharding on ``mesh`` for an array whose dimensions carry logical ``names``."""
    return NamedSharding(mesh, fit_spec(logical_to_spec(names, layout), shape, mesh.shape))


def param_shardings(model_or_state, mesh: Mesh, layout: str = "fsdp"):
    """NamedShardings for the parameters, matching ``nnx.split(model)[1]``.

    Accepts a model, its (possibly abstract, ``nnx.eval_shape``) state, or any
    pytree of ``nnx.Param``; returns the same structure with each Param's value
    replaced by its NamedSharding, usable as ``out_shardings`` of ``jax.jit``
    and with ``jax.device_put``.
    """
    check_layout(layout)
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state

    def one(v):
        if not isinstance(v, nnx.Variable):
            return NamedSharding(mesh, P())
        names = v.get_metadata().get("logical_axes")
        return v.replace(logical_sharding(names or (), v.shape, mesh, layout))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def cache_logical_axes(stacked: bool = False) -> tuple[str | None, ...]:
    """Logical names of the KV-cache arrays: keys [B, Kh, S, Dh], values [B, Kh, Dh, S].

    One array per layer and kind (see ``Transformer.init_cache``); neither S
    nor Dh is ever sharded, so one tuple serves both. ``stacked``: a scanned
    model's cache, [B, L, Kh, S, Dh] / [B, L, Kh, Dh, S] (the layer axis whole).
    """
    return ("batch", None, "kv_heads", None, None) if stacked else ("batch", "kv_heads", None, None)


def cache_shardings(cache, mesh: Mesh, layout: str = "fsdp"):
    """NamedShardings for a KV cache from ``Transformer.init_cache`` (unrolled or scanned)."""
    check_layout(layout)
    return jax.tree.map(
        lambda x: logical_sharding(cache_logical_axes(x.ndim == 5), x.shape, mesh, layout), cache
    )


def constrain(x: jax.Array, names: Sequence[str | None], layout: str) -> jax.Array:
    """Sharding constraint on an activation, when a ("data", "fsdp", "tensor") mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    spec = fit_spec(logical_to_spec(names, layout), x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)
