"""A reader of the GGUF file format (version 2 and 3), numpy and the standard library only.

The metadata is parsed once (a 262k-entry vocabulary in a fraction of a second); tensor data
stays memory-mapped until a tensor is read. The layout: docs/gguf.md, "The file and its
quantised blocks".
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import struct
from typing import Any

import numpy as np

from grpo_jax.models.gguf_quants import TYPES, dequantize
from grpo_jax.models.safetensors_io import CheckpointError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {k: np.dtype(v) for k, v in _SCALARS.items()}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: the reverse of GGUF's dims.
    ggml_type: int
    offset: int  # Absolute byte offset in the file.
    nbytes: int


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as e:
            raise CheckpointError(f"{self.path}: truncated GGUF header at byte {self.pos}") from e
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, n = self.take("<I"), self.take("<Q")
            if inner in _NUMPY:
                dt = _NUMPY[inner]
                end = self.pos + n * dt.itemsize
                if end > len(self.buf):
                    raise CheckpointError(f"{self.path}: truncated GGUF array at byte {self.pos}")
                arr = np.frombuffer(self.buf, dt, count=n, offset=self.pos)
                self.pos = end
                return arr.tolist()
            return [self.value(inner) for _ in range(n)]
        raise CheckpointError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}")


def _block_sizes(kind: int) -> tuple[int, int] | None:
    """(values, bytes) per block of a ggml type: ours, else the gguf package's if installed."""
    if kind in TYPES:
        return TYPES[kind][1:]
    try:
        import gguf

        return tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)])
    except (ImportError, ValueError, KeyError):
        return None


class GGUFReader:
    """``metadata`` (key -> value: scalars, strings, lists) and ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # An empty file cannot be mapped.
                raise CheckpointError(f"{self.path}: not a GGUF file (empty)") from e
        c = _Cursor(self._map, self.path)
        if bytes(self._map[:4]) != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file (no 'GGUF' magic number)")
        c.pos = 4
        self.version = c.take("<I")
        if self.version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {self.version} is not supported")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            self.metadata[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("<Q") for _ in range(c.take("<I"))]
            infos.append((name, tuple(reversed(dims)), c.take("<I"), c.take("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset in infos:
            count = int(np.prod(shape, dtype=np.int64))
            sizes = _block_sizes(kind)
            if sizes is None:
                nbytes = -1  # An unknown type: reading it raises.
            else:
                nbytes = count // sizes[0] * sizes[1]
                if start + offset + nbytes > len(self._map):
                    raise CheckpointError(
                        f"{self.path}: tensor {name!r} ends past the end of the file "
                        "(truncated download?)"
                    )
            self.tensors[name] = TensorInfo(name, shape, kind, start + offset, nbytes)

    def data(self, name: str) -> np.ndarray:
        """The raw bytes (uint8) of tensor ``name``, memory-mapped."""
        info = self.tensors[name]
        if info.nbytes < 0:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has GGUF type {info.ggml_type}, which cannot be "
                f"read; supported: {sorted(n for n, _, _ in TYPES.values())}"
            )
        return np.frombuffer(self._map, np.uint8, count=info.nbytes, offset=info.offset)


class GGUFFile:
    """A GGUF file's metadata and tensors (tensors dequantised when read)."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        self.reader = GGUFReader(self.path)
        self.tensors = self.reader.tensors
        self.architecture = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.reader.metadata.get(key, default)

    def arch(self, key: str, default: Any = None) -> Any:
        """The architecture-specific key ``{architecture}.{key}``.

        float32 values come back as the shortest decimal that rounds to them
        (1e-05, not 9.99999974e-06), the value the original config.json held.
        """
        value = self.get(f"{self.architecture}.{key}", default)
        return float(str(np.float32(value))) if isinstance(value, float) else value

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy (row-major) shape."""
        return self.tensors[name].shape

    def tensor(self, name: str) -> np.ndarray:
        """The float32 values of tensor ``name``, dequantised."""
        info = self.tensors[name]
        try:
            return dequantize(self.reader.data(name), info.ggml_type, info.shape)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from e
