"""Scores completions: texts -> weighted rewards (verifiable and learned), correctness and
format validity, for training rounds and for evaluation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from grpo_jax import rewards
from grpo_jax.reward_models import add_learned, run_learned

CORRECT_THRESHOLD = 1.0 - 1e-6  # Correctness rewards return 1.0 / 0.0.


class Scorer:
    """Scores completions with the training rewards and judges correctness.

    Args:
      specs: the weighted training rewards (``rewards.RewardSpec``).
      correct_reward: the reward whose value 1.0 means "correct" (pass rate,
        pass@k); when it is not among ``specs`` it is scored with weight 0 (no
        part of the training reward, but logged and its errors counted).
      timeout_s: per-reward time budget (``rewards.score``).
      learned: (name, scorer, weight) of each learned reward: a reward model
        (``reward_models.LearnedReward``, "reward_model") or a judge
        (``reward_models.Judge``, "judge"); logged as ``rewards/<name>/...``,
        weighted in the total; a NaN score is an error.

    A completion has an invalid format when a reward named "format..." is among
    the specs and gives it 0, else when no final answer can be extracted from it.
    """

    def __init__(
        self,
        specs: Sequence[rewards.RewardSpec],
        *,
        correct_reward: str,
        timeout_s: float,
        learned: Sequence[tuple] = (),
    ):
        self.specs = tuple(specs)
        self.learned = tuple(learned)
        self.correct_reward = correct_reward
        self.timeout_s = timeout_s
        for s in self.specs:
            rewards.get(s.name)  # Unknown names fail now, naming the choices.
        rewards.get(correct_reward)
        names = [s.name for s in self.specs]
        self._format_name = next((n for n in names if n.split("(")[0] == "format"), None)
        self._extra = () if correct_reward in names else (rewards.RewardSpec(correct_reward, 0.0),)
        # Metric names: "format(pattern='[0-9]+')" logs as "format" when unambiguous.
        short = [n.split("(")[0] for n in names]
        self.display = {
            n: (b if short.count(b) == 1 else n) for n, b in zip(names, short, strict=True)
        }
        for extra in self._extra:  # the correctness reward never takes a training reward's name
            taken = set(self.display.values())
            b = extra.name.split("(")[0]
            self.display[extra.name] = next(
                x for x in (b, extra.name, f"{extra.name}[correct]") if x not in taken
            )

    def fields(self, examples: Sequence[Mapping], repeat: int) -> dict[str, list]:
        return rewards.fields_from_examples(examples, repeat, exclude=("prompt", "solution"))

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        examples: Sequence[Mapping],
        *,
        repeat: int,
        lengths_N=None,
    ):
        """-> (RewardResult of the training rewards, correct_N bool, invalid_N bool)."""
        fields = self.fields(examples, repeat)
        result = rewards.score(
            self.specs + self._extra,
            prompts,
            completions,
            fields,
            timeout_s=self.timeout_s,
            completion_lengths=None if lengths_N is None else [int(x) for x in lengths_N],
        )
        # A learned reward's question is the example's own prompt (its chat template's turn).
        questions = [str(ex.get("prompt", "")) for ex in examples for _ in range(repeat)]
        for name, learned, weight in self.learned:
            values_N = run_learned(
                name, learned, prompts, completions, questions, group_size=repeat
            )
            add_learned(result, name, values_N, weight)
            self.display.setdefault(name, name)
        correct_N = np.nan_to_num(result.per_reward[self.correct_reward]) >= CORRECT_THRESHOLD
        if self._format_name is not None:
            invalid_N = np.nan_to_num(result.per_reward[self._format_name]) <= 0
        else:
            invalid_N = np.array([rewards.extract_answer(c) is None for c in completions])
        # The correctness reward, when not a training reward, has weight 0: it leaves
        # the total alone but is logged (rewards/<name>/...) with its errors counted.
        return result, correct_N, invalid_N

    def state_dict(self) -> dict[str, dict]:
        """The running normalisations' moments (``reward_model.normalize = "running"``) by
        reward name, for the checkpoint: a resumed run standardises as an uninterrupted one."""
        return {
            name: learned.moments.state()
            for name, learned, _ in self.learned
            if getattr(learned, "moments", None) is not None
        }

    def load_state_dict(self, states: dict[str, dict]) -> None:
        for name, learned, _ in self.learned:
            if name in states and getattr(learned, "moments", None) is not None:
                learned.moments.restore(states[name])

    def correct(
        self,
        completions: Sequence[str],
        examples: Sequence[Mapping],
        *,
        repeat: int = 1,
        lengths_N=None,
    ) -> np.ndarray:
        """bool[N]: the correctness reward alone (evaluation)."""
        fields = self.fields(examples, repeat)
        result = rewards.score(
            (rewards.RewardSpec(self.correct_reward, 1.0),),
            [""] * len(completions),
            completions,
            fields,
            timeout_s=self.timeout_s,
            completion_lengths=None if lengths_N is None else [int(x) for x in lengths_N],
        )
        return np.nan_to_num(result.per_reward[self.correct_reward]) >= CORRECT_THRESHOLD
