"""Built-in verifiable rewards: GSM8K correctness, format, over-length, exact match, countdown.

All are pure Python and regex-based, linear in the completion's length
(thousands of completions per second), and run in the trainer's process; they
return 1.0 / 0.0 (the over-length penalty: a value in [-1, 0]). A completion
that states no answer scores 0.0 (it is wrong, and scorable); NaN is kept for
completions that cannot be scored at all, such as an example whose reference
answer is not a number.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from grpo_jax.rewards.extract import answer_segment, last_tag, normalize_number
from grpo_jax.rewards.registry import register

NAN = float("nan")


def _column(fields: dict, key: str, reward: str) -> list:
    if key not in fields:
        raise KeyError(
            f"reward {reward!r} needs the dataset field {key!r}; got fields {sorted(fields)}"
        )
    return fields[key]


@register("gsm8k")
def gsm8k_correct(prompts, completions, *, answer, **_) -> list[float]:
    """1.0 if the completion's final number equals the reference ``answer``, else 0.0.

    The final number is taken from the last ``<answer>`` tag, else the last
    ``\\boxed{}``, else after ``####``, else the last number written; both sides
    are compared as exact fractions after removing commas, currency signs,
    units and trailing zeros (:mod:`grpo_jax.rewards.extract`). ``answer`` may
    be the bare number or a full GSM8K solution ending in ``#### <number>``.
    NaN where the reference has no number.
    """
    del prompts
    out = []
    for completion, ref in zip(completions, answer):
        gold = normalize_number(answer_segment(str(ref))) if ref is not None else None
        if gold is None:
            out.append(NAN)
            continue
        pred = normalize_number(answer_segment(completion))
        out.append(1.0 if pred is not None and pred == gold else 0.0)
    return out


def _block(tag: str) -> str:
    """Regex of ``\\s*<tag>content</tag>``: content with no <tag> or </tag> and a non-space.

    The content's leading whitespace is matched apart from its first non-space
    character, so there is a single way to split it and the match is linear in
    the text's length (a long block that is never closed, as in a truncated
    completion, costs one scan).
    """
    t = re.escape(tag)
    return rf"\s*<{t}>\s*(?!</?{t}>)\S(?:(?!</?{t}>).)*</{t}>"


def make_format_reward(
    think_tag: str | None = "think", answer_tag: str = "answer", pattern: str | None = None
):
    """Reward 1.0 for completions of the form ``<think>...</think><answer>...</answer>``.

    Whitespace is allowed around the blocks; both must be non-empty and nothing
    may follow the answer (DeepSeek-R1's format reward). ``think_tag=None``
    asks for the answer block alone; ``pattern`` replaces the template with any
    regex, matched with ``re.fullmatch`` and DOTALL. The template matches in
    time linear in the completion's length; a ``pattern`` may not, so a format
    reward with one runs in a killable worker process
    (:mod:`grpo_jax.rewards.isolation`).
    """
    if pattern is None:
        body = _block(answer_tag) + r"\s*"
        if think_tag is not None:
            body = _block(think_tag) + body
        pattern = body
    regex = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, **_) -> list[float]:
        del prompts
        return [1.0 if regex.fullmatch(c) else 0.0 for c in completions]

    format_reward.pattern = pattern
    return format_reward


register("format", factory=True)(make_format_reward)


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    """DAPO's soft over-long punishment (Yu et al. 2025, eq. 13).

    ``0`` for ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache``
    (falling linearly from 0 to -1) for ``L_max - L_cache < |y| <= L_max``;
    ``-1`` beyond ``L_max``. Here ``L_max = max_len``, ``L_cache = buffer``,
    lengths in tokens.
    """
    safe = max_len - buffer
    if length <= safe:
        return 0.0
    if length <= max_len:
        return (safe - length) / buffer
    return -1.0


def make_overlong_reward(max_len: int = 512, buffer: int = 128):
    """DAPO over-length penalty on the ``completion_lengths`` field (tokens).

    ``max_len`` should be the sampler's maximum number of new tokens (DAPO's
    L_max): the penalty then ramps from 0 to -1 over the last ``buffer``
    tokens before truncation and is -1 for a truncated completion.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"overlong: max_len={max_len!r} must be a positive integer")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer <= max_len:
        raise ValueError(f"overlong: buffer={buffer!r} must be an integer in [1, max_len]")

    def overlong_reward(prompts, completions, **fields) -> list[float]:
        del prompts
        lengths = _column(fields, "completion_lengths", "overlong")
        if len(lengths) != len(completions):
            raise ValueError(f"{len(lengths)} completion_lengths for {len(completions)}")
        return [overlong_penalty(int(n), max_len, buffer) for n in lengths]

    return overlong_reward


register("overlong", factory=True)(make_overlong_reward)


def make_exact_match(tag: str | None = "answer"):
    """1.0 if the ``<tag>`` content (whitespace stripped) equals ``answer`` stripped.

    ``tag=None`` compares the whole completion. A completion without the tag
    scores 0.0. For the synthetic tasks, whose ``answer`` is the exact string
    the model must write (digits possibly reversed).
    """

    def exact_match(prompts, completions, *, answer, **_) -> list[float]:
        del prompts
        out = []
        for completion, ref in zip(completions, answer):
            if ref is None:
                out.append(NAN)
                continue
            got = completion if tag is None else last_tag(completion, tag)
            out.append(1.0 if got is not None and got.strip() == str(ref).strip() else 0.0)
        return out

    return exact_match


register("exact_match", factory=True)(make_exact_match)

_ALLOWED_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def eval_countdown(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression over integers with + - * / and parentheses.

    Returns (value, integers used). Raises ValueError for anything else
    (names, powers, unary minus, floats, division by zero, over 200 chars).
    """
    if len(expr) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expr!r}") from e
    used: list[int] = []

    def ev(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if b == 0:
                raise ValueError("division by zero")
            return a / b
        raise ValueError(f"{ast.dump(node)[:40]} is not allowed")

    return ev(tree), used


@register("countdown")
def countdown_correct(prompts, completions, *, answer, numbers, **_) -> list[float]:
    """1.0 if the ``<answer>`` expression uses ``numbers`` once each and equals ``answer``.

    The expression may end with ``= <target>``; only + - * / and parentheses
    over the given integers are accepted (TinyZero's countdown reward).
    """
    del prompts
    out = []
    for completion, target, nums in zip(completions, answer, numbers):
        if target is None or nums is None:
            out.append(NAN)
            continue
        expr = last_tag(completion)
        if expr is None:
            out.append(0.0)
            continue
        expr = expr.split("=")[0]
        try:
            value, used = eval_countdown(expr)
        except ValueError:
            out.append(0.0)
            continue
        ok = Counter(used) == Counter(int(x) for x in nums) and value == Fraction(int(target))
        out.append(1.0 if ok else 0.0)
    return out
