"""Packing sequences into rows of a fixed length, and rows into balanced bins (numpy).

The host-side half of sequence packing (docs/packing.md): the update's planner
(``grpo_jax.learner.packing``) decides here which sequence goes in which row and which
row in which micro-batch and shard, then builds its index arrays.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Items (their indices) into bins of ``capacity``: each item, longest first, into the
    first bin it fits, else a new one (within 11/9 of the fewest bins plus one).

    Ties keep the items' order, so the result depends on the lengths alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"an item of {n} does not fit a bin of {capacity}")
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


def balance(sizes: Sequence[int], num_bins: int, per_bin: int) -> list[list[int]]:
    """Items (their indices) into ``num_bins`` bins of at most ``per_bin`` items each, the
    bins' total sizes as even as the greedy rule makes them: the largest item first, each
    into the bin with the smallest total that has room (ties: the lowest bin).
    """
    if len(sizes) > num_bins * per_bin:
        raise ValueError(f"{len(sizes)} items do not fit {num_bins} bins of {per_bin}")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = [(0, b) for b in range(num_bins)]  # (total, bin) of the bins with room
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in order:
        total, b = heapq.heappop(heap)
        bins[b].append(i)
        if len(bins[b]) < per_bin:
            heapq.heappush(heap, (total + int(sizes[i]), b))
    return bins


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m
