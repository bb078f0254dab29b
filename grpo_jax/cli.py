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


def quiet() -> None:
    """Silences third-party INFO logs and advisory banners; call before importing them."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in ("jax", "absl", "orbax"):
        logging.getLogger(name).setLevel(logging.WARNING)


# Exit status of a user error (bad config, input file, workdir, checkpoint): one line on
# stderr, the traceback only under --verbose.
USER_ERROR = 2


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean the user's input is wrong, not grpo_jax."""
    from grpo_jax.checkpoint import CheckpointError
    from grpo_jax.config import ConfigError
    from grpo_jax.data.jsonl import MalformedRowError, NotUTF8Error
    from grpo_jax.distributed import DistributedError
    from grpo_jax.models.safetensors_io import CheckpointError as SafetensorsError
    from grpo_jax.workdir import WorkdirBusyError

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
    import sys

    from grpo_jax.config import ConfigError

    prefix = "config error" if isinstance(e, ConfigError) else "error"
    print(f"{prefix}: {e}", file=stream or sys.stderr)
    return USER_ERROR


def parse_flags(argv):
    """absl's flag parsing, with a flag or config-key typo as one line (exit 2) and --help as 0.

    For ``app.run(main, flags_parser=cli.parse_flags)``.
    """
    import sys

    from absl import flags

    FLAGS = flags.FLAGS
    if any(a in ("--help", "-help", "-h", "--helpshort", "-?") for a in argv[1:]):
        print(FLAGS.main_module_help(), file=sys.stdout)
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e} (--help lists the flags)", file=sys.stderr)
    except (AttributeError, KeyError) as e:  # a config override naming no key
        bad = [a for a in argv[1:] if a.startswith("--config.")]
        print(
            f"config error: an override names a key the config does not have ({e}); "
            f"overrides given: {bad}",
            file=sys.stderr,
        )
    sys.exit(USER_ERROR)
