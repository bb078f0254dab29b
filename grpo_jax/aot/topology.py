"""TPU slices by the names users give them, their chips' figures, and libtpu on a CPU host.

A user says ``v5e-16``, ``v5p-128`` (TensorCores: 64 chips), ``2xv5e-16`` (two slices) or a
topology string (``v5e:4x8``); :func:`parse_topology` maps the name to what
``jax.experimental.topologies.get_topology_desc`` takes (MaxText's table). ``CHIPS`` holds
the chips' public figures and ``hbm_limit``, the HBM the TPU compiler lets one program use.
Nothing here imports JAX at module level: the plan's refusals of an unknown topology, or of a
run that cannot fit, come before libtpu loads. docs/pods.md, "Topologies and chips".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

from grpo_jax.core.errors import ConfigError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip kind: peak bf16 FLOP/s, HBM bytes and bytes/s, ICI bytes/s (one
    direction), the compiler's HBM limit per program; ``source`` the page of the figures."""

    name: str
    device_kind: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    ici_bandwidth: float
    hbm_limit: float
    megacore: bool
    source: str


# The Cloud TPU pages' "16 GB" and "32 GB" of HBM are GiB, as the compiler's limits show.
# hbm_limit is read from the TPU compiler's own refusal of a larger program
# ("RESOURCE_EXHAUSTED: Ran out of memory on HBM ... exceeds available HBM (15.75G)").
CHIPS = {
    "v4": Chip(
        "v4", "TPU v4", 275e12, 32 * GiB, 1200e9, 300e9, 30.75 * GiB, True,
        "https://cloud.google.com/tpu/docs/v4 (ICI: 6 links of 400 Gbit/s each way)",
    ),
    "v5e": Chip(
        "v5e", "TPU v5 lite", 197e12, 16 * GiB, 819e9, 200e9, 15.75 * GiB, False,
        "https://cloud.google.com/tpu/docs/v5e (16 GB HBM, ICI 1600 Gbit/s)",
    ),
    "v5p": Chip(
        "v5p", "TPU v5", 459e12, 95 * GiB, 2765e9, 600e9, 95.74 * GiB, True,
        "https://cloud.google.com/tpu/docs/v5p (95 GiB HBM, ICI 4800 Gbit/s)",
    ),
    "v6e": Chip(
        "v6e", "TPU v6 lite", 918e12, 32 * GiB, 1640e9, 448e9, 31.25 * GiB, False,
        "https://cloud.google.com/tpu/docs/v6e (32 GB HBM, ICI 3584 Gbit/s)",
    ),
}  # fmt: skip

# The topology strings' prefixes (v5p's is "v5").
_PREFIX = {"v4": "v4", "v5e": "v5e", "v5p": "v5", "v6e": "v6e"}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}
# Chips -> slice shape (MaxText's table; the powers of two a user can ask for).
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
              128: (8, 16), 256: (16, 16)}  # fmt: skip
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
              128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16),
              2048: (8, 16, 16), 4096: (16, 16, 16)}  # fmt: skip
