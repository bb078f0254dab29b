"""Final-answer extraction and number normalisation for verifiable math rewards.

:func:`extract_answer` finds the segment that holds a completion's final answer
(``<answer>...</answer>``, then ``\\boxed{...}``, then GSM8K's ``####``, then the last number)
and :func:`normalize_number` turns it into an exact :class:`fractions.Fraction`, so that
``$1,080.00``, ``1080`` and ``\\boxed{1080}`` compare equal with no float rounding. Regex-only
and pure Python (docs/rewards.md, "The built-in rewards").
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number as people and models write it: optional minus (not when glued to a
# preceding word, digit or ")" -- there it is an operator, as in "16-3"),
# digits with optional thousands commas, optional decimals, or a plain fraction
# a/b. Written so that the last match in a text is the last number in it.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)])-)?"  # sign
    r"(?:"
    r"\d+/\d+(?![\d,.]*\d)"  # fraction 3/4
    r"|(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"  # 1,234.5 or 1234.5
    r"|\.\d+"  # .5
    r")"
)
_ANSWER_TAGS_RE = re.compile(r"<(/?)answer>", re.IGNORECASE)
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
_LATEX_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*(\d)(\d)")  # \frac12
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-"})


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: a truncated completion


def last_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>`` in ``text``, or None.

    Tags match case-insensitively; a block runs from an opening tag to the
    first closing tag after it (``re.findall(r"<tag>(.*?)</tag>")``, whose
    last match this is), found in one linear scan over the tags.
    """
    t = re.escape(tag)
    tags = _ANSWER_TAGS_RE if tag == "answer" else re.compile(rf"<(/?){t}>", re.IGNORECASE)
    last, start = None, None
    for m in tags.finditer(text):
        if not m.group(1):
            if start is None:
                start = m.end()
        elif start is not None:
            last, start = text[start : m.start()], None
    return last


def answer_segment(text: str) -> str:
    """The part of ``text`` that states the final answer.

    Precedence: the last ``<answer>`` tag (and a ``\\boxed`` inside it), else
    the last ``\\boxed{}``, else what follows the last ``####``, else the whole
    text.
    """
    tagged = last_tag(text)
    if tagged is not None:
        boxed = last_boxed(tagged)
        return boxed if boxed is not None else tagged
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1]
    return text


def _delatex(segment: str) -> str:
    segment = segment.translate(_MINUS_SIGNS)
    segment = _LATEX_FRAC_RE.sub(r"\1/\2", segment)
    segment = _LATEX_FRAC_SHORT_RE.sub(r"\1/\2", segment)
    # "\$", "\%", "\," and "\!" are LaTeX spellings of currency, percent, spaces.
    return re.sub(r"\\[$%,!;: ]", " ", segment)


def last_number(segment: str) -> str | None:
    """The last number written in ``segment`` (as written: "1,080", "-2.50", "3/4")."""
    matches = _NUMBER_RE.findall(_delatex(segment))
    return matches[-1] if matches else None


def normalize_number(s: str | None) -> Fraction | None:
    """Exact value of a number string, ignoring its dressing, or None.

    ``"$1,080.00"``, ``"1080 dollars"``, ``"1080.0"`` and ``"\\frac{2160}{2}"``
    all give ``Fraction(1080)``; ``"50%"`` gives 50 (GSM8K writes percentages
    as plain numbers); text with no number gives None. When ``s`` holds several
    numbers the last one counts.
    """
    if s is None:
        return None
    num = last_number(s)
    if num is None:
        return None
    num = num.replace(",", "")
    try:
        if "/" in num:
            p, q = num.split("/")
            return None if int(q) == 0 else Fraction(int(p), int(q))
        return Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None


def format_number(value: Fraction) -> str:
    """Canonical text of an exact number: "18", "-2.5", "1/3"."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:  # terminating decimal
        text = f"{float(value):.12f}".rstrip("0")
        if Fraction(text) == value:
            return text
    return f"{value.numerator}/{value.denominator}"


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a completion in canonical form, or None.

    Examples: ``"... so she makes $18.00 a day."`` -> ``"18"``;
    ``"<answer>1,080</answer>"`` -> ``"1080"``; ``"\\boxed{\\frac{1}{2}}"`` ->
    ``"0.5"``; ``"no idea"`` -> None.
    """
    value = normalize_number(answer_segment(text))
    return None if value is None else format_number(value)
