"""Several ranks in one process: :class:`ThreadWorld`, N ranks as N threads over an in-memory binding.

Each rank's binding (:meth:`ThreadWorld.binding`) has the exact semantics
of the three collectives, and checks that every rank entered the same
collective with the same name: Horovod would answer a mismatch with a hang,
this world with :class:`CollectiveMismatch`. With
:func:`~elastic_ext.testing.state_on` it lets a unit test drive ``sync``,
``commit`` and ``restore`` of several ranks' States without launching
Horovod; the multi-process tests run the same paths under ``horovodrun``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional

import numpy as np


class CollectiveMismatch(AssertionError):
    """Ranks entered different collectives: Horovod would wait forever."""


class ThreadWorld:
    """N ranks as N threads; each collective meets at a barrier and checks its name and shape.

    Args:
        size: the number of ranks.
        barrier_timeout_s: how long a rank waits for the others at a collective
            before failing (a rank left waiting fails instead of hanging).
    """

    def __init__(self, size: int, barrier_timeout_s: float = 20.0) -> None:
        if size < 1:
            raise ValueError(f"size ({size!r}) must be >= 1")
        self.size = size
        self.barrier = threading.Barrier(size, timeout=barrier_timeout_s)
        self.slots: List[Any] = [None] * size

    def binding(self, rank: int) -> "ThreadBinding":
        """The binding of ``rank`` (0 <= rank < size)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank ({rank!r}) must be in [0, {self.size})")
        return ThreadBinding(self, rank)

    def run(self, fn: Callable[[int], Any], timeout_s: float = 60.0) -> List[Any]:
        """Runs fn(rank) on every rank; returns results or exceptions by rank."""
        results: List[Any] = [None] * self.size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - returned to the caller, by rank
                results[rank] = exc  # a rank left waiting fails on the barrier's timeout

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
        return results


class ThreadBinding:
    """One rank's collectives in a :class:`ThreadWorld`."""

    framework = "threads"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self._rank = world, rank
        self.resets = 0

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size

    def _meet(self, kind: str, name: str, array: np.ndarray) -> List[np.ndarray]:
        world = self.world
        world.slots[self._rank] = (kind, name, np.array(array, copy=True))
        world.barrier.wait()
        calls = list(world.slots)
        world.barrier.wait()
        kinds = {(k, n) for k, n, _ in calls}
        if len(kinds) != 1:
            raise CollectiveMismatch(f"ranks called different collectives: {sorted(kinds)}")
        return [a for _, _, a in calls]

    def broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        return self._meet("broadcast", name, array)[root_rank].copy()

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        arrays = self._meet("allgather", name, array)
        if len({a.shape[1:] for a in arrays}) != 1:
            raise CollectiveMismatch(f"allgather {name}: shapes {[a.shape for a in arrays]}")
        return np.concatenate(arrays)

    def allreduce_max(self, array: np.ndarray, name: str) -> np.ndarray:
        return np.maximum.reduce(self._meet("allreduce", name, array))

    def reset(self) -> None:
        self.resets += 1

    def as_internal_error(self, exc: BaseException) -> Optional[BaseException]:
        return None
