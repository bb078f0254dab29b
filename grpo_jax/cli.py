"""What the command-line entry points share: quiet logs, flag parsing, one-line errors.

``quiet()`` keeps a run's console to what a person reads: the progress line,
warnings and errors. Libraries' start-up chatter (JAX's backend probing, the
tokenizer library's note that PyTorch is absent, Orbax's per-save INFO lines)
is dropped; ``--verbosity=0`` (absl) or a logging configuration of your own
brings INFO back for grpo_jax's own loggers. Every command reports the errors it
expects through :func:`report_error`: one line on stderr and an exit status.
"""

from __future__ import annotations

import logging
import os
import sys

from grpo_jax.core.errors import (
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
# Exit status of a run stopped by too many non-finite updates.
NON_FINITE = 3
# Exit status of a run a health alarm stopped (health.stop_on_alarm; its checkpoint saved),
# and of its rerun, which refuses to resume past the stop without
# health.resume_after_stop.
ALARM_STOP = 4


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean the user's input is wrong, not grpo_jax."""
    # Inside the function on purpose: the models package imports JAX, which the entry
    # points import only after ``quiet()``; the other types are ``grpo_jax.core.errors``'.
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


def report_error(
    problem: BaseException | str,
    *,
    prefix: str | None = None,
    status: int = USER_ERROR,
    stream=None,
) -> int:
    """Prints ``<prefix>: <problem>`` on stderr and returns ``status``: how every command
    reports an error it expects (a user error by default, USER_ERROR).

    ``prefix`` says what kind of error it is; by default "config error" for a ConfigError
    and "error" for anything else. A message of several lines (a memory plan's table)
    prints as it is.
    """
    if prefix is None:
        prefix = "config error" if isinstance(problem, ConfigError) else "error"
    print(f"{prefix}: {problem}", file=stream or sys.stderr)
    return status


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


def config_spec(argv) -> str | None:
    """The ``file.py[:arg]`` of ``argv``'s ``--config=...`` (or ``--config ...``), or None."""
    for i, a in enumerate(argv):
        if a == "--":
            break
        name, sep, value = a.lstrip("-").partition("=")
        if not a.startswith("-") or name != "config":
            continue
        if sep:
            return value
        return argv[i + 1] if i + 1 < len(argv) else ""
    return None


def load_config_file(spec: str):
    """The ConfigDict of ``spec`` (``file.py[:arg]``), as ``--config=spec`` would build it.

    Raises ConfigError with one line naming the problem: a missing file, a directory, a
    file that is not Python or defines no ``get_config``, an argument ``get_config``
    refuses (its message), or any other error of the file's code (its type, message and
    the file's line; ``--verbose`` shows the traceback).
    """
    import importlib.util
    import pathlib
    import traceback

    path, sep, arg = spec.partition(":")
    file = pathlib.Path(path)
    where = f"--config={spec}"
    if not path:
        raise ConfigError(f"{where} names no config file (--config=configs/default.py)")
    if file.is_dir():
        raise ConfigError(f"{where}: {path} is a directory, not a config file (configs/*.py)")
    if not file.exists():
        raise ConfigError(f"{where}: config file {path} does not exist")
    try:
        module_spec = importlib.util.spec_from_file_location("_cli_config", file)
        if module_spec is None:
            raise ConfigError(f"{where}: {path} is not a Python file (configs/*.py)")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            raise ConfigError(f"{where}: {path} defines no get_config(arg) function")
        return module.get_config(*([arg] if sep else []))
    except ConfigError:
        raise
    except SyntaxError as e:
        raise ConfigError(f"{where}: {e.filename}:{e.lineno}: {e.msg}") from e
    except (ValueError, TypeError, KeyError) as e:  # get_config refused its argument
        raise ConfigError(f"{where}: {_one_line(e)}") from e
    except Exception as e:  # noqa: BLE001 - the config file's own code failed
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(file)]
        line = f" ({path}, line {frames[-1].lineno})" if frames else ""
        raise ConfigError(
            f"{where}: {type(e).__name__}: {_one_line(e)}{line}; --verbose shows the traceback"
        ) from e


def config_module(name: str, *, beside: str):
    """The module ``<name>.py`` in the folder of the config file ``beside`` (its ``__file__``).

    How a config file reaches the shared base it builds on (``configs/common.py``), whether
    ``--config`` loads it by its path or a test imports it as ``configs.<file>``: the
    folder need not be on ``sys.path``.
    """
    import importlib.util
    import pathlib

    path = pathlib.Path(beside).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"grpo_jax_configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_line(e: BaseException) -> str:
    return "; ".join(x.strip() for x in str(e).splitlines() if x.strip()) or type(e).__name__


