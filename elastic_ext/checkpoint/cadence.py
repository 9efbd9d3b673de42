"""``checkpoint_every="auto"``: the durable cadence from Young's rule, the write's cost and the failures seen.

A durable checkpoint costs training some time ``C`` (the background write
competes with it for CPU, memory bandwidth and I/O); a failure that ends the
job loses the training since the last durable checkpoint, half the interval
``tau`` on average. With failures every ``M`` seconds the time wasted per
second of training is ``C / tau + tau / (2 M)``, least at Young's interval
(J. W. Young, "A first order approximation to the optimum checkpoint
interval", CACM 17(9), 1974)::

    tau = sqrt(2 * C * M)

- ``C``, measured: how much longer the commit intervals are while a write
  runs than while none does, summed over the intervals one write spans
  (:meth:`Cadence.on_commit`, :meth:`Cadence.on_write_done`; exponential
  average, weight :data:`ALPHA`). Where the write takes nothing from
  training (idle cores, a GPU job) ``C`` is about 0 and checkpoints follow
  each other as fast as the bounds allow.
- ``M = T / F``: ``F`` failures (rollbacks and job restarts) in ``T``
  seconds of training; :data:`PRIOR_MTBF_S` (6 hours) before the first.
  ``F`` and ``T`` are kept in each checkpoint's manifest, so a restarted
  job goes on counting. The rate seen takes over at the first failure
  rather than being averaged with the prior: a job on machines that fail
  every few minutes must not wait hours of such failures to checkpoint
  accordingly, and one early failure that makes ``M`` too short costs
  little (writes are then as frequent as the lower bound allows, the
  waste grows as ``(sqrt(k) + 1/sqrt(k)) / 2`` for ``M`` ``k`` times too short).
- Bounds: ``tau`` at least one write's duration plus one commit interval
  and at most :data:`MAX_INTERVAL_S`; in commits, ``every = round(tau /
  interval)``, at least :data:`MIN_EVERY`. A checkpoint is never due while
  the previous write runs (no skipped checkpoint, no commit waits), nor
  before one commit interval without a write has passed since it (the
  baseline ``C`` is measured against).

Before ``C`` is known a checkpoint is due every :data:`MIN_EVERY` commits.
``every`` is recomputed after each write and each failure; a
``checkpoint_cadence`` event reports each change. Rank 0 alone decides (it
alone writes); a new rank 0 after a resize measures afresh.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Optional

PRIOR_MTBF_S = 6 * 3600.0   # one failure per 6 hours before the job has seen any
MAX_INTERVAL_S = 1800.0     # never more than 30 minutes of training at stake
MIN_EVERY = 2               # every write is followed by a commit without one (C's baseline)
ALPHA = 0.3                 # weight of the newest sample in the averages
OUTLIER = 5.0               # an interval this many times the usual one spans a reset or a pause: not a sample


def _average(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class Cadence:
    """Rank 0's cadence of durable checkpoints under ``checkpoint_every="auto"`` (see the module docstring).

    Args:
        clock: seconds, monotonic (a test seam).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self.past_training_s = 0.0       # training before this job (restarts), from the checkpoint resumed
        self.failures = 0
        self.every = MIN_EVERY
        self.interval_s: Optional[float] = None      # a commit interval without a write
        self.write_cost_s: Optional[float] = None    # C
        self.write_s: Optional[float] = None         # a write's duration
        self._last_commit: Optional[float] = None
        self._excess: Optional[float] = 0.0          # the running write's cost so far (None: not measurable)
        self._idle_since_write = 0                   # commit intervals without a write since the last one began

    @property
    def training_s(self) -> float:
        """Seconds of training the job has behind it, restarts included."""
        return self.past_training_s + self._clock() - self._started

    @property
    def mtbf_s(self) -> float:
        return PRIOR_MTBF_S if self.failures == 0 else self.training_s / self.failures

    def on_commit(self, writing: bool) -> None:
        """A commit: the interval since the previous one had a write running (``writing``) or not."""
        now = self._clock()
        last, self._last_commit = self._last_commit, now
        if last is None:
            return
        interval = now - last
        if not writing:
            self._idle_since_write += 1
        if self.interval_s is not None and interval > OUTLIER * self.interval_s:
            self._excess = None if writing else self._excess   # a reset or a pause in it: no cost sample
            return
        if not writing:
            self.interval_s = _average(self.interval_s, interval)
        elif self._excess is not None and self.interval_s is not None:
            self._excess += interval - self.interval_s
        else:
            self._excess = None   # no baseline yet

    def on_write_started(self) -> None:
        self._excess = 0.0
        self._idle_since_write = 0

    def on_write_done(self, duration_s: float) -> Optional[Dict[str, Any]]:
        """A write finished after ``duration_s``; the ``checkpoint_cadence`` event's fields if ``every`` changed."""
        self.write_s = _average(self.write_s, duration_s)
        if self._excess is not None:
            self.write_cost_s = _average(self.write_cost_s, max(0.0, self._excess))
        self._excess = None
        return self.update("write")

    def on_failure(self) -> Optional[Dict[str, Any]]:
        """A rollback (a worker failed); returns the event's fields if ``every`` changed."""
        self.failures += 1
        return self.update("failure")

    def interval_target_s(self) -> Optional[float]:
        """Young's interval within the bounds, or None before the write's cost is known."""
        if self.write_cost_s is None or self.interval_s is None:
            return None
        tau = math.sqrt(2.0 * self.write_cost_s * self.mtbf_s)
        return min(MAX_INTERVAL_S, max(tau, (self.write_s or 0.0) + self.interval_s))

    def update(self, reason: str) -> Optional[Dict[str, Any]]:
        """Recomputes ``every``; the event's fields when it changed, else None."""
        tau = self.interval_target_s()
        if tau is None:
            return None
        every = max(MIN_EVERY, int(round(tau / max(self.interval_s, 1e-6))))
        if every == self.every:
            return None
        self.every = every
        return {"every": every, "interval_s": tau, "reason": reason, "write_cost_s": self.write_cost_s,
                "write_s": self.write_s, "commit_interval_s": self.interval_s, "mtbf_s": self.mtbf_s,
                "failures": self.failures, "training_s": self.training_s}

    def due(self, commit_id: int, last_written: Optional[int]) -> bool:
        """``every`` commits since the last write, one interval of them without a write (C's baseline)."""
        return last_written is None or (commit_id - last_written >= self.every and self._idle_since_write >= 1)

    def to_manifest(self) -> Dict[str, float]:
        """What a checkpoint keeps of the tally (the ``cadence`` field of its manifest)."""
        return {"failures": self.failures, "training_s": round(self.training_s, 3)}

    def resumed(self, kept: Any) -> Optional[Dict[str, Any]]:
        """A job (re)started from a checkpoint whose manifest kept ``kept``: one more failure, the tally goes on.

        Every restart from a checkpoint counts as a failure, a planned one too: the count then errs
        towards more checkpoints.
        """
        if isinstance(kept, dict):
            failures, training = kept.get("failures"), kept.get("training_s")
            if isinstance(failures, int) and not isinstance(failures, bool) and failures >= 0:
                self.failures = failures
            if isinstance(training, (int, float)) and not isinstance(training, bool) and 0 <= training < math.inf:
                self.past_training_s = float(training)
        return self.on_failure()


__all__ = ["Cadence", "PRIOR_MTBF_S", "MAX_INTERVAL_S", "MIN_EVERY"]
