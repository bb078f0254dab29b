"""Checksums of what a run saves, verified when it is read back.

Arrays get value digests, two 32-bit sums of each array's bits computed where the arrays
live and independent of the mesh and layout; JSON is digested as sha256 of its canonical
text, files as sha256 of their bytes (a ``SHA256SUMS`` file that ``sha256sum -c`` reads).
docs/architecture.md ("Checkpoints", the checksums) has how the digests are made and what a
mismatch does. A change of any one element changes both sums; several changes cancel with
odds of about 2^-64.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import pathlib
import sys
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from grpo_jax.core.errors import IntegrityError

VERSION = 1
SUMS_FILE = "SHA256SUMS"
_K1, _K2, _MIX = 0x9E3779B1, 0x85EBCA77, 0x7FEB352D  # odd: multiplying by them is a bijection


def _words(x):
    """``x``'s bits as uint32 words (an element of 8 bytes gives two)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size in (4, 8):
        return lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _shard_sums(x, start, strides):
    """The two sums over one shard ``x`` of an array: ``start`` is the shard's offset in the
    array's words, ``strides`` the array's row-major strides (both uint32, one per axis of
    the words), so each word is weighted by its position in the whole array."""
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    for axis in range(w.ndim):  # the row-major position, without a reshape
        at = lax.broadcasted_iota(jnp.uint32, w.shape, axis) + start[axis]
        index = index + at * strides[axis]
    odd = index * jnp.uint32(2) + jnp.uint32(1)
    mixed = (w ^ (w >> jnp.uint32(16))) * jnp.uint32(_MIX)
    s1 = jnp.sum(w * (odd * jnp.uint32(_K1)), dtype=jnp.uint32)
    s2 = jnp.sum(mixed * (odd * jnp.uint32(_K2)), dtype=jnp.uint32)
    return jnp.stack([s1, s2])


_shard_sums_jit = jax.jit(_shard_sums)


def _shards(x) -> list[tuple]:
    """(data, start in words, strides in words) of each shard of ``x`` to sum: this process's
    shards, one copy of each (replica 0), so every element counts once across processes."""
    wide = np.dtype(x.dtype).itemsize == 8  # two words an element: one more axis
    shape = (*x.shape, 2) if wide else tuple(x.shape)
    strides, s = [], 1
    for n in reversed(shape):
        strides.insert(0, s)
        s = (s * n) % 2**32
    strides = np.asarray(strides, np.uint32)
    out = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        start = [sl.indices(n)[0] for sl, n in zip(shard.index, x.shape, strict=True)]
        start = np.asarray([*start, 0] if wide else start, np.uint32)
        out.append((shard.data, start, strides))
    return out


