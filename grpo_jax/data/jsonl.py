"""Generic JSONL datasets: one JSON object per line, with configurable field names.

Each row becomes an example dict with ``"prompt"`` (from ``prompt_field``),
``"answer"`` (from ``answer_field``, as text), optionally ``"solution"`` (from
``solution_field``), and every other column of the row unchanged (reward
functions receive them as fields). Blank lines are ignored. A malformed row
(a line that is not UTF-8, bad JSON, not an object, a missing or non-text
prompt, a missing answer) either raises :class:`MalformedRowError` naming the
file and line, or is skipped and counted, as ``on_error`` chooses.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

from grpo_jax.core.errors import MalformedRowError, NotUTF8Error

ON_ERROR = ("raise", "skip")


def _text(value) -> str | None:
    """Answers may be numbers in JSON; prompts must be text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _not_utf8(line: str) -> NotUTF8Error | None:
    """The error for a line decoded with ``surrogateescape``, or None when it is valid UTF-8.

    Undecodable bytes come through that handler as lone surrogates U+DC80..U+DCFF,
    which no valid UTF-8 decodes to.
    """
    if line.isascii():
        return None
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        offset = len(line[: e.start].encode("utf-8", "surrogateescape"))
        byte = ord(line[e.start]) - 0xDC00
        return NotUTF8Error(
            f"line is not valid UTF-8 (byte 0x{byte:02x} at byte offset {offset} of the line); "
            "re-encode the file as UTF-8"
        )
    return None


def iter_rows(path):
    """(line number, parsed JSON or the exception) for each non-blank line of ``path``.

    The exception is a :class:`json.JSONDecodeError` for a line that is not
    JSON, a :class:`NotUTF8Error` for a line that is not UTF-8; either way the
    following lines are still read.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            bad = _not_utf8(line)
            if bad is not None:
                yield lineno, bad
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, e


def row_problem(row) -> str | None:
    """Why a row from :func:`iter_rows` cannot be used before its fields are looked at, or None."""
    if isinstance(row, json.JSONDecodeError):
        return f"invalid JSON ({row.msg} at column {row.colno})"
    if isinstance(row, NotUTF8Error):
        return str(row)
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    return None


def read_jsonl(
    path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    solution_field: str | None = None,
    on_error: str = "raise",
    convert: Callable[[dict], dict] | None = None,
) -> tuple[list[dict], list[int]]:
    """Reads a JSONL dataset file.

    Args:
      path: the file.
      prompt_field, answer_field, solution_field: columns holding the question,
        the reference answer and (optional) the worked solution.
      on_error: "raise" (default) or "skip" malformed rows.
      convert: optional ``row -> example`` used instead of the field mapping
        (GSM8K's reference solutions, for instance); it raises ValueError or
        KeyError for a malformed row.

    Returns:
      (examples, line numbers of the skipped rows).
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r} is not one of {list(ON_ERROR)}")
    examples, skipped = [], []
    for lineno, row in iter_rows(path):
        try:
            problem = row_problem(row)
            if problem is not None:
                raise ValueError(problem)
            if convert is not None:
                examples.append(convert(row))
                continue
            ex = {
                k: v
                for k, v in row.items()
                if k not in (prompt_field, answer_field, solution_field)
            }
            for key, field, required in (
                ("prompt", prompt_field, True),
                ("answer", answer_field, True),
                ("solution", solution_field, False),
            ):
                if field is None:
                    continue
                if field not in row:
                    if required:
                        raise ValueError(f"missing field {field!r} (row has {sorted(row)})")
                    continue
                value = row[field]
                text = (
                    value if isinstance(value, str) else None if key == "prompt" else _text(value)
                )
                if text is None:
                    raise ValueError(f"field {field!r} = {value!r} is not text")
                ex[key] = text
            examples.append(ex)
        except (ValueError, KeyError) as e:
            if on_error == "raise":
                msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
                raise MalformedRowError(path, lineno, str(msg)) from None
            skipped.append(lineno)
    return examples, skipped
