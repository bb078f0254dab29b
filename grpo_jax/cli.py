"""What the command-line entry points (train, evaluate, export) share.

``quiet()`` keeps a run's console to what a person reads: the progress line,
warnings and errors. Libraries' start-up chatter (JAX's backend probing, the
tokenizer library's note that PyTorch is absent, Orbax's per-save INFO lines)
is dropped; ``--verbosity=0`` (absl) or a logging configuration of your own
brings INFO back for grpo_jax's own loggers.
"""

from __future__ import annotations

import logging
import os
import sys

from grpo_jax.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    MalformedRowError,
    NotUTF8Error,
    WorkdirBusyError,
)


def quiet() -> None:
    """Silences third-party INFO logs and advisory banners; call before importing them."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in ("jax", "absl", "orbax"):
        logging.getLogger(name).setLevel(logging.WARNING)


# Exit status of a user error (bad config, input file, workdir, checkpoint): one line on
# stderr, the traceback only under --verbose.
USER_ERROR = 2
# Exit status of a run a health alarm stopped (health.stop_on_alarm; its checkpoint saved),
# and of its rerun, which refuses to resume past the stop without
# health.resume_after_stop. (3: a run stopped by non-finite updates.)
ALARM_STOP = 4


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean the user's input is wrong, not grpo_jax."""
    # Inside the function on purpose: the models package imports JAX, which the entry
    # points import only after ``quiet()``; the other types are ``grpo_jax.errors``'.
    from grpo_jax.models.safetensors_io import CheckpointError as SafetensorsError

    return (
        ConfigError,
        CheckpointError,
        SafetensorsError,
        MalformedRowError,
        NotUTF8Error,
        DistributedError,
        WorkdirBusyError,
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
    )


def report_user_error(e: BaseException, stream=None) -> int:
    """Prints ``error: <message>`` (one line per line of the message); returns USER_ERROR."""
    prefix = "config error" if isinstance(e, ConfigError) else "error"
    print(f"{prefix}: {e}", file=stream or sys.stderr)
    return USER_ERROR


def override_keys(argv) -> list[str]:
    """The config keys that ``argv``'s ``--config.<key>[=value]`` overrides set, in order.

    Spellings absl accepts count alike: one or two dashes, ``--noconfig.<key>`` for a
    boolean. Arguments after a bare ``--`` are not flags.
    """
    keys = []
    for a in argv:
        if a == "--":
            break
        name = a.lstrip("-").split("=", 1)[0] if a.startswith("-") else ""
        if name.startswith("noconfig."):
            name = name[2:]
        if name.startswith("config."):
            keys.append(name[len("config.") :])
    return keys


def unknown_key(config, key: str) -> str | None:
    """Why dotted ``key`` names no value of ``config`` (a ConfigDict), or None if it does."""
    node = config
    parts = key.split(".")
    for i, part in enumerate(parts):
        where = ".".join(parts[:i])
        if not hasattr(node, "keys"):
            return f"{where} is a value ({node!r}), not a section"
        if part not in node.keys():
            known = ", ".join(sorted(node.keys()))
            return f"{where or 'the config'} has no key {part} (its keys: {known})"
        node = node[part]
    return None


def _load_config(argv):
    """The ConfigDict that ``argv``'s ``--config=file.py[:arg]`` names, or None."""
    import importlib.util
    import pathlib

    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        return None
    path, _, arg = spec.partition(":")
    try:
        module_spec = importlib.util.spec_from_file_location("_cli_config", pathlib.Path(path))
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module.get_config(arg or None)
    except Exception:  # absl reported the file already, or will
        return None


def parse_flags(argv):
    """absl's flag parsing, with a flag or config-key typo as one line (exit 2) and --help as 0.

    A config key given twice is refused too (absl would keep the last value silently),
    except a tuple's, whose repeated flags are its items.
    For ``app.run(main, flags_parser=cli.parse_flags)``.
    """
    import sys

    from absl import flags

    FLAGS = flags.FLAGS
    if any(a in ("--help", "-help", "-h", "--helpshort", "-?") for a in argv[1:]):
        print(FLAGS.main_module_help(), file=sys.stdout)
        sys.exit(0)
    keys = override_keys(argv[1:])
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        message = "; ".join(line.strip().rstrip(".") for line in str(e).splitlines())
        print(f"error: {message} (--help lists the flags)", file=sys.stderr)
        sys.exit(USER_ERROR)
    except (AttributeError, KeyError):  # a config override naming no key
        config = _load_config(argv[1:])
        why = [(k, unknown_key(config, k)) for k in keys] if config is not None else []
        bad = [f"--config.{k} names no config key: {w}" for k, w in why if w]
        print(
            f"config error: {bad[0]}"
            if bad
            else "config error: one of the overrides names no config key: "
            + " ".join(f"--config.{k}" for k in keys),
            file=sys.stderr,
        )
        sys.exit(USER_ERROR)
    config = FLAGS["config"].value if "config" in FLAGS else None
    twice = sorted(
        {k for k in keys if keys.count(k) > 1 and not isinstance(_get(config, k), tuple)}
    )
    if twice:
        print(
            f"config error: config key {', '.join(twice)} is given more than once on the "
            "command line; give each key once",
            file=sys.stderr,
        )
        sys.exit(USER_ERROR)
    return rest


def _get(config, key: str):
    for part in key.split("."):
        config = config[part] if hasattr(config, "keys") and part in config.keys() else None
    return config
