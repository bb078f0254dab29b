"""Deterministic, resumable batches of examples; each host reads its own rows.

The stream of global batches depends only on the data, the seed and the global batch size;
a host reads only its block of rows of each, so the hosts together see what one process
would. The whole state is ``(epoch, position)``: restored from a checkpoint, it gives exactly
the batches that would have followed (docs/data.md, "The data iterator").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


class DataIterator:
    """Infinite iterator over this host's part of each global batch (lists of dicts).

    Args:
      examples: the whole dataset, any sequence with ``len`` and integer
        indexing (the same on every host); it is not copied.
      batch_size: examples per global batch (all hosts together).
      seed: shuffling seed.
      shuffle: False visits the examples in dataset order every epoch.
      rows: the rows of each global batch this host reads, a slice within
        ``[0, batch_size)``; default all of them.
      process_index, process_count: shorthand for ``rows``: host i of n reads
        the i-th of n equal blocks (``batch_size`` must divide evenly).
      drop_remainder: drop the last, smaller batch of each epoch; otherwise
        it is yielded as is (one host only: a short batch has no equal blocks).
    """

    def __init__(
        self,
        examples: Sequence[Mapping],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        rows: slice | None = None,
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
        if rows is None:
            if batch_size % process_count:
                raise ValueError(
                    f"batch_size={batch_size} does not split into {process_count} equal "
                    "blocks, one per host"
                )
            per = batch_size // process_count
            rows = slice(process_index * per, (process_index + 1) * per)
        elif process_count != 1:
            raise ValueError("give rows or process_index/process_count, not both")
        start = 0 if rows.start is None else rows.start
        stop = batch_size if rows.stop is None else rows.stop
        step = 1 if rows.step is None else rows.step
        if step != 1 or not 0 <= start < stop <= batch_size:
            raise ValueError(f"rows={rows!r} must be a block start:stop within [0, {batch_size})")
        if not drop_remainder and stop - start != batch_size:
            raise ValueError("drop_remainder=False needs one host reading whole batches")
        if not hasattr(examples, "__len__") or not hasattr(examples, "__getitem__"):
            raise TypeError(f"examples must be a sequence, got {type(examples).__name__}")
        self.examples = examples
        self.num_examples = len(examples)
        if self.num_examples == 0 or (drop_remainder and self.num_examples < batch_size):
            raise ValueError(f"{self.num_examples} examples are fewer than batch_size={batch_size}")
        self.batch_size = batch_size
        self.rows = slice(start, stop)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_remainder = drop_remainder
        self.epoch = 0
        self.position = 0  # examples of this epoch's permutation already consumed (globally)
        self._order_epoch, self._order = None, None

    @property
    def host_batch_size(self) -> int:
        """Examples this host gets from each (full) global batch."""
        return self.rows.stop - self.rows.start

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = self.num_examples
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        return self._order

    def next(self) -> list[dict]:
        """This host's rows of the next global batch; epochs roll over (and reshuffle)."""
        end = self.position + self.batch_size
        n = self.num_examples
        if end > n and (self.drop_remainder or self.position >= n):
            self.epoch, self.position = self.epoch + 1, 0
            end = self.batch_size
        batch_idx = self._epoch_order(self.epoch)[self.position : end]
        self.position = min(end, n)
        return [dict(self.examples[int(i)]) for i in batch_idx[self.rows]]

    __next__ = next

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        """JSON-serialisable position (the same on every host), plus what it is valid with."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": self.num_examples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_remainder": self.drop_remainder,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Continues from ``state_dict()`` of an iterator over the same data and settings.

        The state holds no host layout, so a run saved on n hosts resumes on
        any other number with the same global batches. Raises ValueError
        naming the first setting that differs (a changed dataset or batch
        size would silently resume somewhere else).
        """
        for key in ("epoch", "position"):
            if key not in state:
                raise ValueError(f"iterator state has no {key!r} (keys: {sorted(state)})")
        mine = self.state_dict()
        for key in ("seed", "num_examples", "batch_size", "shuffle", "drop_remainder"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"iterator state was saved with {key}={state[key]!r}, "
                    f"but this iterator has {key}={mine[key]!r}"
                )
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ValueError(f"iterator state epoch={epoch!r} must be a non-negative integer")
        if not (isinstance(position, int) and 0 <= position <= self.num_examples):
            raise ValueError(
                f"iterator state position={position!r} is not in [0, {self.num_examples}]"
            )
        self.epoch, self.position = epoch, position
