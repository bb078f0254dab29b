"""The error types that mean the user's input is wrong; this module imports nothing from grpo_jax.

The bottom layer of the package: a lower module that needs to report a bad setting raises
:class:`ConfigError` from here, never from ``grpo_jax.run.config``, and the command line
(``grpo_jax.cli.user_errors``) catches these without importing the modules that raise them
(JAX, Orbax).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, misspelled or out of range."""


class MalformedRowError(ValueError):
    """A row of a dataset file cannot be read; the message names file and line."""

    def __init__(self, path, lineno: int, problem: str):
        self.path, self.lineno, self.problem = str(path), lineno, problem
        super().__init__(f"{path}:{lineno}: {problem}")


class NotUTF8Error(ValueError):
    """A line of a dataset file is not valid UTF-8; the message gives the first bad byte."""


class DistributedError(ValueError):
    """The multi-process settings are incomplete or inconsistent."""


class WorkdirBusyError(RuntimeError):
    """Another live process is running in this workdir."""


class WorkdirWriteError(WorkdirBusyError):
    """The run cannot write to its workdir (read-only, full, no permission); a kind of
    WorkdirBusyError, so that every command reports it as a user error, in one line."""


class CheckpointError(RuntimeError):
    """No checkpoint of the workdir could be restored, or one could not be saved."""


class IntegrityError(CheckpointError):
    """Saved data differs from the checksum saved with it: damaged on disk.

    ``where`` names what was read (a checkpoint step, a cache), ``problem`` what differs.
    """

    def __init__(self, where: str, problem: str):
        self.where, self.problem = where, problem
        super().__init__(f"{where}: {problem}")


class NonFiniteError(FloatingPointError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class AlarmStop(RuntimeError):
    """A health alarm stopped the run (``health.stop_on_alarm``), or a rerun would resume
    past such a stop without ``health.resume_after_stop``; the message is one line."""
