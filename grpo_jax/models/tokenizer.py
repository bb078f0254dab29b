"""Tokenizers from a local checkpoint directory, and chat templates for instruct models.

Tokenizers come from ``transformers.AutoTokenizer`` with ``local_files_only``:
nothing is downloaded, and ``trust_remote_code`` is off unless asked for.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence

from grpo_jax.models.safetensors_io import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """The Hugging Face tokenizer saved in the directory ``path``."""
    from transformers import AutoTokenizer

    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such tokenizer directory")
    if not any((directory / f).exists() for f in TOKENIZER_FILES):
        raise CheckpointError(
            f"{directory}: no tokenizer files (looked for {list(TOKENIZER_FILES)})"
        )
    return AutoTokenizer.from_pretrained(
        str(directory), local_files_only=True, trust_remote_code=trust_remote_code
    )


def apply_chat_template(
    tokenizer, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
) -> str:
    """The prompt text of ``messages`` ([{"role", "content"}, ...]) under the tokenizer's template.

    ``add_generation_prompt`` ends the text with the assistant's turn header,
    so that the model's completion is the answer.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "format prompts as plain text or set tokenizer.chat_template"
        )
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
