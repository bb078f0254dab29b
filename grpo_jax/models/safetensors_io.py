"""Reading and writing safetensors checkpoints tensor by tensor, without torch.

Reading memory-maps each file, so a tensor is a lazy numpy view of which a loader copies one
device's shard; writing streams one tensor at a time, split into shards with an index as
transformers does. The format: docs/models.md, "Hugging Face checkpoints".
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, malformed or does not fit the model."""


def _read_header(file: pathlib.Path) -> tuple[dict, int, int]:
    """(tensor entries, where the data starts, the file's size in bytes)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(
                f"{file}: not a safetensors file (its header length {n} exceeds the "
                f"{size - 8} bytes after the length field; truncated or corrupt file)"
            )
        if n > 100_000_000:
            raise CheckpointError(f"{file}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{file}: not a safetensors file (header is not JSON: {e})"
            ) from e
        except UnicodeDecodeError as e:
            raise CheckpointError(
                f"{file}: not a safetensors file (header is not UTF-8 JSON: {e})"
            ) from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{file}: not a safetensors file (header is a {type(header).__name__}, "
            "not a JSON object)"
        )
    header.pop("__metadata__", None)
    return header, 8 + n, size


def _byte_range_problem(name: str, entry, available: int) -> str | None:
    """What is wrong with one header entry's data_offsets, or None.

    ``available`` is the number of data bytes after the header.
    """
    if not isinstance(entry, dict):
        return f"tensor {name!r} has header {entry!r}, not an object"
    offsets, shape, code = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")
    if offsets is None:
        return f"tensor {name!r} has no data_offsets"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"tensor {name!r} has bad data_offsets {offsets!r}"
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        return f"tensor {name!r} has bad shape {shape!r}"
    begin, end = offsets
    if code in _DTYPES:  # Unknown dtypes fail when such a tensor is read, if ever.
        need = math.prod(shape) * _DTYPES[code].itemsize
        if end - begin != need:
            return (
                f"tensor {name!r} has data_offsets {offsets} ({end - begin} bytes), but dtype "
                f"{code} and shape {shape} need {need} bytes"
            )
    if end > available:
        return (
            f"tensor {name!r} needs bytes {begin}..{end} but the file has only {available} "
            "bytes after its header (truncated or corrupt file)"
        )
    return None


class SafetensorsFile:
    """One memory-mapped safetensors file; ``file[name]`` is a lazy numpy view.

    Opening checks every tensor's byte range against its dtype and shape and
    against the file's size, so a truncated or corrupt file raises
    CheckpointError naming the file and the tensor before anything is read.
    """

    def __init__(self, file: str | os.PathLike):
        self.path = pathlib.Path(file)
        self.header, self._data_start, size = _read_header(self.path)
        for name, entry in self.header.items():
            problem = _byte_range_problem(name, entry, size - self._data_start)
            if problem is not None:
                raise CheckpointError(f"{self.path}: {problem}")
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self.header[name]["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        return _DTYPES[code]

    def __getitem__(self, name: str) -> np.ndarray:
        dtype = self.dtype(name)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = self.header[name]["data_offsets"]
        available = len(self._mmap) - self._data_start
        if end > available:  # The file shrank since it was opened.
            raise CheckpointError(
                f"{self.path}: tensor {name!r} needs bytes {begin}..{end} but the file has only "
                f"{max(available, 0)} bytes after its header (truncated or corrupt file)"
            )
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(dtype).reshape(self.shape(name))


class SafetensorsCheckpoint:
    """All tensors of a checkpoint directory: one ``model.safetensors`` or an index plus shards."""

    def __init__(self, directory: str | os.PathLike):
        directory = pathlib.Path(directory)
        index = directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from e
            files = {f: None for f in weight_map.values()}
        elif (directory / SINGLE_FILE).exists():  # Other *.safetensors (adapters...) are not ours.
            files = {SINGLE_FILE: None}
        else:
            files = {f.name: None for f in sorted(directory.glob("*.safetensors"))}
            if not files:
                raise CheckpointError(
                    f"{directory}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file found"
                )
        for name in files:
            if not (directory / name).exists():
                raise CheckpointError(f"{directory / name}: listed in {INDEX_FILE} but missing")
            files[name] = SafetensorsFile(directory / name)
        self.files = files
        self.where: dict[str, SafetensorsFile] = {}
        for f in files.values():
            for k in f.keys():
                self.where[k] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.where[name][name]

    def file_of(self, name: str) -> pathlib.Path:
        return self.where[name].path


def weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files of a checkpoint written by :func:`write_checkpoint` in ``directory``."""
    files = [directory / SINGLE_FILE, directory / INDEX_FILE]
    files += sorted(directory.glob("model-*-of-*.safetensors"))
    return [f for f in files if f.exists()]


def write_checkpoint(
    directory: str | os.PathLike,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    produce: Callable[[str], np.ndarray],
    *,
    max_shard_bytes: int = 5 * 2**30,
    metadata: Mapping[str, str] | None = None,
) -> list[pathlib.Path]:
    """Writes tensors as one or more safetensors files, one tensor in memory at a time.

    ``tensors`` lists (name, shape, dtype) in writing order; ``produce(name)``
    returns that tensor's numpy array when its turn comes. Returns the files
    written.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specs = [(n, tuple(int(d) for d in s), np.dtype(dt)) for n, s, dt in tensors]
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[1], dtype=np.int64)) * spec[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for stale in weight_files(directory):
        stale.unlink()  # A save replaces any earlier checkpoint in the directory.
    weight_map, total = {}, 0
    for file_name, shard in zip(names, shards):
        header, offset = {}, 0
        for name, shape, dtype in shard:
            if dtype not in _NAMES:
                raise CheckpointError(f"tensor {name!r}: dtype {dtype} cannot be saved")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {
                "dtype": _NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file_name
        total += offset
        header["__metadata__"] = {"format": "pt", **(metadata or {})}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # Aligns the data to 8 bytes, as the reference writer does.
        tmp = directory / (file_name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in shard:
                array = np.ascontiguousarray(produce(name), dtype=dtype)
                if array.shape != shape:
                    raise CheckpointError(
                        f"tensor {name!r}: produced shape {array.shape}, declared {shape}"
                    )
                f.write(array.tobytes())
        os.replace(tmp, directory / file_name)  # A crash mid-write never leaves a half file.
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [directory / n for n in names]
