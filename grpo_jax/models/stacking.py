"""A model's parameters between the two layouts: one entry per layer, or stacked for a scan.

``stack_layers`` turns an unrolled model's ``layers.<i>.<rest>`` into a scanned
model's ``layers.<rest>`` with a leading [L] axis (logical axis "layers");
``unstack_layers`` is its inverse. Below ``transformer`` and ``lora`` (both use them),
importing neither.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def stack_layers(params, num_layers: int):
    """Parameters of an unrolled model (``layers.<i>.<rest>``) as a scanned model's
    (``layers.<rest>`` with a leading [L] axis, logical axis "layers")."""
    flat, groups = {}, {}
    for path, v in nnx.to_flat_state(params):
        if path[0] == "layers":
            groups.setdefault(path[2:], {})[int(path[1])] = v
        else:
            flat[path] = v
    for rest, by_layer in groups.items():
        if sorted(by_layer) != list(range(num_layers)):
            raise ValueError(
                f"stack_layers: layers.*.{'.'.join(map(str, rest))} found for layers "
                f"{sorted(by_layer)}, expected 0..{num_layers - 1}"
            )
        first = by_layer[0]
        axes = ("layers", *(first.get_metadata().get("logical_axes") or ()))
        stacked = jnp.stack([by_layer[i].get_value() for i in range(num_layers)])
        flat[("layers", *rest)] = first.replace(stacked, logical_axes=axes)
    return nnx.from_flat_state(flat)


def unstack_layers(params, num_layers: int):
    """Inverse of :func:`stack_layers`: a scanned model's parameters as an unrolled model's."""
    flat = {}
    for path, v in nnx.to_flat_state(params):
        if path[0] != "layers":
            flat[path] = v
            continue
        axes = tuple(v.get_metadata().get("logical_axes") or ())[1:]
        value = v.get_value()
        for i in range(num_layers):
            flat[("layers", i, *path[1:])] = v.replace(value[i], logical_axes=axes)
    return nnx.from_flat_state(flat)
