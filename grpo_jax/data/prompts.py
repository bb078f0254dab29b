"""Prompt formatting: plain templates, or a tokenizer's chat template.

A template is a ``str.format`` string over the example's fields (``{prompt}``,
``{answer}`` is available too but would leak it). The default asks for the
format the ``format`` reward checks and the answer where the ``gsm8k`` and
``exact_match`` rewards look for it. Synthetic tasks for tiny models use
``PLAIN_TEMPLATE`` (the problem text alone, as in their worked solutions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from grpo_jax.core.checks import check_bool
from grpo_jax.core.errors import ConfigError

PLAIN_TEMPLATE = "{prompt}"

FORMAT_INSTRUCTION = (
    "Think step by step inside <think> </think> tags, then give only the final "
    "answer inside <answer> </answer> tags."
)

THINK_ANSWER_TEMPLATE = "{prompt}\n" + FORMAT_INSTRUCTION

DEFAULT_TEMPLATE = THINK_ANSWER_TEMPLATE


def fill_template(template: str, example: Mapping | str) -> str:
    """``template.format(**example)`` with errors that name the missing field."""
    fields = {"prompt": example} if isinstance(example, str) else dict(example)
    try:
        return template.format_map(fields)
    except KeyError as e:
        raise ValueError(
            f"prompt template {template!r} uses field {e.args[0]!r}, which the example "
            f"does not have (fields: {sorted(fields)})"
        ) from None
    except (IndexError, ValueError) as e:
        raise ValueError(
            f"prompt template {template!r} is not a valid format string ({e}); "
            "write literal braces as {{ and }}"
        ) from None


def format_prompt(
    example: Mapping | str,
    *,
    template: str | None = None,
    tokenizer=None,
    chat: bool = False,
    system: str | None = None,
) -> str:
    """The text the policy is prompted with.

    Args:
      example: an example dict (at least "prompt") or the bare question.
      template: format string over the example's fields; default
        ``DEFAULT_TEMPLATE`` (question + <think>/<answer> instruction).
      tokenizer: a transformers tokenizer; needed when ``chat``.
      chat: wrap the filled template as the user turn of the tokenizer's chat
        template, with the assistant turn opened
        (``apply_chat_template(..., add_generation_prompt=True, tokenize=False)``).
      system: optional system message (chat), or a preamble line (plain).
    """
    text = fill_template(DEFAULT_TEMPLATE if template is None else template, example)
    if not chat:
        return text if system is None else f"{system}\n\n{text}"
    if tokenizer is None:
        raise ValueError("chat=True needs a tokenizer with a chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} "
            f"({getattr(tokenizer, 'name_or_path', '?')!r}) has no chat template; "
            "use chat=False with a plain template"
        )
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """How an example becomes a prompt (``grpo_jax.data.format_prompt``).

    template: str.format template over the example's fields ("{prompt}").
    chat: wrap in the tokenizer's chat template.
    system: system message (chat) or preamble (plain); "" for none.
    """

    template: str = "{prompt}"
    chat: bool = False
    system: str = ""

    def __post_init__(self):
        if not isinstance(self.template, str) or "{" not in self.template:
            raise ConfigError(
                f"config key 'prompt.template' = {self.template!r} must be a format string "
                "over the example's fields, such as '{prompt}'"
            )
        check_bool("prompt.chat", self.chat)
