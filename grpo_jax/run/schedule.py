"""The run's schedule: which steps evaluate and checkpoint, and what ends the run
(``train.steps``, or ``train.sampled_tokens_budget`` of completion tokens sampled)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Schedule:
    """Counts the completion tokens sampled and the wall time, across restarts (its
    ``state_dict``), and decides from them and the step what comes after a step.

    ``t_start``: ``time.time()`` when this process started; ``say``: where the line that
    the budget ended the run goes.
    """

    def __init__(self, run, t_start: float, say: Callable[[str], None]):
        self.run, self.t_start, self.say = run, t_start, say
        self.sampled_tokens = 0  # completion tokens sampled so far
        self.prior_seconds = 0.0  # the wall time of the run's earlier processes

    def sampled(self, tokens: int) -> int:
        """Counts a step's sampled completion tokens -> the run's total so far."""
        self.sampled_tokens += tokens
        return self.sampled_tokens

    def budget_spent(self) -> bool:
        """Whether train.sampled_tokens_budget (when set) has been reached."""
        budget = self.run.train.sampled_tokens_budget
        return bool(budget) and self.sampled_tokens >= budget

    def due(self, step: int) -> tuple[bool, bool]:
        """(evaluate, checkpoint) after ``step``; the last step's are the run's final ones."""
        run = self.run
        last = step == run.train.steps or self.budget_spent()
        do_eval = bool(run.eval.every) and step % run.eval.every == 0 and not last
        do_ckpt = bool(run.checkpoint.every) and step % run.checkpoint.every == 0 and not last
        return do_eval, do_ckpt

    def ended_by(self, step: int) -> str:
        """What ended the run at ``step``: "train.sampled_tokens_budget" (said in one line
        with the figures) or "train.steps"."""
        steps, budget = self.run.train.steps, self.run.train.sampled_tokens_budget
        if step >= steps or not self.budget_spent():
            return "train.steps"
        self.say(
            f"stopping after step {step} of {steps}: train.sampled_tokens_budget is spent "
            f"({self.sampled_tokens} completion tokens sampled, budget {budget})"
        )
        return "train.sampled_tokens_budget"

    def wall_seconds(self) -> float:
        """The run's wall time so far, its earlier processes included."""
        return self.prior_seconds + time.time() - self.t_start

    def state_dict(self) -> dict:
        return {"sampled_tokens": self.sampled_tokens, "wall_seconds": self.wall_seconds()}

    def load_state_dict(self, state: dict) -> None:
        self.sampled_tokens = int(state.get("sampled_tokens", 0))
        self.prior_seconds = float(state.get("wall_seconds", 0.0))
