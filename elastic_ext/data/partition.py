"""Deterministic re-partitioning of an epoch's sample index space.

Pure functions, no communication: every rank computes the same answer from
the same inputs, so the data split needs no broadcast when the world size
changes. The vocabulary:

- *order*: the epoch's permutation of ``range(size)`` (seeded by
  ``(seed, epoch)``; identity without shuffling). It is *virtual*: an
  :class:`EpochOrder` computes the index at any position directly, so no
  array of ``size`` entries is built, but for a shuffle of fewer than
  4,096 samples (see :class:`FeistelOrder`).
- *cursor*: how many positions of the order the job has consumed (committed
  state, identical on every rank).
- *global step*: consumes the next ``global_batch`` positions; rank ``r``
  takes a contiguous share of them (shares differ by at most one sample when
  ``global_batch`` is not a multiple of the world size).
- *policy* at the end of the epoch, when fewer than ``global_batch``
  positions remain: ``"drop"`` leaves them out (they are never seen this
  epoch); ``"pad"`` fills the last step with positions from the start of
  the order and marks them, so they can be left out of loss and metrics.

Exactly once: global steps take disjoint consecutive slices of the order,
and a resize only changes how the *next* slices are cut, starting from the
committed cursor. A rollback restores the cursor with the weights, so the
lost steps' positions are handed out again, once.

Cost: a plan is a handful of integers. A rank computes the indices of a step
when it reaches it, in time proportional to its share of the step, so a
newcomer's first batch costs the same at ten million samples as at a
billion, and memory does not grow with the dataset.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Tuple, Union

import numpy as np

from elastic_ext.errors import PartitionError
from elastic_ext.data.permutation import EpochOrder, as_order

__all__ = ["POLICIES", "BLOCK_ELEMENTS", "Plan", "local_batch", "plan", "share", "steps_left"]

POLICIES = ("drop", "pad")

#: Steps computed together by :meth:`Plan.batches` once it is warm: the
#: numpy calls' fixed cost is shared by this many indices at most.
BLOCK_ELEMENTS = 1 << 16


def share(global_batch: int, world_size: int, rank: int) -> Tuple[int, int]:
    """(start, count) of rank ``rank``'s share of one global step.

    The first ``global_batch % world_size`` ranks take one sample more.

    Raises:
        PartitionError: the world size or rank is out of range, or the batch
            is smaller than the world (some rank would get nothing).
    """
    if world_size < 1:
        raise PartitionError(f"world_size ({world_size}) must be >= 1")
    if not 0 <= rank < world_size:
        raise PartitionError(f"rank ({rank}) must be in [0, world_size ({world_size}))")
    if global_batch < world_size:
        raise PartitionError(f"global batch ({global_batch}) must be >= world_size ({world_size}) "
                             "so that every rank gets at least one sample per step")
    base, extra = divmod(global_batch, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one rank processes from the cursor to the end of the epoch.

    A plan holds no indices, only where they are: step ``s`` takes positions
    ``cursor + s * global_batch + start + [0, count)`` of ``order``.
    ``full_steps`` steps are whole; with policy ``"pad"`` and ``rest``
    positions left after them, one more step takes those and is completed
    with positions past the end of the epoch, which wrap to the start of the
    order and are marked as padding. :meth:`batch` computes one step's
    indices (what a newcomer needs first), :meth:`rows` a range of steps in
    one vectorised call, :meth:`batches` iterates with growing blocks.
    """

    order: EpochOrder
    cursor: int
    global_batch: int
    start: int
    count: int
    full_steps: int
    rest: int

    @property
    def steps(self) -> int:
        return self.full_steps + (1 if self.rest else 0)

    def rows(self, first: int, stop: int) -> Tuple[np.ndarray, np.ndarray]:
        """(indices, pad mask) of steps ``[first, stop)``, one row per step.

        Raises:
            IndexError: the range is not within ``[0, steps]``.
        """
        if not 0 <= first <= stop <= self.steps:
            raise IndexError(f"steps [{first}, {stop}) out of range for a plan of {self.steps} steps")
        offsets = np.arange(first, stop, dtype=np.int64) * self.global_batch + (self.cursor + self.start)
        positions = offsets[:, None] + np.arange(self.count, dtype=np.int64)
        if stop <= self.full_steps:
            indices = self.order.take(positions)
            return indices, np.broadcast_to(False, indices.shape)
        pad = positions >= self.order.size
        return self.order.take(positions % self.order.size), pad

    def batch(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """(indices, pad mask) of step ``step``, computed now: time and memory ``O(count)``."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} out of range for a plan of {self.steps} steps")
        indices, pad = self.rows(step, step + 1)
        return indices[0], pad[0]

    def batches(self, block_elements: int = BLOCK_ELEMENTS) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """Yields ``(indices, pad mask)`` per step.

        The first step is computed alone, so it comes as fast as
        :meth:`batch`; then blocks of 2, 4, 8, ... steps up to
        ``block_elements`` indices are computed in one call each, which
        shares numpy's per-call cost between steps while keeping memory
        bounded.
        """
        step, rows = 0, 1
        most = max(1, block_elements // max(1, self.count))
        while step < self.steps:
            stop = min(self.steps, step + rows)
            indices, pad = self.rows(step, stop)
            for row in range(stop - step):
                yield indices[row], pad[row]
            step, rows = stop, min(most, rows * 2)

    @property
    def indices(self) -> np.ndarray:
        """All steps as one array: ``O(steps * count)``, for tests and small epochs."""
        return self.rows(0, self.steps)[0]

    @property
    def pad(self) -> np.ndarray:
        """All steps' padding masks (a writable copy)."""
        return np.array(self.rows(0, self.steps)[1])

    @property
    def advance(self) -> np.ndarray:
        """How far the cursor moves after each step (the same on every rank; the
        padded step moves it to the end of the epoch)."""
        advance = np.full(self.steps, self.global_batch, dtype=np.int64)
        if self.rest:
            advance[-1] = self.rest
        return advance


def steps_left(size: int, cursor: int, global_batch: int, policy: str) -> int:
    """How many global steps remain in the epoch (arithmetic, no plan)."""
    full, rest = divmod(size - cursor, global_batch)
    return full + (1 if policy == "pad" and rest else 0)


def plan(order: Union[EpochOrder, np.ndarray], cursor: int, global_batch: int, world_size: int, rank: int,
         policy: str = "drop") -> Plan:
    """Splits the positions ``[cursor, size)`` of ``order`` into global steps and returns this rank's part.

    ``order`` is an :class:`EpochOrder` (from :func:`epoch_order`) or an
    explicit 1-D array of indices. The plan is arithmetic: its time and
    memory do not depend on the epoch's size, and no index is computed until
    a step is asked for.

    Raises:
        PartitionError: a bad cursor, batch, world size, rank or policy; the
            message quotes the value.
    """
    order = as_order(order)
    size = order.size
    if policy not in POLICIES:
        raise PartitionError(f"policy ({policy!r}) must be one of {POLICIES}")
    if not 0 <= cursor <= size:
        raise PartitionError(f"cursor ({cursor}) must be in [0, {size}] for an epoch of {size} samples")
    start, count = share(global_batch, world_size, rank)
    full, rest = divmod(size - cursor, global_batch)
    if policy == "drop" or size == 0:
        rest = 0
    return Plan(order=order, cursor=int(cursor), global_batch=int(global_batch), start=start, count=count,
                full_steps=full, rest=rest)


def local_batch(global_batch: int, world_size: int, rank: int, micro_batch: Optional[int] = None) -> Tuple[int, int]:
    """(samples this rank takes per step, accumulation steps) for a constant global batch.

    With ``micro_batch`` the share is processed in ``ceil(share / micro_batch)``
    passes of gradient accumulation.

    Raises:
        PartitionError: ``micro_batch`` is not positive.
    """
    _, count = share(global_batch, world_size, rank)
    if micro_batch is None:
        return count, 1
    if micro_batch < 1:
        raise PartitionError(f"micro_batch ({micro_batch}) must be >= 1")
    return count, -(-count // micro_batch)
