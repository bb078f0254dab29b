"""A run's state: what changes as it trains, and what each checkpoint saves of it.

Every part that carries state across a restart is :class:`Stateful`, and
:meth:`RunState.parts` is the one list of them a checkpoint saves and a resumed run
restores (``grpo_jax.run.start``). docs/architecture.md, "The run's state".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from grpo_jax.core import distributed

if TYPE_CHECKING:
    from grpo_jax.data import DataIterator
    from grpo_jax.rollout.scorer import Scorer
    from grpo_jax.rollout.staleness import Staleness
    from grpo_jax.run.report import Reporter
    from grpo_jax.run.schedule import Schedule


class Stateful(Protocol):
    """A part of a run that carries state across a restart.

    ``state_dict()`` is JSON for the checkpoint's meta, under the part's name (None: nothing
    to save); ``load_state_dict(state)`` continues from it. A part that saves arrays too
    (the batches in flight) also has ``state_arrays()``, saved as the checkpoint's item of
    its name, and ``arrays_like(state)``, the shapes, dtypes and shardings to read them
    back into; its ``load_state_dict(state, arrays)`` then gets them, read and verified.
    """

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


# The TrainState's counters a checkpoint saves (its parameters and optimizer state are
# the checkpoint's own items).
COUNTERS = ("step", "updates", "skipped", "skipped_in_row")


class Counters:
    """The counters of the run's TrainState (steps, updates, skipped updates)."""

    def __init__(self, rs: RunState):
        self.rs = rs

    def state_dict(self) -> dict[str, int]:
        return {k: int(jax.device_get(getattr(self.rs.train, k))) for k in COUNTERS}

    def load_state_dict(self, state: dict[str, int]) -> None:
        train = self.rs.train

        def put(k, v):  # replicated, where the fresh counter is
            # A resumed run gets train.max_nonfinite_in_row fresh tries.
            value = np.int32(0 if k == "skipped_in_row" else v)
            return distributed.put(value, getattr(train, k).sharding)

        self.rs.train = train.replace(**{k: put(k, v) for k, v in state.items()})


@dataclasses.dataclass
class RunState:
    """What a run changes as it trains; ``grpo_jax.run.setup.Setup`` holds what it does not.

    Attributes:
      train: the TrainState (parameters, optimizer state, counters); the loop replaces it
        with each update's.
      iterator: the data iterator, at the next GRPO prompts to read.
      scorer: the reward scorer ``Setup.rollouts`` scores with: the learned rewards'
        running normalisation moments move as it scores.
      pipe: the rollout source behind the staleness wrapper: the batches in flight.
      report: the records written, the steps without reward signal, the health alarms.
      schedule: the completion tokens sampled (the budget) and the wall time so far.
    """

    train: Any
    iterator: DataIterator
    scorer: Scorer
    pipe: Staleness
    report: Reporter
    schedule: Schedule

    def parts(self) -> dict[str, Stateful]:
        """The parts a checkpoint saves, by their key in its meta (those of earlier
        versions, so that their checkpoints resume)."""
        return {
            "counters": Counters(self),
            "data_iterator": self.iterator,
            "reward_moments": self.scorer,
            "inflight": self.pipe,
            "health": self.report.alarms,
            "report": self.report,
            "schedule": self.schedule,
        }

    def state_dict(self) -> tuple[dict, dict]:
        """-> (each part's JSON by name, each part's arrays by name): what a checkpoint saves."""
        meta, arrays = {}, {}
        for name, part in self.parts().items():
            state = part.state_dict()
            if state is not None:
                meta[name] = state
            tree = part.state_arrays() if hasattr(part, "state_arrays") else None
            if tree:
                arrays[name] = tree
        return meta, arrays

    def read_arrays(self, meta: dict, read) -> dict:
        """Each part's arrays saved with ``meta``, by name: ``read(name, like)`` reads and
        verifies one item. Nothing changes yet (a step that fails here is not resumed)."""
        out = {}
        for name, part in self.parts().items():
            state = saved_state(meta, name)
            like = part.arrays_like(state) if hasattr(part, "arrays_like") else None
            if like is not None:
                out[name] = read(name, like)
        return out

    def load_state_dict(self, meta: dict, arrays: dict) -> None:
        """Every part continues from a checkpoint's ``meta`` and its :meth:`read_arrays`.

        A part the checkpoint holds nothing of (saved by an earlier version) starts afresh.
        """
        for name, part in self.parts().items():
            state = saved_state(meta, name)
            if state is None:
                continue
            if name in arrays:
                part.load_state_dict(state, arrays[name])
            else:
                part.load_state_dict(state)


# Checkpoints of earlier versions kept these parts' states as top-level keys of the meta:
# part -> {its key: the earlier meta key}.
_EARLIER_KEYS = {
    "report": {"no_signal_run": "no_signal_run", "records_through": "step"},
    "schedule": {"sampled_tokens": "sampled_tokens", "wall_seconds": "wall_seconds"},
}


def saved_state(meta: dict, name: str) -> Any:
    """Part ``name``'s state in a checkpoint's ``meta``, read from the keys of an earlier
    version's checkpoint when it has none of its own (None: nothing saved)."""
    if name in meta:
        return meta[name]
    earlier = {k: meta[old] for k, old in _EARLIER_KEYS.get(name, {}).items() if old in meta}
    return earlier or None
