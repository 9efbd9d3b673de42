"""A one-process binding: the exact semantics of every collective in a world of one rank.

Nothing here fakes Horovod's behaviour for more than one process (the
multi-process tests run the real ``horovodrun``); :class:`SoloBinding` lets
unit tests drive ``State.sync`` and ``commit`` without launching Horovod.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


class SoloBinding:
    """Collectives of a world with a single rank (all are identities)."""

    framework = "solo"

    def __init__(self) -> None:
        self.resets = 0

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        return np.array(array, copy=True)

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return np.array(array, copy=True)

    def allreduce_max(self, array: np.ndarray, name: str) -> np.ndarray:
        return np.array(array, copy=True)

    def reset(self) -> None:
        self.resets += 1

    def as_internal_error(self, exc: BaseException) -> Optional[BaseException]:
        return None


def state_on(binding: Any, **kwargs: Any) -> Any:
    """A :class:`~elastic_ext.State` (same keywords as its constructor) whose collectives, rank and
    size come from ``binding`` instead of Horovod: a :class:`SoloBinding`, or ranks simulated by threads."""
    from elastic_ext.runtime.assembly import State
    return State._on(binding, **kwargs)
