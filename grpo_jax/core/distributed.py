"""Multi-host start-up: one program per host, ``jax.distributed`` joins them.

After :func:`maybe_initialize` every host's chips are in ``jax.devices()`` and one global mesh
spans them. Each host feeds and reads only its own block of rows of every global batch
(:func:`host_rows`, :func:`global_batch`, :func:`local_rows`), only per-row statistics cross
hosts (:func:`gather_rows`), and only process 0 writes logs (:func:`is_primary`). Where the
run's shape comes from (flags, ``GRPO_JAX_*`` variables, a cluster JAX recognises):
docs/recipes.md, "Multi-host and launch scripts". This module imports no JAX at the top:
``main.py`` imports it first, to join a multi-process run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence

from absl import flags

from grpo_jax.core.errors import DistributedError

ENV_COORDINATOR = "GRPO_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "GRPO_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "GRPO_JAX_PROCESS_ID"

_SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines ``--coordinator_address``, ``--num_processes``, ``--process_id`` (once).

    Entry points call it at import time, before absl parses the command line;
    library code never does, so importing grpo_jax defines no flags.
    """
    if "coordinator_address" in FLAGS:
        return
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "host:port of process 0's coordinator, for multi-process runs. Unset: from "
        f"${ENV_COORDINATOR} or the cluster (SLURM, Cloud TPU pod).",
    )
    flags.DEFINE_integer(
        "num_processes",
        None,
        f"Number of processes of a multi-process run (or ${ENV_NUM_PROCESSES}).",
    )
    flags.DEFINE_integer(
        "process_id", None, f"This process's index in [0, num_processes) (or ${ENV_PROCESS_ID})."
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to call ``jax.distributed.initialize``.

    ``source`` says where the settings came from ("arguments", "environment",
    or the name of an auto-detected cluster); for an auto-detected cluster the
    other fields stay None and JAX fills them in itself.
    """

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None


def _as_int(name: str, value) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name} = {value!r} is not an integer") from None


def _explicit_plan(source, names, coordinator, num, pid, local_device_ids) -> Plan | None:
    num, pid = _as_int(names[1], num), _as_int(names[2], pid)
    if coordinator is None and num is None and pid is None:
        return None
    if num is not None and num < 1:
        raise DistributedError(f"{names[1]} = {num} must be at least 1")
    if num is None:
        raise DistributedError(
            f"{names[0] if coordinator is not None else names[2]} is set but {names[1]} is "
            f"not: give all of {', '.join(names)} for a multi-process run"
        )
    if num == 1:
        return None
    missing = [n for n, v in zip(names, (coordinator, num, pid)) if v is None]
    if missing:
        raise DistributedError(
            f"{names[1]} = {num} needs {' and '.join(missing)} too "
            f"(every process gets the same coordinator host:port and its own id)"
        )
    if not 0 <= pid < num:
        raise DistributedError(f"{names[2]} = {pid} must be in [0, {names[1]} = {num})")
    if ":" not in coordinator or not coordinator.rsplit(":", 1)[1].isdigit():
        raise DistributedError(f"{names[0]} = {coordinator!r} must be host:port")
    ids = None if local_device_ids is None else tuple(int(i) for i in local_device_ids)
    return Plan(source, coordinator, num, pid, ids)


def _detected_cluster(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """(name, number of processes) of a cluster JAX can configure itself, or None."""
    if all(v in environ for v in _SLURM_VARS):
        return "slurm", _as_int("SLURM_NTASKS", environ["SLURM_NTASKS"]) or 1
    if environ is not os.environ:  # Cluster probes read the real environment only.
        return None
    try:  # JAX's own detectors: Cloud TPU (GCE metadata, GKE), Open MPI, ...
        from jax._src import clusters
    except ImportError:  # A future JAX moved them; explicit settings still work.
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method or env.__name__ == "SlurmCluster":
            continue
        try:
            if env.is_env_present():
                return env.name or env.__name__, int(env.get_process_count())
        except Exception as e:  # A half-configured probe must not stop a 1-host run.
            logging.warning("cluster probe %s failed: %s", env.__name__, e)
    return None


def plan(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Plan | None:
    """What :func:`maybe_initialize` would do: a :class:`Plan`, or None for one process.

    Pure apart from cluster probing (which only runs against the real
    ``os.environ``); raises :class:`DistributedError` naming the missing or
    bad setting.
    """
    environ = os.environ if environ is None else environ
    p = _explicit_plan(
        "arguments",
        ("coordinator_address", "num_processes", "process_id"),
        coordinator_address,
        num_processes,
        process_id,
        local_device_ids,
    )
    if p is not None or num_processes is not None:
        return p
    p = _explicit_plan(
        "environment",
        (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID),
        environ.get(ENV_COORDINATOR),
        environ.get(ENV_NUM_PROCESSES),
        environ.get(ENV_PROCESS_ID),
        local_device_ids,
    )
    if p is not None or environ.get(ENV_NUM_PROCESSES):
        return p
    cluster = _detected_cluster(environ)
    if cluster is None or cluster[1] <= 1:
        return None
    ids = None if local_device_ids is None else tuple(int(i) for i in local_device_ids)
    return Plan(cluster[0], local_device_ids=ids)


def maybe_initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> bool:
    """Joins the processes of a multi-process run; True if it did, False for one process.

    Call it first thing in the program, before anything asks JAX for devices
    or runs a computation (``jax.distributed.initialize`` must precede the
    backend's start). Calling it again after a successful start is a no-op
    that returns True.
    """
    import jax

    if jax.distributed.is_initialized():
        return True
    p = plan(coordinator_address, num_processes, process_id, local_device_ids)
    if p is None:
        return False
    kwargs = {}
    if p.source in ("arguments", "environment"):
        kwargs = dict(
            coordinator_address=p.coordinator_address,
            num_processes=p.num_processes,
            process_id=p.process_id,
        )
    if p.local_device_ids is not None:
        kwargs["local_device_ids"] = list(p.local_device_ids)
    logging.info("jax.distributed.initialize from %s: %s", p.source, kwargs or "auto-detected")
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise RuntimeError(
                "grpo_jax.core.distributed.maybe_initialize() must run before any other JAX call "
                f"(jax.devices(), a jitted function, ...): {e}"
            ) from e
        raise
    logging.info(
        "process %d of %d: %d local devices, %d global",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def maybe_initialize_from_flags() -> bool:
    """:func:`maybe_initialize` with the flags of :func:`define_flags` (parsed by absl)."""
    if "coordinator_address" not in FLAGS:
        raise RuntimeError("call grpo_jax.core.distributed.define_flags() before absl parses flags")
    return maybe_initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def is_primary() -> bool:
    """True on process 0, the one host that writes metrics files and TensorBoard events."""
    import jax

    return jax.process_index() == 0


def host_rows(mesh, num_rows: int) -> slice:
    """The rows of a global batch of ``num_rows`` that this host's devices hold.

    Under ``grpo_jax.core.sharding.batch_sharding`` (rows split over the batch
    axes) a host's rows form one contiguous block; this host feeds exactly
    those rows to ``jax.make_array_from_process_local_data`` (see
    :func:`global_batch`). Raises if the mesh gives this host scattered rows.
    """
    # Inside the function on purpose: this module imports no JAX (main.py imports it
    # first, to join a multi-process run); grpo_jax.core.sharding imports JAX.
    from grpo_jax.core.sharding import batch_sharding

    index_map = batch_sharding(mesh, 1).addressable_devices_indices_map((num_rows,))
    rows = sorted({idx[0].indices(num_rows)[:2] for idx in index_map.values()})
    start, stop = rows[0][0], rows[-1][1]
    if sum(b - a for a, b in rows) != stop - start:
        raise DistributedError(
            f"this host's devices hold rows {rows} of the batch, not one block: order the "
            "mesh's devices so that each host's devices are adjacent on the batch axes"
        )
    return slice(start, stop)


def global_batch(host_tree, mesh, num_rows: int):
    """One global array per leaf from this host's block of rows (:func:`host_rows`).

    Every leaf of ``host_tree`` holds this host's rows only (leading dimension
    ``host_rows(mesh, num_rows)``'s length); the result is the full batch
    placed with ``grpo_jax.core.sharding.batch_sharding``: rows split over the batch axes.
    """
    import jax
    import numpy as np

    # Inside the function on purpose: this module imports no JAX (main.py imports it
    # first, to join a multi-process run); grpo_jax.core.sharding imports JAX.
    from grpo_jax.core.sharding import batch_sharding

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(
            batch_sharding(mesh, x.ndim), x, (num_rows, *x.shape[1:])
        )

    return jax.tree.map(one, host_tree)


def local_rows(tree, rows: slice):
    """This host's block ``rows`` of global arrays split over the batch axes, as numpy.

    The inverse of :func:`global_batch`: reads only the shards on this host's
    devices, so no data crosses hosts. ``rows`` is :func:`host_rows` of the
    arrays' leading dimension.
    """
    import jax
    import numpy as np

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))[rows]
        blocks = {}
        for shard in x.addressable_shards:
            start, stop, _ = shard.index[0].indices(x.shape[0])
            blocks.setdefault(start, (stop, shard.data))
        out, at = [], rows.start
        for start in sorted(blocks):
            stop, data = blocks[start]
            if start != at:
                break
            out.append(np.asarray(data))
            at = stop
        if at != rows.stop or not out:
            raise DistributedError(
                f"this host's shards of a {x.shape} array do not cover rows "
                f"{rows.start}:{rows.stop} (they start at {sorted(blocks)})"
            )
        return np.concatenate(out)

    return jax.tree.map(one, tree)


def gather_rows(tree):
    """Every host's block of per-row host values, concatenated: the global rows, in host order.

    For statistics over a whole batch that each host computed for its own
    rows (rewards, lengths, ...): the result holds every row once, in order of
    process index, on every host. Each host must pass the same structure and
    shapes. The whole tree crosses hosts in one all-gather, packed as float32
    (exact for flags and for integers below 2**24), and comes back in each
    leaf's dtype. With one process it returns ``tree`` as numpy.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    leaves, treedef = jax.tree.flatten(jax.tree.map(np.asarray, tree))
    packed = np.concatenate([x.astype(np.float32).ravel() for x in leaves])
    all_HxL = np.asarray(multihost_utils.process_allgather(packed))  # stacked, [hosts, L]
    out, at = [], 0
    for x in leaves:
        part = all_HxL[:, at : at + x.size].reshape(-1, *x.shape[1:])
        out.append(part.astype(x.dtype))
        at += x.size
    return jax.tree.unflatten(treedef, out)


def max_over_hosts(value: int) -> int:
    """The largest of every host's ``value`` (e.g. the prompt width all hosts pad to)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def put(tree, shardings):
    """``jax.device_put`` that also works when the shardings span several hosts.

    Every process must pass the same full (global) values, as numpy arrays,
    Python scalars, local jax arrays or PRNG keys; each process places only
    the pieces its own devices hold (``jax.make_array_from_callback``). With
    one process this is plain ``jax.device_put``. ``shardings`` is one
    sharding for every leaf or a matching pytree of them.
    """
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == sharding else jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = one(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


def fetch(tree):
    """``jax.device_get`` of global arrays: every process gets the full numpy values.

    Arrays split over several hosts are gathered (``process_allgather``);
    replicated or local arrays are read directly. Collective when some leaf
    spans hosts: every process must call it with the same structure.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)