def tree_digests(tree) -> dict[str, list[str]]:
    """``{path: [dtype, digest]}`` of every array of ``tree`` (paths as ``jax.tree_util.keystr``).

    A small jitted reduction per shard, on the device that holds it and compiled once per
    shard shape and dtype (a model's layers share theirs), all dispatched before one copy
    of the sums to the host, where the wrapping sums of the shards add up to the array's.
    No collective runs on the devices; in a multi-host run (every process calls this)
    the processes' sums are added in one exchange.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
    leaves = [
        jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in leaves
    ]
    parts = [[_shard_sums_jit(*shard) for shard in _shards(x)] for x in leaves]
    host = jax.device_get(parts)
    sums = np.zeros((len(leaves), 2), np.uint64)
    for i, shard_sums in enumerate(host):
        for s in shard_sums:
            sums[i] += np.asarray(s, np.uint64)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sums = np.asarray(multihost_utils.process_allgather(sums)).sum(axis=0, dtype=np.uint64)
    sums %= 2**32
    out: dict[str, list[str]] = {}
    for (path, _), x, (s1, s2) in zip(flat, leaves, sums.tolist(), strict=True):
        out[jax.tree_util.keystr(path)] = [str(np.dtype(x.dtype)), f"{s1:08x}{s2:08x}"]
    return out


def saved_dtypes(record: Mapping[str, list[str]]) -> dict[str, str]:
    """``{path: dtype}`` the arrays of ``record`` were saved in."""
    return {path: entry[0] for path, entry in record.items()}


def check_tree(tree, record: Mapping[str, list[str]], where: str, what: str) -> None:
    """Raises IntegrityError when an array of ``tree`` differs from its digest in ``record``.

    ``where`` names the saved thing (a checkpoint step, a cache), ``what`` the item
    ("params"). Arrays ``record`` lacks, or read back in another dtype, are not
    compared (the readers restore in the saved dtype).
    """
    now = tree_digests(tree)
    bad = [p for p in now if p in record and now[p][0] == record[p][0] and now[p] != record[p]]
    if len(bad) == 1:
        problem = f"{what}{bad[0]} differs from the checksum saved with it"
    elif bad:
        problem = (
            f"{what}{bad[0]} and {len(bad) - 1} more of its {len(now)} arrays differ from the "
            "checksums saved with them"
        )
    if bad:
        raise IntegrityError(where, f"{problem} (damaged on disk)")


@contextlib.contextmanager
def reading():
    """Around an Orbax restore: on a failure, Orbax's stragglers are left out (below) and
    collected at once."""
    try:
        yield
    except BaseException:
        leave_out_orbax_stragglers()
        gc.collect()  # the dropped coroutines, now
        raise


def _is_straggler(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and "orbax" in code.co_filename:
        return True
    e = unraisable.exc_value
    return (
        unraisable.object is None
        and isinstance(e, RuntimeError)
        and (str(e) == "Event loop is closed")
    )


def leave_out_orbax_stragglers() -> None:
    """From now on, leaves out what Orbax leaves behind a failed read or write.

    When one write or read fails, Orbax drops the others unfinished: Python reports
    each dropped coroutine as "Exception ignored", asyncio each of its failed tasks as
    "Task exception was never retrieved", and TensorStore's late callbacks into the
    closed event loop as "Event loop is closed", each with a traceback, on the console,
    when they are collected or land, often before the failure reaches the caller. The
    failure itself is raised (and reported in one line), so those reports are dropped;
    anything else is reported as before.
    """
    if getattr(sys.unraisablehook, "grpo_jax_stragglers", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _is_straggler(unraisable):
            previous(unraisable)

    hook.grpo_jax_stragglers = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_orbax_task_errors)


def _orbax_task_errors(record: logging.LogRecord) -> bool:
    """False for asyncio's "Task exception was never retrieved" about an Orbax task."""
    return not (record.levelno >= logging.ERROR and "orbax" in record.getMessage())


def describe(e: BaseException, limit: int = 300) -> str:
    """``"<type>: <first line>"`` of the exception at the root of ``e``'s causes (Orbax wraps
    TensorStore's error, which names the file and what is wrong with it, in its own)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}".rstrip(": ")


def json_digest(obj) -> str:
    """sha256 of ``obj``'s canonical JSON (keys sorted), as it reads back from a file."""
    text = json.dumps(json.loads(json.dumps(obj)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(functools.partial(f.read, 1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_sums(directory: str | os.PathLike, names: Iterable[str]) -> pathlib.Path:
    """Writes ``<directory>/SHA256SUMS`` for the files ``names`` (``sha256sum -c`` reads it)."""
    d = pathlib.Path(directory)
    lines = [f"{file_digest(d / n)}  {n}\n" for n in sorted(set(names))]
    tmp = d / f".{SUMS_FILE}.tmp"
    tmp.write_text("".join(lines))
    os.replace(tmp, d / SUMS_FILE)
    return d / SUMS_FILE


def sums_names(directory: str | os.PathLike) -> list[str]:
    """The files ``<directory>/SHA256SUMS`` lists ([] when there is none)."""
    sums = pathlib.Path(directory) / SUMS_FILE
    if not sums.is_file():
        return []
    return [line.partition("  ")[2] for line in sums.read_text().splitlines() if "  " in line]


def check_sums(directory: str | os.PathLike) -> bool:
    """Verifies ``<directory>/SHA256SUMS``: True when every file listed matches, False when
    there is no such file; IntegrityError naming the first file that differs or is missing."""
    d = pathlib.Path(directory)
    sums = d / SUMS_FILE
    if not sums.is_file():
        return False
    for n, line in enumerate(sums.read_text(errors="replace").splitlines(), 1):
        digest, _, name = line.partition("  ")
        if not name:
            raise IntegrityError(str(sums), f"line {n} is not '<sha256>  <file>': {line[:80]!r}")
        if not (d / name).is_file():
            raise IntegrityError(str(d), f"{name}, listed in {SUMS_FILE}, is missing")
        if file_digest(d / name) != digest:
            raise IntegrityError(
                str(d), f"{name} differs from its checksum in {SUMS_FILE} (damaged on disk)"
            )
    return True
