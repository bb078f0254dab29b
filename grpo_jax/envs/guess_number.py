"""``guess_number``: find a hidden integer from higher/lower feedback (a multi-turn task).

The first observation is ``"guess {low}-{high}:"``; each model turn is a guess, answered
``"H"``, ``"L"`` or ``"?"``, up to ``max_turns`` turns. Finding it on turn k of K scores
``1 - (k - 1) / K``. The hidden number is the example's ``target``, else its integer
``answer`` reduced into ``[low, high]`` (docs/multiturn.md, "Writing an environment").
"""

from __future__ import annotations

import re

from grpo_jax.envs.base import register

_INT = re.compile(r"-?\d+")


@register("guess_number")
class GuessNumber:
    def __init__(self, low: int = 0, high: int = 9, max_turns: int = 4):
        if not (isinstance(low, int) and isinstance(high, int) and low <= high):
            raise ValueError(f"guess_number: need integers low <= high, got {low}, {high}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"guess_number: max_turns = {max_turns!r} must be >= 1")
        self.low, self.high, self.max_turns = low, high, max_turns
        self.hidden = None
        self.turn = 0

    def reset(self, example) -> str:
        if "target" in example:
            hidden = int(example["target"])
        else:
            span = self.high - self.low + 1
            hidden = self.low + int(str(example["answer"]).strip()) % span
        if not self.low <= hidden <= self.high:
            raise ValueError(f"hidden number {hidden} outside [{self.low}, {self.high}]")
        self.hidden, self.turn = hidden, 0
        return f"guess {self.low}-{self.high}:"

    def step(self, text: str):
        self.turn += 1
        m = _INT.search(text)
        guess = int(m.group()) if m else None
        if guess == self.hidden:
            reward = 1.0 - (self.turn - 1) / self.max_turns
            return None, reward, True, {"success": True, "turns": self.turn}
        if self.turn >= self.max_turns:
            return None, 0.0, True, {"success": False, "turns": self.turn}
        obs = "?" if guess is None else ("H" if guess < self.hidden else "L")
        return obs, 0.0, False, {"success": False}
