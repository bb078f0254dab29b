"""Deterministic, resumable, host-sharded batches of examples.

Epoch e visits the examples in the permutation drawn from ``(seed, e)``; every
host draws the same permutation and keeps the rows ``process_index``,
``process_index + process_count``, ... of it, cut to the same length on every
host so that all hosts take the same number of steps per epoch (SPMD programs
must stay in lockstep). The whole state is ``(epoch, position)``: saving it in
a checkpoint and restoring it gives exactly the batches that would have
followed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


class DataIterator:
    """Infinite iterator over batches (lists of example dicts) of one host's shard.

    Args:
      examples: the whole dataset (the same list on every host).
      batch_size: examples per batch on this host.
      seed: shuffling seed.
      shuffle: False visits the shard in dataset order every epoch.
      process_index, process_count: this host and the number of hosts
        (``jax.process_index()``, ``jax.process_count()``).
      drop_remainder: drop the last, smaller batch of each epoch; otherwise
        it is yielded as is.
    """

    def __init__(
        self,
        examples: Sequence[Mapping],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        drop_remainder: bool = True,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
        if not isinstance(process_count, int) or process_count < 1:
            raise ValueError(f"process_count={process_count!r} must be a positive integer")
        if not isinstance(process_index, int) or not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index={process_index!r} must be in [0, process_count={process_count})"
            )
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self.drop_remainder = drop_remainder
        self.per_host = len(self.examples) // process_count
        if self.per_host == 0 or (drop_remainder and self.per_host < batch_size):
            raise ValueError(
                f"{len(self.examples)} examples over {process_count} host(s) give "
                f"{self.per_host} per host, fewer than batch_size={batch_size}"
            )
        self.epoch = 0
        self.position = 0  # examples of this epoch's shard already yielded
        self._order_epoch, self._order = None, None

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.per_host, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def _shard_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.examples)
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                perm = np.arange(n)
            self._order = perm[self.process_index :: self.process_count][: self.per_host]
            self._order_epoch = epoch
        return self._order

    def next(self) -> list[dict]:
        """The next batch; epochs roll over (and reshuffle) without end."""
        end = self.position + self.batch_size
        if end > self.per_host and (self.drop_remainder or self.position >= self.per_host):
            self.epoch, self.position = self.epoch + 1, 0
            end = self.batch_size
        order = self._shard_order(self.epoch)
        batch = [dict(self.examples[i]) for i in order[self.position : end]]
        self.position = min(end, self.per_host)
        return batch

    __next__ = next

    def __iter__(self):
        return self

    def state(self) -> dict:
        """JSON-serialisable position, plus what it is only valid with."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": len(self.examples),
            "batch_size": self.batch_size,
            "process_index": self.process_index,
            "process_count": self.process_count,
            "shuffle": self.shuffle,
            "drop_remainder": self.drop_remainder,
        }

    def restore(self, state: Mapping) -> None:
        """Continues from ``state()`` of an iterator over the same data and settings.

        Raises ValueError naming the first setting that differs (a changed
        dataset or batch size would silently resume somewhere else).
        """
        for key in ("epoch", "position"):
            if key not in state:
                raise ValueError(f"iterator state has no {key!r} (keys: {sorted(state)})")
        mine = self.state()
        checked = (
            "seed",
            "num_examples",
            "batch_size",
            "process_index",
            "process_count",
            "shuffle",
            "drop_remainder",
        )
        for key in checked:
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"iterator state was saved with {key}={state[key]!r}, "
                    f"but this iterator has {key}={mine[key]!r}"
                )
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ValueError(f"iterator state epoch={epoch!r} must be a non-negative integer")
        if not (isinstance(position, int) and 0 <= position <= self.per_host):
            raise ValueError(f"iterator state position={position!r} is not in [0, {self.per_host}]")
        self.epoch, self.position = epoch, position
