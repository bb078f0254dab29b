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
