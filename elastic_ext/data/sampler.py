"""The framework-neutral elastic sampler: epoch, cursor and batches from it.

:class:`ElasticPartitioner` holds the committed data position (epoch and
global cursor) and turns it into this rank's batches with
:func:`elastic_ext.data.partition.plan`. Put it in the :class:`~elastic_ext.State`
(its ``state_dict`` is plain values), call :meth:`record_step` after every
optimizer step, and it rolls back with the weights on failure and
re-partitions what is left on a resize. A numeric rollback (the guard,
``State(guard=...)``) adds the bad step's positions to a *skip list*,
committed with the cursor: a step that would start at a skipped range's
first position moves past the range first (:meth:`skip`).
``elastic_ext.torch.ElasticSampler``
and ``elastic_ext.tensorflow.index_dataset`` wrap it for each framework.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from elastic_ext.data import partition
from elastic_ext.data import permutation
from elastic_ext.errors import PartitionError, StateDivergenceError

logger = logging.getLogger(__name__)

World = Callable[[], Tuple[int, int]]  # returns (rank, size)


class ElasticPartitioner:
    """Exactly-once, resize-aware partition of ``size`` samples per epoch.

    Args:
        size: number of samples in the dataset.
        batch_size: samples per rank per step (the global batch then follows
            the world size), or
        global_batch_size: samples per step over all ranks, kept constant
            when the world size changes (each rank takes its share).
        micro_batch_size: with ``global_batch_size``, the most samples a rank
            processes at once; :attr:`accumulation_steps` says how many passes.
        seed: shuffling seed (the order depends only on seed and epoch).
        shuffle: shuffle each epoch (identity order otherwise).
        policy: ``"drop"`` or ``"pad"`` at the end of the epoch.
        world: returns ``(rank, size)``; Horovod's by default.

    Raises:
        PartitionError: bad sizes or policy (message quotes the value).
    """

    def __init__(self, size: int, *, batch_size: Optional[int] = None, global_batch_size: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, seed: int = 0, shuffle: bool = True,
                 policy: str = "drop", world: Optional[World] = None) -> None:
        if not isinstance(size, (int, np.integer)) or size < 0:
            raise PartitionError(f"size ({size!r}) must be an integer >= 0")
        if (batch_size is None) == (global_batch_size is None):
            raise PartitionError(f"give exactly one of batch_size ({batch_size!r}) and "
                                 f"global_batch_size ({global_batch_size!r})")
        for name, value in (("batch_size", batch_size), ("global_batch_size", global_batch_size),
                            ("micro_batch_size", micro_batch_size)):
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
                raise PartitionError(f"{name} ({value!r}) must be an integer >= 1")
        if micro_batch_size is not None and global_batch_size is None:
            raise PartitionError("micro_batch_size needs global_batch_size (constant global batch)")
        if policy not in partition.POLICIES:
            raise PartitionError(f"policy ({policy!r}) must be one of {partition.POLICIES}")
        if seed < 0:
            raise PartitionError(f"seed ({seed}) must be >= 0")
        self.size = int(size)
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.policy = policy
        self._world = world
        self.epoch = 0
        self.cursor = 0
        # Skipped position ranges [epoch, start, stop) of the order (committed; see skip()).
        self.skipped: List[List[int]] = []
        self._order: Optional[permutation.EpochOrder] = None
        self._order_key: Optional[tuple] = None
        # Called at every record_step(): a State tracking this sampler sets it to
        # its liveness' progress, so the stall check sees steps (None: no report).
        self.on_progress: Optional[Callable[[], None]] = None

    # ------------------------------------------------------------- position

    def world(self) -> Tuple[int, int]:
        if self._world is not None:
            return self._world()
        from elastic_ext.binding import get_binding, guess_framework
        binding = get_binding(guess_framework())
        self._world = lambda: (binding.rank(), binding.size())
        return self._world()

    @property
    def global_batch(self) -> int:
        """Samples consumed per global step at the current world size."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.batch_size * self.world()[1]

    @property
    def accumulation_steps(self) -> int:
        """Gradient-accumulation passes per step for this rank (1 without micro batches)."""
        rank, size = self.world()
        return partition.local_batch(self.global_batch, size, rank, self.micro_batch_size)[1]

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch`` with the cursor at 0; a no-op for the current epoch,
        so calling it again after a rollback keeps the committed position."""
        if epoch < 0:
            raise PartitionError(f"epoch ({epoch}) must be >= 0")
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.cursor = 0
            self.skipped = [r for r in self.skipped if r[0] >= self.epoch]  # past epochs' skips are spent

    # ------------------------------------------------------------ skip list

    def skip(self, epoch: int, start: int, stop: int) -> bool:
        """Never hands out positions ``[start, stop)`` of ``epoch``'s order (a bad step's samples).

        A step that would start at ``start`` moves the cursor to ``stop``
        first. The range is a whole step recorded at the cursor it started
        from, so it lines up with the steps replayed from the last commit as
        long as the global batch is the same (always with
        ``global_batch_size``). Adding a range twice is a no-op.
        Returns True if the range is new.

        Raises:
            PartitionError: the range is empty or outside ``[0, size]``.
        """
        epoch, start, stop = int(epoch), int(start), int(stop)
        if epoch < 0 or not 0 <= start < stop <= self.size:
            raise PartitionError(f"skipped range epoch {epoch} [{start}, {stop}) must be a non-empty range "
                                 f"within [0, {self.size}] of an epoch >= 0")
        if [epoch, start, stop] in self.skipped:
            return False
        self.skipped.append([epoch, start, stop])
        self.skipped.sort()
        return True

    def skip_ahead(self) -> None:
        """Moves the cursor past every skipped range that starts where it stands."""
        self.cursor = self._past_skips(self.cursor)

    def _past_skips(self, position: int) -> int:
        moved = True
        while moved:
            moved = False
            for epoch, start, stop in self.skipped:
                if epoch == self.epoch and start == position:
                    position, moved = stop, True
        return position

    def _next_skip(self, position: int) -> Optional[int]:
        """First position of the nearest skipped range after ``position`` in this epoch (None: none)."""
        return min((start for epoch, start, _ in self.skipped if epoch == self.epoch and start > position),
                   default=None)

    def _step_advance(self) -> int:
        left = self.size - self.cursor
        if left >= self.global_batch:
            return self.global_batch
        if self.policy == "pad" and left > 0:
            return left
        return 0

    @property
    def epoch_done(self) -> bool:
        """No step is left in this epoch at the current world size (skipped ranges left out)."""
        self.skip_ahead()
        return self._step_advance() == 0

    def step_range(self) -> Tuple[int, int, int]:
        """``(epoch, start, stop)``: the positions the step starting at the cursor consumes."""
        self.skip_ahead()
        return self.epoch, self.cursor, self.cursor + self._step_advance()

    def record_step(self) -> None:
        """Records that one global step was processed (call after each optimizer step).

        Raises:
            PartitionError: the epoch has no step left.
        """
        self.skip_ahead()
        advance = self._step_advance()
        if advance == 0:
            raise PartitionError(f"record_step() at cursor {self.cursor} of {self.size} with global batch "
                                 f"{self.global_batch} and policy {self.policy!r}: the epoch has no step left")
        self.cursor += advance
        self.skip_ahead()
        if self.on_progress is not None:
            self.on_progress()

    # ------------------------------------------------------------- batches

    def order(self) -> permutation.EpochOrder:
        """This epoch's order: a virtual permutation (entries computed when
        indexed, nothing of the dataset's size held above 4,096 samples), cached per epoch."""
        key = (self.size, self.seed, self.epoch, self.shuffle)
        if self._order_key != key:
            self._order = permutation.epoch_order(self.size, self.seed, self.epoch, self.shuffle)
            self._order_key = key
        return self._order

    def plan(self) -> partition.Plan:
        """This rank's steps from the cursor to the end of the epoch."""
        rank, size = self.world()
        return partition.plan(self.order(), self.cursor, self.global_batch, size, rank, self.policy)

    def batches(self) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """Yields ``(indices, pad_mask)`` per step from the cursor on (planned once per stretch
        between skipped ranges; indices computed step by step, the first one alone so it comes at once).

        Skipped ranges are left out; :meth:`record_step` moves the cursor
        past one when it reaches it.
        """
        self.skip_ahead()
        rank, size = self.world()
        position = self.cursor
        while True:
            position = self._past_skips(position)
            planned = partition.plan(self.order(), position, self.global_batch, size, rank, self.policy)
            limit = self._next_skip(position)
            for step, batch in enumerate(planned.batches()):
                if limit is not None and position + step * planned.global_batch >= limit:
                    break  # a skipped range starts here: plan again past it
                yield batch
            else:
                return
            position = limit

    def __len__(self) -> int:
        """Steps left in this epoch at the current world size (skipped steps left out)."""
        self.skip_ahead()
        ahead = sum(stop - start for epoch, start, stop in self.skipped if epoch == self.epoch and start > self.cursor)
        return partition.steps_left(self.size, self.cursor, self.global_batch, self.policy) - \
            -(-ahead // self.global_batch)

    def on_world_change(self) -> None:
        """Called by ``State.reset()`` after a resize. It only logs: nothing needs
        resetting, since every :meth:`plan` asks :meth:`world` for the rank and size."""
        logger.debug("world changed at epoch %d cursor %d", self.epoch, self.cursor)

    # ------------------------------------------------------- committed state

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "size": self.size, "seed": self.seed,
                "shuffle": self.shuffle, "policy": self.policy, "skipped": [list(r) for r in self.skipped]}

    def load_state_dict(self, state: dict) -> None:
        """Restores epoch and cursor.

        Raises:
            StateDivergenceError: the committed sampler was built for another
                dataset size, seed, shuffle or policy.
        """
        for key in ("size", "seed", "shuffle", "policy"):
            if state[key] != getattr(self, key):
                raise StateDivergenceError(f"committed sampler has {key}={state[key]!r} but this rank's "
                                           f"sampler has {key}={getattr(self, key)!r}")
        if not 0 <= state["cursor"] <= self.size:
            raise PartitionError(f"committed cursor ({state['cursor']}) must be in [0, {self.size}]")
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.skipped = [[int(v) for v in r] for r in state.get("skipped", [])]  # absent in older commits