def _load_config(argv):
    """The ConfigDict that ``argv``'s ``--config=file.py[:arg]`` names, or None."""
    spec = config_spec(argv)
    if spec is None:
        return None
    try:
        return load_config_file(spec)
    except ConfigError:  # reported where the flags are parsed
        return None


def _config_problem(argv) -> str | None:
    """One line saying why ``argv``'s ``--config`` cannot be loaded, or None if it can."""
    spec = config_spec(argv)
    if spec is None:
        return None
    try:
        load_config_file(spec)
    except ConfigError as e:
        return str(e)
    return None


def _fail(prefix: str, message: str, argv) -> None:
    """Reports ``message`` (:func:`report_error`) and exits with USER_ERROR; under
    --verbose the traceback of the exception being handled comes first."""
    import traceback

    if "--verbose" in argv and sys.exc_info()[0] is not None:
        traceback.print_exc()
    sys.exit(report_error(message, prefix=prefix))


def parse_flags(argv):
    """absl's flag parsing, with a flag or config-key typo as one line (exit 2) and --help as 0.

    A config file that is missing, or that fails to build its config, is one line too
    (:func:`load_config_file`). A config key given twice is refused (absl would keep the
    last value silently), except a tuple's: its later value replaces the earlier one (a
    tuple is given whole, ``--config.eval.seeds="(0,1,2)"``).
    For ``app.run(main, flags_parser=cli.parse_flags)``.
    """
    from absl import flags

    FLAGS = flags.FLAGS
    if any(a in ("--help", "-help", "-h", "--helpshort", "-?") for a in argv[1:]):
        print(FLAGS.main_module_help(), file=sys.stdout)
        sys.exit(0)
    keys = override_keys(argv[1:])
    repeated = {k for k in keys if keys.count(k) > 1}
    if repeated:
        # absl joins a tuple's repeated flags into one tuple; keep the last one alone.
        config = _load_config(argv[1:])
        argv = keep_last(argv, {k for k in repeated if isinstance(_get(config, k), tuple)})
        keys = override_keys(argv[1:])
    try:
        rest = FLAGS(argv)
    except Exception as e:
        problem = _config_problem(argv[1:])  # the file itself, before what overrides it
        if problem:
            _fail("config error", problem, argv)
        if isinstance(e, flags.Error):
            message = "; ".join(line.strip().rstrip(".") for line in str(e).splitlines())
            _fail("error", f"{message} (--help lists the flags)", argv)
        if not isinstance(e, (AttributeError, KeyError)):
            raise
        # A config override naming no key.
        config = _load_config(argv[1:])
        why = [(k, unknown_key(config, k)) for k in keys] if config is not None else []
        bad = [f"--config.{k} names no config key: {w}" for k, w in why if w]
        _fail(
            "config error",
            bad[0]
            if bad
            else "one of the overrides names no config key: "
            + " ".join(f"--config.{k}" for k in keys),
            argv,
        )
    config = FLAGS["config"].value if "config" in FLAGS else None
    if config is not None and not _loaded(config):
        # config_flags defers a file it could not read to the first use of the config.
        problem = _config_problem(argv[1:]) or f"--config={config_spec(argv[1:])} cannot be read"
        _fail("config error", problem, argv)
    twice = sorted(k for k in set(keys) if keys.count(k) > 1)
    if twice:
        _fail(
            "config error",
            f"config key {', '.join(twice)} is given more than once on the command line; "
            "give each key once",
            argv,
        )
    return rest


def _loaded(config) -> bool:
    """False for the stand-in config_flags keeps for a file it could not load."""
    try:
        config.keys  # noqa: B018 - the stand-in raises on any attribute
    except OSError:
        return False
    return True


def keep_last(argv, keys) -> list[str]:
    """``argv`` without the earlier ``--config.<key>`` overrides of each of ``keys`` (with
    their values, when given as the next argument)."""
    last = {}
    for i, a in enumerate(argv):
        if a == "--":
            break
        for k in override_keys([a]):
            last[k] = i
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        ks = override_keys([a]) if "--" not in argv[:i] else []
        if ks and ks[0] in keys and last[ks[0]] != i:
            skip = "=" not in a  # "--config.key value": the value goes too
            continue
        out.append(a)
    return out


def _get(config, key: str):
    for part in key.split("."):
        config = config[part] if hasattr(config, "keys") and part in config.keys() else None
    return config
