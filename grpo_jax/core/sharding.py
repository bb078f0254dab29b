"""Device mesh, named axes and sharding rules.

One global ``jax.sharding.Mesh`` spans every device of every host, with axes ``data`` (batch
rows split, parameters replicated), ``fsdp`` (rows split and parameters and optimizer state
sharded, ZeRO-3) and ``tensor`` (Megatron-style, inside each layer). A layout's rules map
the model's logical axis names to mesh axes. Batches are split over ("data", "fsdp") with a
prompt's G completions on one shard, so group statistics need no communication
(README.md, "Choosing a layout"; docs/architecture.md, "Data flow").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
# Expert parallelism: a mixture of experts' expert dimension split over a fourth axis, which
# a mesh has only when it is larger than 1 (docs/moe.md). Rows are not split over it.
EXPERT_AXIS = "expert"

# Logical dimension names used by the models.
#   batch, length      activations
#   vocab              embedding rows / LM-head columns
#   embed              the model (residual) width
#   mlp                the feed-forward hidden width
#   heads, kv_heads    attention heads (query and key/value)
#   head_dim           per-head width (never sharded)
#   experts            a mixture of experts' experts (over "expert" where the mesh has it)
LAYOUTS: dict[str, dict[str, str | tuple[str, ...] | None]] = {
    "dp": {},
    "fsdp": {"embed": "fsdp", "experts": EXPERT_AXIS},
    "fsdp_tp": {
        "experts": EXPERT_AXIS,
        "embed": "fsdp",
        "mlp": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "vocab": "tensor",
    },
}
ACTIVATION_RULES = {"batch": BATCH_AXES}


def make_mesh(axes: Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A mesh with axes ("data", "fsdp", "tensor"), and "expert" last when its size is not 1.

    ``axes`` gives each axis's size; at most one may be -1, meaning "all the
    devices left". Missing axes have size 1. The product must equal the
    number of devices.
    """
    axes = dict(axes or {"data": -1})
    known_axes = (*MESH_AXES, EXPERT_AXIS)
    unknown = set(axes) - set(known_axes)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; known axes are {list(known_axes)}")
    names = known_axes if int(axes.get(EXPERT_AXIS, 1)) != 1 else MESH_AXES
    devices = list(jax.devices() if devices is None else devices)
    sizes = [int(axes.get(a, 1)) for a in names]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {axes}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh axis sizes must be positive or -1, got {axes}")
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh {axes} does not divide the {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, "
            f"but {len(devices)} are available"
        )
    try:
        device_array = mesh_utils.create_device_mesh(sizes, devices)
    except Exception:  # Non-TPU topologies and fake CPU devices: plain order.
        device_array = np.asarray(devices).reshape(sizes)
    return Mesh(device_array, names)


def logical_to_spec(
    names: Sequence[str | None] | None, layout: str | Mapping[str, object] = "fsdp"
) -> P:
    """PartitionSpec for a tensor whose dimensions carry these logical names."""
    if names is None:
        return P()
    rules = dict(LAYOUTS[layout] if isinstance(layout, str) else layout)
    rules.update(ACTIVATION_RULES)
    used: set[str] = set()
    spec = []
    for name in names:
        axis = rules.get(name) if name is not None else None
        flat = (axis,) if isinstance(axis, str) else tuple(axis or ())
        if any(a in used for a in flat):  # A mesh axis may shard one dimension only.
            axis = None
        used.update(flat if axis is not None else ())
        spec.append(axis)
    return P(*spec)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (batch) dimension split over ("data", "fsdp"); the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch dimension is split."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_group_layout(num_rows: int, G: int, mesh: Mesh) -> None:
    """Raises unless every batch shard holds whole groups of G rows."""
    shards = batch_shards(mesh)
    if num_rows % (shards * G):
        raise ValueError(
            f"{num_rows} rows cannot be split into {shards} batch shards of whole groups "
            f"of G={G}: make the number of prompts per step a multiple of {shards}"
        )


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's arrays live.

    Attributes:
      mesh: the learner's mesh (the only one without ``mesh.sampler_devices``).
      param_shardings, state_shardings: the parameters' and train state's.
      rows_B, rows_N: this host's rows of the global prompt (B) and completion
        (N = B * G) batches (all of them in one process).
      sampler_mesh: the sampler's own mesh (``mesh.sampler_devices``), else None.
    """

    mesh: Mesh
    param_shardings: Any
    state_shardings: Any
    rows_B: slice
    rows_N: slice
    sampler_mesh: Mesh | None = None


def on_mesh(jitted, mesh: Mesh | None):
    """``jitted`` called under ``mesh`` (:class:`OnMesh`); as it is without one."""
    return jitted if mesh is None else OnMesh(jitted, mesh)


class OnMesh:
    """A jitted function traced, lowered and called under ``jax.set_mesh(mesh)``.

    The models constrain their activations by logical axes (rows over the batch axes) and
    run Pallas kernels under ``shard_map`` only under a mesh with these axes
    (``grpo_jax.models.partitioning.constrain``); a function jitted with its arguments'
    shardings alone is traced without one. GSPMD then carries the parameters' fsdp
    sharding into the activations: each device computed every row of a scoring pass over
    part of the model width and all-reduced the whole result (a logits chunk of all 256
    rows of a step on every chip: docs/pods.md), and a Pallas kernel could not be
    partitioned at all. Other attributes are the jitted function's.

    A one-device mesh has nothing to lay out: there the function runs without the context,
    as before, because the constraints the context adds change XLA's fusions and with them
    the last bits of a float32 step (the default run's records and figures).
    """

    def __init__(self, jitted, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def _context(self):
        return contextlib.nullcontext() if self.mesh.size == 1 else jax.set_mesh(self.mesh)

    def __call__(self, *args, **kwargs):
        with self._context():
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self._context():
            return self.jitted.lower(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) for a pytree of arrays or of structs: what an
    Orbax restore is given to lay the arrays out (``grpo_jax.run.start``, the warm
    start's cache in ``grpo_jax.run.warm_start``)."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)
