"""The ``check_*`` helpers every config section validates with; bottom layer.

Each check raises :class:`grpo_jax.core.errors.ConfigError` naming the offending key, its
value and what is allowed. This module imports nothing from grpo_jax but ``errors``, so
the sections can live with the code they configure (``models``, ``sampling``, ``data``,
``rewards``, ``envs``, ...) while ``grpo_jax.run.config`` composes them into a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from grpo_jax.core.errors import ConfigError

__all__ = [
    "ConfigError",
    "check_bool",
    "check_choice",
    "check_known_keys",
    "check_range",
    "from_mapping",
    "to_dict",
]


def check_choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = sorted(allowed)
    if value not in allowed:
        raise ConfigError(f"config key '{key}' = {value!r} is not one of {allowed}")


def check_range(key: str, value: Any, *, lo=None, hi=None, lo_open=False, integer=False) -> None:
    """Raises unless ``lo <= value <= hi`` (``lo < value`` when ``lo_open``)."""
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"config key '{key}' = {value!r} must be an integer")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"config key '{key}' = {value!r} must be a finite number")
    if lo is not None and (value <= lo if lo_open else value < lo):
        op = ">" if lo_open else ">="
        raise ConfigError(f"config key '{key}' = {value!r} must be {op} {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"config key '{key}' = {value!r} must be <= {hi}")


def check_known_keys(section: str, given: Iterable[str], known: Iterable[str]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key{'s' * (len(unknown) > 1)} "
            f"{', '.join(f'{section}.{k}' for k in unknown)}; "
            f"the keys of {section} are {', '.join(sorted(known))}"
        )


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' = {value!r} must be True or False")


def to_dict(section: Any) -> dict:
    """A config section (ConfigDict, mapping or None) as a plain dict."""
    if section is None:
        return {}
    if hasattr(section, "to_dict"):
        return section.to_dict()
    return dict(section)


def from_mapping(cls, section: str, mapping: Mapping[str, Any] | None):
    """Builds ``cls`` from a config section, rejecting unknown keys by name."""
    cfg = to_dict(mapping)
    check_known_keys(section, cfg, {f.name for f in dataclasses.fields(cls)})
    return cls(**cfg)


def flat_keys(d, prefix: str = "") -> dict:
    """A nested mapping as one level with dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def section_defaults_of(config_cls) -> dict:
    """{flat key: default} of the dataclass sections of ``config_cls`` (a dataclass whose
    fields are sections) that need no argument, as plain JSON data."""
    out = {}
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        cls = hints[field.name]
        if not dataclasses.is_dataclass(cls):
            continue
        try:
            section = cls()
        except (TypeError, ConfigError):  # a section with a required setting
            continue
        plain = json.loads(json.dumps(dataclasses.asdict(section), default=str))
        out.update(flat_keys({field.name: plain}))
    return out
