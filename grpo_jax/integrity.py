"""Checksums of what a run saves, verified when it is read back (docs/architecture.md).

Arrays get value digests: two 32-bit sums of each array's bits, every word weighted
by an odd multiple of its position, one of them after a bijective mix. They are
computed by a small jitted reduction per array where the arrays live (on the devices,
sharded as they are), before a save is handed to Orbax, and again on the restored arrays.
Integer sums wrap, so the digest does not depend on the mesh, the layout or the order
of the reduction: a resume on other devices verifies too. A change of any one element
changes both sums; several changes cancel with odds of about 2^-64.

JSON is digested as sha256 of its canonical text, files as sha256 of their bytes (a
``SHA256SUMS`` file that ``sha256sum -c`` reads).
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

from grpo_jax.errors import IntegrityError

VERSION = 1
SUMS_FILE = "SHA256SUMS"
_K1, _K2, _MIX = 0x9E3779B1, 0x85EBCA77, 0x7FEB352D  # odd: multiplying by them is a bijection


def _words(x):
    """``x``'s bits as uint32 words (an element of 8 bytes gives two)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size in (4, 8):
        return lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_sums(x):
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):  # the row-major position, without a reshape
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride)
        stride = (stride * w.shape[axis]) % 2**32
    odd = index * jnp.uint32(2) + jnp.uint32(1)
    mixed = (w ^ (w >> jnp.uint32(16))) * jnp.uint32(_MIX)
    s1 = jnp.sum(w * (odd * jnp.uint32(_K1)), dtype=jnp.uint32)
    s2 = jnp.sum(mixed * (odd * jnp.uint32(_K2)), dtype=jnp.uint32)
    return jnp.stack([s1, s2])


_leaf_sums_jit = jax.jit(_leaf_sums)


def tree_digests(tree) -> dict[str, list[str]]:
    """``{path: [dtype, digest]}`` of every array of ``tree`` (paths as ``jax.tree_util.keystr``).

    One small jitted reduction per array, compiled once per shape, dtype and sharding
    (the layers of a model share theirs), all dispatched before one copy of the sums to
    the host. Every process of a multi-host run calls it: the sums of a global array are
    collectives.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in flat]
    sums = jax.device_get([_leaf_sums_jit(x) for x in leaves])
    out: dict[str, list[str]] = {}
    for (path, _), x, s in zip(flat, leaves, sums, strict=True):
        s1, s2 = (int(v) for v in np.asarray(s))
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
