"""Run configs for tests: the smoke config of configs/default.py with dotted overrides.

``smoke_config(**{"grpo.beta": 0.04, "rewards": "overlong:1.0"})`` is
``get_config("smoke")`` with those fields set; ``SHORT_RUN`` holds the overrides most
whole-run tests start from (no warm start, no evaluation, four steps, a checkpoint every two).
``run_config(**overrides)`` is that config parsed: the ``RunConfig`` library code takes.
``Console`` is a run's progress line that keeps its messages for a test to read.
"""

import io

from configs.default import get_config
from grpo_jax.run.config import parse_config
from grpo_jax.run.writers import ProgressLine

# A four-step run with the fewest compilations: no warm start, no sampled pass@k evaluation.
SHORT_RUN = {
    "warm_start.enabled": False,
    "eval.num_samples": 0,
    "eval.every": 0,
    "train.steps": 4,
    "checkpoint.every": 2,
}


def apply_overrides(config, overrides):
    """Sets ``config[a][b] = value`` for every ``"a.b": value`` (any depth; "seed" is top
    level) of ``overrides``, in order; a ConfigDict or a plain dict. Returns ``config``."""
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        node = config
        for key in path:
            node = node[key]
        node[last] = value
    return config


class Console(ProgressLine):
    """A progress line (the type a run's ``Records`` holds) whose messages are kept in
    ``said`` instead of printed; ``enabled=False`` is another host's, which has none."""

    def __init__(self, total_steps: int = 1, *, enabled: bool = True):
        super().__init__(total_steps, stream=io.StringIO(), enabled=enabled)
        self.said: list[str] = []

    def message(self, text: str) -> None:
        if self.enabled:
            self.said.append(text)


def run_config(**overrides):
    """``parse_config(smoke_config(**overrides))``: a real ``RunConfig`` for code that reads
    one (the memory plan), every section and field present."""
    return parse_config(smoke_config(**overrides))


def smoke_config(*, plain: bool = False, **overrides):
    """``get_config("smoke")`` with ``overrides`` applied; ``plain``: as a plain dict (no
    ConfigDict type checks, for tests that hand the parser values of the wrong type)."""
    c = get_config("smoke")
    if plain:
        c = c.to_dict()
    return apply_overrides(c, overrides)