EXAMPLES = "v4-8, v5e-16, v5p-128, v6e-256, 2xv5e-16, v5e:4x8"


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice (or ``slices`` equal ones) of one chip kind, as ``get_topology_desc`` takes it."""

    name: str
    chip: Chip
    shape: tuple[int, ...]
    slices: int = 1

    @property
    def topology_name(self) -> str:
        return f"{_PREFIX[self.chip.name]}:{'x'.join(map(str, self.shape))}"

    @property
    def chip_config(self) -> str:
        return "megacore" if self.chip.megacore else "default"

    @property
    def chips(self) -> int:
        """Chips, that is devices (megacore: one device per chip), over all slices."""
        return math.prod(self.shape) * self.slices

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """The torus wrap-around of each axis (MaxText's table): 2D slices wrap a dimension
        of 16, 3D slices every dimension once each is at least 4 (a full cube)."""
        if len(self.shape) == 2:
            return (self.shape[0] == 16, self.shape[1] == 16, False)
        return (min(self.shape) >= 4,) * 3

    def describe(self) -> str:
        slices = f"{self.slices} slices of " if self.slices > 1 else ""
        return (
            f"{self.name}: {slices}{self.topology_name} ({self.chip_config}), "
            f"{self.chips} {self.chip.device_kind} chips"
        )


def parse_topology(name: str) -> Topology:
    """The :class:`Topology` a user's name means; a one-line ConfigError for any other."""
    text = str(name).strip().lower()
    slices = 1
    m = re.fullmatch(r"(\d+)\s*x\s*(.+)", text)
    if m:
        slices, text = int(m.group(1)), m.group(2)
    chip, shape = _parse_one(text, name)
    if slices < 1:
        raise ConfigError(f"--topology={name}: the number of slices must be at least 1")
    return Topology(name=str(name), chip=chip, shape=shape, slices=slices)


def _parse_one(text: str, name: str) -> tuple[Chip, tuple[int, ...]]:
    known = f"known forms: {EXAMPLES} (chip kinds {', '.join(CHIPS)})"
    m = re.fullmatch(r"(v\d+[a-z]*)[-:](\S+)", text)
    if not m:
        raise ConfigError(f"--topology={name} is not a TPU slice name; {known}")
    kind, size = _ALIASES.get(m.group(1), m.group(1)), m.group(2)
    if kind not in CHIPS:
        raise ConfigError(f"--topology={name}: unknown TPU kind {m.group(1)!r}; {known}")
    chip = CHIPS[kind]
    three_d = chip.megacore
    if "x" in size:  # a topology string: the slice's shape in chips
        dims = tuple(int(d) for d in size.split("x") if d.isdigit())
        if len(dims) != len(size.split("x")) or len(dims) != (3 if three_d else 2):
            raise ConfigError(
                f"--topology={name}: a {kind} shape has {3 if three_d else 2} dimensions "
                f"(e.g. {'4x4x4' if three_d else '4x8'})"
            )
        return chip, dims
    if not size.isdigit():
        raise ConfigError(f"--topology={name} is not a TPU slice name; {known}")
    n = int(size)
    # v4-N and v5p-N count TensorCores (two per chip); v5e-N and v6e-N count chips.
    chips = n // 2 if three_d else n
    table = _SHAPES_3D if three_d else _SHAPES_2D
    if chips not in table or (three_d and n % 2):
        sizes = ", ".join(f"{kind}-{c * 2 if three_d else c}" for c in table)
        raise ConfigError(f"--topology={name}: no {kind} slice of that size; known: {sizes}")
    return chip, table[chips]


# ---------------------------------------------------------------------------
# libtpu on a host without a TPU.

# Set before libtpu loads (its first use, not jax's import). Without the first two libtpu
# prints a warning and an error about an undetermined accelerator type and worker
# hostnames on every run (the values change nothing compiled: a topology says what is
# compiled); without the third a second process that loads libtpu fails on its lockfile
# ("Internal error when accessing libtpu multi-process lockfile").
LIBTPU_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def quiet_libtpu() -> None:
    """libtpu's environment for compiling on a host without a TPU (values already set win)."""
    for key, value in LIBTPU_ENV.items():
        os.environ.setdefault(key, value)


def libtpu_problem() -> str | None:
    """None when libtpu can be imported; else the one line that says how to install it."""
    if importlib.util.find_spec("libtpu") is not None:
        return None
    try:
        from importlib.metadata import version

        jax_version = version("jax")
    except Exception:  # noqa: BLE001 - only the message's detail
        jax_version = "this jax"
    return (
        "libtpu is not installed, and compiling for a TPU needs it: "
        f"pip install 'grpo_jax[tpu]' (JAX's own tpu extra, the libtpu of jax {jax_version}); "
        "--plan_only prints the memory plan without compiling"
    )


def devices(topology: Topology) -> list:
    """The compile-only devices of ``topology`` (libtpu; no TPU needed)."""
    from jax.experimental import topologies

    kw = dict(topology_name=topology.topology_name, chip_config_name=topology.chip_config)
    if topology.slices > 1:
        kw.update(chips_per_host_bounds=(2, 2, 1), num_slices=topology.slices, wrap=topology.wrap)
    elif math.prod(topology.shape) < 4:  # smaller than a host's default 2x2x1 bounds
        kw.update(chips_per_host_bounds=(*topology.shape, 1)[:3])
    return list(topologies.get_topology_desc(platform="tpu", **kw).devices)


def make_mesh(topology: Topology, axes: dict[str, int], devs: list):
    """The run's ("data", "fsdp", "tensor"[, "expert"]) mesh over ``devs``; over several
    slices the data axis spans the slices (``create_hybrid_device_mesh``) and the others stay
    inside one, so only the gradients' data-parallel reduction crosses the data-centre
    network."""
    # Inside the function on purpose: this module imports no JAX (it names the libtpu
    # settings that must be in the environment before JAX loads libtpu).
    from grpo_jax.core import sharding

    if topology.slices == 1:
        return sharding.make_mesh(axes, devs)
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    names = sharding.MESH_AXES
    if axes.get(sharding.EXPERT_AXIS, 1) != 1:  # as make_mesh: the axis only when not 1
        names = (*names, sharding.EXPERT_AXIS)
    sizes = [axes.get(a, 1) for a in names]
    if sizes[0] % topology.slices:
        raise ConfigError(
            f"config key 'mesh.data' = {sizes[0]} must be a multiple of the "
            f"{topology.slices} slices of {topology.name} (data parallelism spans the slices)"
        )
    ici = (sizes[0] // topology.slices, *sizes[1:])
    dcn = (topology.slices,) + (1,) * (len(sizes) - 1)
    array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devs)
    return Mesh(np.asarray(array), names)
