"""Deterministic re-partitioning of an epoch's sample index space.

Pure functions, no communication: every rank computes the same answer from
the same inputs, so the data split needs no broadcast when the world size
changes. The vocabulary:

- *order*: the epoch's permutation of ``range(size)`` (seeded by
  ``(seed, epoch)``; identity without shuffling).
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
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np

from elastic_ext.errors import PartitionError

POLICIES = ("drop", "pad")


def index_dtype(size: int) -> np.dtype:
    """The narrowest signed integer type that holds ``size`` indices."""
    return np.dtype(np.int32) if size < 2 ** 31 else np.dtype(np.int64)


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's permutation of ``range(size)``, the same on every rank.

    Raises:
        PartitionError: ``size`` is negative, or ``seed``/``epoch`` negative.
    """
    if size < 0:
        raise PartitionError(f"size ({size}) must be >= 0")
    if seed < 0 or epoch < 0:
        raise PartitionError(f"seed ({seed}) and epoch ({epoch}) must be >= 0")
    order = np.arange(size, dtype=index_dtype(size))
    if shuffle:
        np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).shuffle(order)
    return order


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

    ``body`` is a strided view of the epoch order, one row per full global
    step; ``tail`` is the padded last step (policy ``"pad"`` only) with its
    ``tail_pad`` mask, or None. ``batch(s)`` returns step ``s``'s indices and
    padding mask without copying the body; ``advance[s]`` is how far the
    cursor moves after step ``s`` (the same on every rank; the padded step
    moves it to the end of the epoch).
    """

    body: np.ndarray
    tail: Optional[np.ndarray]
    tail_pad: Optional[np.ndarray]
    advance: np.ndarray

    @property
    def steps(self) -> int:
        return int(self.body.shape[0]) + (0 if self.tail is None else 1)

    def batch(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """(indices, pad mask) of step ``step``."""
        if step < self.body.shape[0]:
            row = self.body[step]
            return row, np.broadcast_to(False, row.shape)
        if self.tail is None or step != self.body.shape[0]:
            raise IndexError(f"step {step} out of range for a plan of {self.steps} steps")
        return self.tail, self.tail_pad

    @property
    def indices(self) -> np.ndarray:
        """All steps as one array (a copy when there is a padded step)."""
        if self.tail is None:
            return self.body
        return np.concatenate([self.body, self.tail[None, :]])

    @property
    def pad(self) -> np.ndarray:
        mask = np.zeros((self.steps, self.body.shape[1]), dtype=bool)
        if self.tail is not None:
            mask[-1] = self.tail_pad
        return mask


def steps_left(size: int, cursor: int, global_batch: int, policy: str) -> int:
    """How many global steps remain in the epoch (arithmetic, no plan)."""
    full, rest = divmod(size - cursor, global_batch)
    return full + (1 if policy == "pad" and rest else 0)


def plan(order: np.ndarray, cursor: int, global_batch: int, world_size: int, rank: int,
         policy: str = "drop") -> Plan:
    """Splits ``order[cursor:]`` into global steps and returns this rank's part.

    Time and memory do not grow with the epoch: the body is a strided view of
    the order; with padding, one last step of one global batch is built.

    Raises:
        PartitionError: a bad cursor, batch, world size, rank or policy; the
            message quotes the value.
    """
    size = int(order.shape[0])
    if policy not in POLICIES:
        raise PartitionError(f"policy ({policy!r}) must be one of {POLICIES}")
    if not 0 <= cursor <= size:
        raise PartitionError(f"cursor ({cursor}) must be in [0, {size}] for an epoch of {size} samples")
    start, count = share(global_batch, world_size, rank)
    remaining = order[cursor:]
    full = remaining.shape[0] // global_batch
    body = remaining[:full * global_batch].reshape(full, global_batch)[:, start:start + count]
    advance = np.full(full, global_batch, dtype=np.int64)
    rest = remaining.shape[0] - full * global_batch
    if policy == "drop" or rest == 0 or size == 0:
        return Plan(body=body, tail=None, tail_pad=None, advance=advance)
    # Pad the last step with the first positions of the order (repeated if
    # the epoch is smaller than one global batch).
    missing = global_batch - rest
    tail = np.concatenate([remaining[full * global_batch:], np.resize(order[:missing], missing)])
    tail_pad = np.arange(global_batch) >= rest
    return Plan(body=body, tail=tail[start:start + count], tail_pad=tail_pad[start:start + count],
                advance=np.append(advance, rest))


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
