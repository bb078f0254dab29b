"""Misbehaving rewards for tests/rewards/test_rewards_scoring.py, registered at import.

They live apart from the tests so that a reward worker process, which imports the
module that registered a reward, imports only this one (numpy and the reward
registry, a fraction of a second) and not the test module with JAX (seconds per
worker started).
"""

import threading

import numpy as np

from grpo_jax import rewards

RELEASE = threading.Event()  # lets abandoned "hanging" threads finish at the end


@rewards.register("test_raises_on_boom")
def _raises_on_boom(prompts, completions, **_):
    if any("boom" in c for c in completions):
        raise RuntimeError("boom")
    return [1.0] * len(completions)


@rewards.register("test_always_raises")
def _always_raises(prompts, completions, **_):
    raise ValueError("broken verifier")


@rewards.register("test_hangs_on_hang")
def _hangs(prompts, completions, **_):
    if any("hang" in c for c in completions):
        RELEASE.wait()  # blocks past any deadline in these tests
    return [0.5] * len(completions)


@rewards.register("test_wrong_length")
def _wrong_length(prompts, completions, **_):
    return [1.0] * (len(completions) + 1)


@rewards.register("test_mixed_values")
def _mixed(prompts, completions, **_):
    return [1, None, "abc", float("nan"), np.float32(0.5)][: len(completions)]
