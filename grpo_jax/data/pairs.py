"""Preference pairs, (prompt, chosen, rejected) texts, from a JSONL file or a prepared TFDS dataset.

    pairs = load_pairs("pairs.jsonl")                              # one JSON object a line
    pairs = load_pairs("tfds:my_prefs", split="train", data_dir="/data/tfds",
                       fields=("question", "response_j", "response_k"))

Every problem is an error that names the file or dataset and the line or row; each pair
keeps where it was read, so :func:`check_lengths` names a pair too long for the model
(docs/data.md, "Preference pairs").
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Sequence

from grpo_jax.core.errors import ConfigError, MalformedRowError

log = logging.getLogger(__name__)

PAIR_KEYS = ("prompt", "chosen", "rejected")
TFDS_PREFIX = "tfds:"


class Pair(tuple):
    """(prompt, chosen, rejected), a tuple that also holds ``where`` it was read
    (``path`` and ``lineno``: a file and its line, or ``tfds:NAME[split]`` and a row index)."""

    def __new__(cls, texts, path: str = "", lineno: int = 0):
        self = super().__new__(cls, texts)
        self.path, self.lineno = str(path), lineno
        return self


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
        pairs = load_tfds_pairs(source[len(TFDS_PREFIX) :], split, data_dir, fields)
    else:
        pairs = load_jsonl_pairs(source, fields)
    warn_ties(pairs)
    return pairs


def warn_ties(pairs: Sequence[Pair]) -> list[Pair]:
    """The pairs whose chosen and rejected texts are the same, with one warning naming them."""
    ties = [p for p in pairs if p[1] == p[2]]
    if ties:
        path = getattr(ties[0], "path", "the pairs")
        lines = ", ".join(str(getattr(p, "lineno", "?")) for p in ties[:10])
        more = f" and {len(ties) - 10} more" if len(ties) > 10 else ""
        log.warning(
            "%s: %d of %d pairs have the same chosen and rejected text (%s %s%s); they are "
            "kept, add nothing to the loss and count as wrong in the pairwise accuracy",
            path,
            len(ties),
            len(pairs),
            "row(s)" if path.startswith(TFDS_PREFIX) else "line(s)",
            lines,
            more,
        )
    return ties


def check_lengths(pairs: Sequence[Pair], tokenizer, limit: int, why: str) -> None:
    """MalformedRowError naming the first pair whose prompt + chosen or prompt + rejected is
    longer than ``limit`` tokens of ``tokenizer`` (as the reward model reads them: special
    tokens added), with ``why`` (what sets the limit)."""
    # A text of many characters is tokenized by its head first: 5,000,000 characters take
    # half a minute, and a head already over the limit settles it.
    head = 16 * limit + 64
    chunk = 512
    for start in range(0, len(pairs), chunk):
        batch = pairs[start : start + chunk]
        texts = [p + c for p, c, _ in batch] + [p + r for p, _, r in batch]
        counts = _token_counts(tokenizer, [t[:head] for t in texts])
        for k, text in enumerate(texts):
            if counts[k] <= limit and len(text) > head:  # a long text with few tokens
                counts[k] = _token_counts(tokenizer, [text])[0]
            if counts[k] > limit:
                pair, side = batch[k % len(batch)], ("chosen", "rejected")[k // len(batch)]
                n = f"{counts[k]:,} tokens" if len(text) <= head else f"over {counts[k]:,} tokens"
                raise MalformedRowError(
                    getattr(pair, "path", "pairs"),
                    getattr(pair, "lineno", start + k % len(batch) + 1),
                    f"prompt + {side} is {n} ({len(text):,} characters), more than the "
                    f"{limit} {why}",
                )


def _token_counts(tokenizer, texts) -> list[int]:
    return [len(x) for x in tokenizer(texts, add_special_tokens=True)["input_ids"]]


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
    if path.is_dir():
        raise IsADirectoryError(
            f"preference pairs file {path} is a directory; give a JSONL file (or tfds:NAME)"
        )
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
            pairs.append(Pair([row[k] for k in fields], path, lineno))
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
    return Pair(out, where, index)
