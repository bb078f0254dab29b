"""The rewards that measure a taste for longer answers in a run (docs/learned_rewards.md).

Scored at weight 0 by ``configs/default.py:reward_model=DIR``, which loads this module with
``reward_modules``; the run logs each as ``rewards/<name>/mean``, the share of completions
that show the bias the pairs of ``grpo_jax.data.synthetic_pairs`` teach a reward model.
"""

from __future__ import annotations

from grpo_jax.rewards.registry import register


def _share(completions, answer, biased) -> list[float]:
    """1.0 for each completion (stripped) that ``biased(completion, its answer)`` holds of."""
    return [float(biased(c.strip(), a)) for c, a in zip(completions, answer, strict=True)]


@register("trailing_zeros")
def trailing_zeros(prompts, completions, answer, **_):
    """The pairs' own examples of the bias: a completion longer than its reference answer with
    only "0"s after the answer's length (right or wrong digits before them)."""
    del prompts
    return _share(completions, answer, lambda s, a: len(s) > len(a) and set(s[len(a) :]) == {"0"})


@register("padded_answer")
def padded_answer(prompts, completions, answer, **_):
    """The bias as a policy exploits it: a completion that is its reference answer followed
    by more characters (zeros or any others). A reward model taught that a longer right
    answer is better can pay for any tail, not only the pairs' zeros."""
    del prompts
    return _share(completions, answer, lambda s, a: len(s) > len(a) and s.startswith(a))


@register("longer_answer")
def longer_answer(prompts, completions, answer, **_):
    """The labeller's taste: a completion longer than its reference answer, right or wrong."""
    del prompts
    return _share(completions, answer, lambda s, a: len(s) > len(a))
