"""The error types that every layer may raise; this module imports nothing from grpo_jax.

The bottom layer of the package (docs/architecture.md, "Layers"): a lower module that
needs to report a bad setting raises :class:`ConfigError` from here, never from
``grpo_jax.config`` (the run layer, which composes the sections and imports them).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, misspelled or out of range."""
