"""Preference pairs, (prompt, chosen, rejected) texts, from a JSONL file or a prepared TFDS dataset.

    pairs = load_pairs("pairs.jsonl")                              # one JSON object a line
    pairs = load_pairs("tfds:my_prefs", split="train", data_dir="/data/tfds",
                       fields=("question", "response_j", "response_k"))

A JSONL file holds one ``{"prompt": ..., "chosen": ..., "rejected": ...}`` object a line
(blank lines skipped). ``tfds:NAME`` (TFDS's own naming: ``NAME[/CONFIG][:VERSION]``) reads
split ``split`` of a TFDS dataset already prepared in ``data_dir`` (TFDS's default folder when
None) with ``tfds.data_source``: ArrayRecord files, no TensorFlow, and no download. A dataset
prepared elsewhere (``tfds build NAME --file_format=array_record``, or TFDS's
``huggingface:`` builders for a Hugging Face preference set) reads from a copy of its
folder alone, without the code that built it. ``fields`` names the three text features of
either source when they are not called prompt, chosen and rejected.

Every problem is an error that names it: a malformed line or row (file or
``tfds:NAME[split]`` and its line or row index), a field that is missing or not text, a
dataset that is not prepared, a split it does not have, no pairs at all.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

from grpo_jax.errors import ConfigError, MalformedRowError

PAIR_KEYS = ("prompt", "chosen", "rejected")
TFDS_PREFIX = "tfds:"

Pair = tuple[str, str, str]


def load_pairs(
    source: str | os.PathLike,
    *,
    split: str = "train",
    data_dir: str | os.PathLike | None = None,
    fields: Sequence[str] = PAIR_KEYS,
) -> list[Pair]:
    """(prompt, chosen, rejected) of every row of ``source`` (module docstring)."""
    fields = _check_fields(fields)
    if isinstance(source, str) and source.startswith(TFDS_PREFIX):
        return load_tfds_pairs(source[len(TFDS_PREFIX) :], split, data_dir, fields)
    return load_jsonl_pairs(source, fields)


def _check_fields(fields) -> tuple[str, str, str]:
    fields = tuple(fields)
    if len(fields) != 3 or not all(isinstance(f, str) and f for f in fields):
        raise ConfigError(
            f"fields={fields!r} must name three features: the prompt's, the chosen "
            "response's and the rejected response's (e.g. prompt,chosen,rejected)"
        )
    return fields


def load_jsonl_pairs(path: str | os.PathLike, fields: Sequence[str] = PAIR_KEYS) -> list[Pair]:
    """The pairs of a JSONL file; MalformedRowError names the file and line of a bad one."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"preference pairs file {path} not found")
    pairs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MalformedRowError(path, lineno, f"not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise MalformedRowError(path, lineno, f"expected a JSON object, got {row!r:.60}")
            missing = [k for k in fields if not isinstance(row.get(k), str)]
            if missing:
                raise MalformedRowError(
                    path,
                    lineno,
                    f"needs string fields {list(fields)}; missing or not a string: {missing}",
                )
            pairs.append(tuple(row[k] for k in fields))
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs


def _tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            f"tfds: preference pairs need tensorflow-datasets and array-record ({e}); "
            "pip install -r requirements.txt"
        ) from e
    return tfds


def load_tfds_pairs(
    name: str, split: str, data_dir=None, fields: Sequence[str] = PAIR_KEYS
) -> list[Pair]:
    """Split ``split`` of the TFDS dataset ``name`` prepared in ``data_dir``, as pairs."""
    tfds = _tfds()
    where = f"tfds:{name}[{split}]"
    if not name:
        raise ConfigError("tfds: names no dataset (tfds:NAME, tfds:NAME/CONFIG:VERSION)")
    folder = data_dir or tfds.core.constants.DATA_DIR
    try:
        builder = tfds.builder(name, data_dir=None if data_dir is None else str(data_dir))
    except tfds.core.registered.DatasetNotFoundError:
        raise ConfigError(
            f"tfds:{name} is neither prepared in {folder} nor a dataset TFDS knows; "
            f"prepare it where it can be built (tfds build {name} --file_format=array_record) "
            "and set --data_dir to that folder or a copy of it"
        ) from None
    if not builder.is_prepared():
        raise ConfigError(
            f"tfds:{name} is not prepared in {folder}, and preference pairs are never "
            f"downloaded at run time: prepare it first (tfds build {name} "
            "--file_format=array_record) and set --data_dir to that folder"
        )
    try:
        source = builder.as_data_source(split=split)
    except NotImplementedError:  # prepared as TFRecord: no random access without TensorFlow
        raise ConfigError(
            f"tfds:{name} in {builder.data_dir} is prepared in a format that cannot be read "
            "without TensorFlow; prepare it again with --file_format=array_record"
        ) from None
    except ValueError as e:  # an unknown split, a malformed split expression
        raise ConfigError(f"tfds:{name}: split {split!r}: {e}") from None
    features = source.dataset_info.features
    missing = [f for f in fields if f not in features]
    if missing:
        raise ConfigError(
            f"{where} has no feature {missing} (it has {sorted(features)}); name the prompt's, "
            "chosen and rejected features with fields=PROMPT,CHOSEN,REJECTED"
        )
    rows = source.__getitems__(range(len(source))) if len(source) else []
    pairs = [_tfds_pair(row, fields, where, i) for i, row in enumerate(rows)]
    if not pairs:
        raise ValueError(f"{where}: no preference pairs")
    return pairs


def _tfds_pair(row, fields, where: str, index: int) -> Pair:
    out = []
    for f in fields:
        value = row[f]
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as e:
                raise MalformedRowError(where, index, f"feature {f!r} is not UTF-8 ({e})") from None
        if not isinstance(value, str):
            raise MalformedRowError(
                where, index, f"feature {f!r} is {type(value).__name__}, not text"
            )
        out.append(value)
    return tuple(out)
