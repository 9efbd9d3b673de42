"""Each rank's compute time per step, and the table of them that rides on the commit's collective.

- :class:`StepTimer` (per rank) measures compute time outside collectives,
  step by step, and reports a robust per-step figure (the median of the steps
  since its last report, so one slow step among many does not count).
- :func:`pack_slots` / :func:`unpack_slots` put that figure, and the rank's
  samples per step, in the rank's own slots of an int64 vector that rides
  on the commit's max-allreduce (every other rank writes 0 there): the table
  travels with a collective that runs anyway, ``2 x size`` more integers.

:mod:`elastic_ext.policies.straggler` decides from that table.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from elastic_ext.errors import ConfigError

_NS = 1e9


def pack_slots(rank: int, size: int, step_s: Optional[float], samples: int) -> np.ndarray:
    """This rank's ``2 x size`` int64 slots for the commit's max-allreduce.

    Slot ``rank`` holds the compute time per step in nanoseconds (at least 1
    when measured), slot ``size + rank`` the samples per step; all other
    slots are 0, so the element-wise maximum over ranks is every rank's pair.
    ``step_s`` None (nothing measured since the last report) leaves 0: unmeasured.

    Raises:
        ValueError: ``rank`` is outside ``[0, size)`` or ``samples`` is negative.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank ({rank}) must be in [0, size ({size}))")
    if samples < 0:
        raise ValueError(f"samples ({samples}) must be >= 0")
    slots = np.zeros(2 * size, dtype=np.int64)
    if step_s is not None and math.isfinite(step_s) and step_s >= 0:
        slots[rank] = max(1, int(round(step_s * _NS)))
        slots[size + rank] = int(samples)
    return slots


def unpack_slots(reduced: np.ndarray, size: int) -> Tuple[List[float], List[int]]:
    """``(compute_s, samples)`` per rank from the reduced slots (0 s where a rank measured nothing).

    Raises:
        ValueError: ``reduced`` does not hold ``2 x size`` values.
    """
    reduced = np.asarray(reduced)
    if reduced.shape != (2 * size,):
        raise ValueError(f"reduced slots shape {reduced.shape} must be ({2 * size},) for size {size}")
    return [int(x) / _NS for x in reduced[:size]], [int(x) for x in reduced[size:]]


class StepTimer:
    """Measures this rank's compute time per step, outside collectives.

    Wrap what the rank computes on its own (data loading, forward, backward)
    and not what waits for the others (``optimizer.step()`` of Horovod's
    ``DistributedOptimizer``, which waits for the gradient allreduce; commits)::

        timer = StepTimer()
        with timer:                       # one step
            loss = model(batch); loss.backward()
        optimizer.step()

    For gradient accumulation, time each pass with ``start()`` /
    ``stop(end_step=False)`` and close the step with :meth:`end_step`.
    A block left by an exception does not count (the step was abandoned).
    The cost is two ``perf_counter`` reads per section.

    Args:
        max_steps: most step times kept between reports (the newest win).
        clock: seconds as a float; ``time.perf_counter`` by default (tests
            inject their own).
    """

    def __init__(self, max_steps: int = 4096, clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ConfigError(f"max_steps ({max_steps!r}) must be an integer >= 1")
        self._clock = clock
        self._max_steps = max_steps
        self._started: Optional[float] = None
        self._current = 0.0
        self._open = False
        self._steps: List[float] = []

    @property
    def running(self) -> bool:
        return self._started is not None

    def start(self) -> None:
        """Starts a compute section.

        Raises:
            RuntimeError: a section is already running.
        """
        if self._started is not None:
            raise RuntimeError("StepTimer.start() while a section is running; call stop() first")
        self._started = self._clock()

    def stop(self, end_step: bool = True) -> float:
        """Ends the section, adds it to the current step (and closes the step); returns its seconds.

        Raises:
            RuntimeError: no section is running.
        """
        if self._started is None:
            raise RuntimeError("StepTimer.stop() without start()")
        elapsed = max(0.0, self._clock() - self._started)
        self._started = None
        self._current += elapsed
        self._open = True
        if end_step:
            self.end_step()
        return elapsed

    def end_step(self) -> None:
        """Closes the current step (a no-op if no section ran since the last one)."""
        if not self._open:
            return
        self._steps.append(self._current)
        if len(self._steps) > self._max_steps:
            del self._steps[0]
        self._current, self._open = 0.0, False

    def add(self, seconds: float) -> None:
        """Adds one step whose compute was timed elsewhere (``model.fit``: from the batch's start to
        the moment its gradients were ready, read from the training graph)."""
        if self._started is not None:
            raise RuntimeError("StepTimer.add() while a section is running")
        self._current, self._open = self._current + max(0.0, float(seconds)), True
        self.end_step()

    def discard(self) -> None:
        """Drops everything measured (after a rollback or reset: those steps are replayed)."""
        self._started, self._current, self._open = None, 0.0, False
        self._steps = []

    def report(self) -> Tuple[Optional[float], int]:
        """``(median seconds per step, steps)`` since the last report, then starts afresh.

        ``(None, 0)`` when no step closed since then.
        """
        steps, self._steps = self._steps, []
        if not steps:
            return None, 0
        return statistics.median(steps), len(steps)

    def __enter__(self) -> "StepTimer":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.stop(end_step=True)
        else:
            self._started, self._current, self._open = None, 0.0, False
