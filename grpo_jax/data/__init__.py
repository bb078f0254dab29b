"""Datasets of prompts with checkable answers, prompt formatting, and batching.

    from grpo_jax import data
    splits = data.load_dataset({"source": "synthetic", "task": "arithmetic",
                                "n_train": 5000, "n_test": 200, "seed": 0})
    it = data.DataIterator(splits["train"], batch_size=16, seed=0)
    prompts = [data.format_prompt(ex, template=data.PLAIN_TEMPLATE) for ex in it.next()]

An example is a plain dict: ``"prompt"``, ``"answer"``, optionally ``"solution"`` and any
further columns (the rewards' fields). docs/data.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from grpo_jax.core.checks import check_choice, check_known_keys, to_dict
from grpo_jax.core.errors import ConfigError
from grpo_jax.data import gsm8k as gsm8k
from grpo_jax.data import synthetic as synthetic
from grpo_jax.data.iterator import DataIterator
from grpo_jax.data.jsonl import MalformedRowError, read_jsonl
from grpo_jax.data.prompts import (
    DEFAULT_TEMPLATE,
    FORMAT_INSTRUCTION,
    PLAIN_TEMPLATE,
    THINK_ANSWER_TEMPLATE,
    format_prompt,
)
from grpo_jax.data.synthetic import make_split

log = logging.getLogger(__name__)

SOURCES = ("gsm8k", "jsonl", "synthetic")

_SYNTHETIC_KEYS = {"source", "task", "seed", "n_train", "n_test", "heldout_fraction"}
_GSM8K_KEYS = {"source", "data_dir", "jsonl_dir", "splits"}
_JSONL_KEYS = {
    "source",
    "train_path",
    "test_path",
    "prompt_field",
    "answer_field",
    "solution_field",
    "on_error",
}


def _plain(cfg) -> dict:
    if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict
        cfg = cfg.to_dict()
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"data config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def check_keys(cfg_like) -> dict:
    """Validates a data section's source and keys without loading anything; -> plain dict."""
    cfg = _plain(cfg_like)
    source = cfg.get("source")
    if source is None:
        raise ConfigError(f"data config has no 'source'; choose one of {list(SOURCES)}")
    check_choice("data.source", source, SOURCES)
    if source == "synthetic":
        task = cfg.get("task", "arithmetic")
        check_choice("data.task", task, synthetic.TASKS)
        check_known_keys("data", cfg, _SYNTHETIC_KEYS | set(synthetic.TASKS[task][0]))
    elif source == "gsm8k":
        check_known_keys("data", cfg, _GSM8K_KEYS)
    else:
        check_known_keys("data", cfg, _JSONL_KEYS)
        on_error = cfg.get("on_error", "raise")
        check_choice("data.on_error", on_error, ("raise", "skip"))
        if not any(cfg.get(f"{s}_path") for s in ("train", "test")):
            raise ConfigError("data.source='jsonl' needs data.train_path and/or data.test_path")
    return cfg


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The dataset: ``source`` and that loader's options (``grpo_jax.data.load_dataset``).

    Sources: "synthetic" (task, seed, n_train, n_test, ...), "gsm8k" (TFDS
    ``data_dir``, or GSM8K-format JSONL files in ``jsonl_dir``; "tiny:word_problems"
    makes a small synthetic set at start), "jsonl" (train_path, test_path,
    field names). docs/data.md describes each.
    """

    source: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_mapping(cls, mapping) -> DataSection:
        cfg = check_keys(to_dict(mapping))
        source = cfg.pop("source")
        return cls(source=source, options=cfg)

    def as_mapping(self) -> dict:
        return {"source": self.source, **self.options}


def load_dataset(cfg_like, *, stats: dict | None = None) -> dict[str, list[dict]]:
    """Loads the dataset a (section of a) config describes -> {split: examples}.

    ``cfg["source"]`` selects the loader:

    * ``"synthetic"``: ``task``, ``seed``, ``n_train``, ``n_test``, optional
      ``heldout_fraction`` and the task's difficulty knobs
      (:func:`grpo_jax.data.synthetic.make_split`). Splits "train", "test".
    * ``"gsm8k"``: ``data_dir`` (TFDS), ``jsonl_dir`` (offline copy), ``splits``
      (default ("train", "test")); see :mod:`grpo_jax.data.gsm8k`.
    * ``"jsonl"``: ``train_path`` and/or ``test_path``, ``prompt_field``
      ("prompt"), ``answer_field`` ("answer"), ``solution_field`` (None),
      ``on_error`` ("raise" or "skip").

    Rows skipped as malformed (``on_error="skip"``) are logged as a warning
    and counted under "skipped/<split>", 0 when none were, for every split
    returned: in ``stats`` when given, and in :func:`last_load_stats` either
    way.
    """
    _LAST_STATS.clear()
    counts: dict[str, int] = {}
    splits = _load(check_keys(cfg_like), counts)
    counts = {f"skipped/{split}": counts.get(f"skipped/{split}", 0) for split in splits}
    _LAST_STATS.update(counts)
    if stats is not None:
        stats.update(counts)
    return splits


_LAST_STATS: dict[str, int] = {}


def last_load_stats() -> dict[str, int]:
    """The counts of the latest :func:`load_dataset` call in this process (a copy).

    ``{"skipped/<split>": rows skipped as malformed}`` for each split it
    returned; empty before the first call. For a caller that did not pass
    ``stats``, such as a trainer that wants the counts in its metrics or summary.
    """
    return dict(_LAST_STATS)


def _load(cfg: dict, stats: dict) -> dict[str, list[dict]]:
    source = cfg["source"]

    if source == "synthetic":
        task = cfg.get("task", "arithmetic")
        knobs = set(synthetic.TASKS[task][0])
        kw = {k: cfg[k] for k in knobs if k in cfg}
        if "heldout_fraction" in cfg:
            kw["heldout_fraction"] = cfg["heldout_fraction"]
        seed = cfg.get("seed", 0)
        return {
            split: make_split(task, split, cfg.get(f"n_{split}", default), seed, **kw)
            for split, default in (("train", 10_000), ("test", 500))
        }

    if source == "gsm8k":
        splits = cfg.get("splits") or ("train", "test")
        if isinstance(splits, str):
            splits = (splits,)
        return {
            s: gsm8k.load(s, data_dir=cfg.get("data_dir"), jsonl_dir=cfg.get("jsonl_dir"))
            for s in splits
        }

    on_error = cfg.get("on_error", "raise")
    paths = {s: cfg.get(f"{s}_path") for s in ("train", "test") if cfg.get(f"{s}_path")}
    out = {}
    for split, path in paths.items():
        examples, skipped = read_jsonl(
            path,
            prompt_field=cfg.get("prompt_field", "prompt"),
            answer_field=cfg.get("answer_field", "answer"),
            solution_field=cfg.get("solution_field"),
            on_error=on_error,
        )
        stats[f"skipped/{split}"] = len(skipped)
        if skipped:
            log.warning(
                "skipped %d malformed row(s) of %s (lines %s%s)",
                len(skipped),
                path,
                skipped[:10],
                " ..." if len(skipped) > 10 else "",
            )
        out[split] = examples
    return out


__all__ = [
    "DEFAULT_TEMPLATE",
    "FORMAT_INSTRUCTION",
    "PLAIN_TEMPLATE",
    "SOURCES",
    "THINK_ANSWER_TEMPLATE",
    "DataIterator",
    "check_keys",
    "MalformedRowError",
    "format_prompt",
    "gsm8k",
    "last_load_stats",
    "load_dataset",
    "make_split",
    "read_jsonl",
    "synthetic",
]
