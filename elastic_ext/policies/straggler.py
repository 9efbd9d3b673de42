"""Straggler eviction: which rank, if any, keeps every synchronous step waiting.

In synchronous data parallelism the slowest rank sets the pace of all. This
module decides, from a table of per-rank compute times that every rank holds
identically, whether one rank has been much slower than the others for long
enough to be asked to leave (through the graceful-leave path: no rollback).
Off by default.

The pieces:

- :mod:`elastic_ext.policies.step_timer` measures each rank's compute time
  and carries the table on the commit's max-allreduce.
- :class:`StragglerPolicy` (the rules, validated) and
  :class:`StragglerTracker` (the runs of slow observations since the last
  reset) turn the table into an :class:`Eviction` or None. Pure arithmetic
  on agreed inputs, so every rank reaches the same decision.

The rules: compute time is divided by the rank's samples per step, so a rank
the partitioner gave a larger share on purpose is not slow for that. A rank's
*ratio* is its time per sample over the median of the other measured ranks'
(leaving itself out, so with two ranks the slow one is still seen). A rank
with ``ratio >= factor`` is slow in that observation; it is evicted once it
has been slow in every observation covering at least ``window_steps`` steps.
Observations whose steps began within ``warmup_steps`` of the last reset
(start, resize, rollback: compilation, cache warming, newcomers) are
ignored. At most one rank is evicted per decision: the one with the highest
ratio, the lowest rank on a tie.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from elastic_ext.data import partition
from elastic_ext.errors import ConfigError



#: Fewest measured ranks needed to judge at all: one rank has nobody to be slower than.
MIN_RANKS = 2


@dataclasses.dataclass(frozen=True)
class StragglerPolicy:
    """Rules of straggler eviction (validated at construction); ``State(straggler=StragglerPolicy())`` turns it on.

    Attributes:
        factor: a rank whose compute time per sample is at least this many
            times the median of the others is slow (> 1).
        window_steps: a rank must stay slow over this many consecutive
            steps before it is evicted.
        warmup_steps: steps after each reset whose times are ignored.
        min_size: never evict when the ranks left would be fewer than this.
            Horovod's driver takes the evicted rank's whole host out, so the
            check subtracts the most ranks any host holds. Set it to your
            ``--min-np``: below it the driver waits for new hosts instead.

    The evicted rank's host goes into ``ElasticConfig.exclude_file`` when one is set.

    Raises:
        ConfigError: a value is out of range; the message quotes it.
    """

    factor: float = 3.0
    window_steps: int = 50
    warmup_steps: int = 20
    min_size: int = 2

    def __post_init__(self) -> None:
        factor = self.factor
        if (not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor)
                or factor <= 1):
            raise ConfigError(f"factor ({factor!r}) must be a finite number > 1 (a ratio to the median)")
        for name, low in (("window_steps", 1), ("warmup_steps", 0), ("min_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{name} ({value!r}) must be an integer >= {low}")


@dataclasses.dataclass(frozen=True)
class Eviction:
    """The decision to ask ``rank`` to leave, with what it rests on.

    ``ratio`` is its time per sample over the median of the others in the
    deciding observation; it has been slow since ``slow_since`` (the step
    before its first slow one), and the decision came at ``step``.
    """

    rank: int
    step: int
    ratio: float
    slow_since: int
    ratios: Tuple[float, ...]

    def fields(self) -> dict:
        """JSON-compatible fields for the ``straggler`` event."""
        return {"evicted_rank": self.rank, "step": self.step, "ratio": self.ratio, "slow_since": self.slow_since,
                "slow_steps": self.step - self.slow_since, "ratios": list(self.ratios)}


def ratios(compute_s: Sequence[float], samples: Sequence[int]) -> List[Optional[float]]:
    """Each rank's time per sample over the median of the *other* measured ranks'.

    A rank is measured when its time is finite and > 0 and its samples > 0;
    unmeasured ranks, and every rank when fewer than two are measured, get None.

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(compute_s) != len(samples):
        raise ValueError(f"compute_s has {len(compute_s)} ranks but samples has {len(samples)}")
    per_sample: Dict[int, float] = {}
    for rank, (seconds, count) in enumerate(zip(compute_s, samples)):
        if seconds is not None and math.isfinite(seconds) and seconds > 0 and count > 0:
            per_sample[rank] = float(seconds) / float(count)
    result: List[Optional[float]] = [None] * len(compute_s)
    if len(per_sample) < 2:
        return result
    ordered = sorted(per_sample.values())
    for rank, value in per_sample.items():
        reference = _median_without(ordered, bisect.bisect_left(ordered, value))  # O(log n) per rank
        result[rank] = value / reference if reference > 0 else None
    return result


def _median_without(ordered: List[float], skip: int) -> float:
    """The median of ``ordered`` without the element at ``skip``, in O(1) (no copy)."""
    n = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k if k < skip else k + 1]

    middle = n // 2
    return at(middle) if n % 2 else (at(middle - 1) + at(middle)) / 2.0


class StragglerTracker:
    """Applies a :class:`StragglerPolicy` to successive observations; the same state on every rank.

    Not committed: it restarts at every reset (ranks are renumbered and
    newcomers warm up), which the integration signals with :meth:`reset`.
    """

    def __init__(self, policy: StragglerPolicy, step: int = 0) -> None:
        self.policy = policy
        self.reset(step)

    def reset(self, step: int) -> None:
        """Forgets every run of slow observations; steps up to ``step + warmup_steps`` are ignored."""
        self._warm_from = int(step) + self.policy.warmup_steps
        self._last_step = int(step)
        self._slow_since: Dict[int, int] = {}

    @property
    def slow_since(self) -> Dict[int, int]:
        """Rank -> the step before its current run of slow observations began."""
        return dict(self._slow_since)

    def observe(self, step: int, compute_s: Sequence[float], samples: Sequence[int]) -> Optional[Eviction]:
        """Takes the table agreed at global step ``step`` (covering the steps since the last call).

        ``compute_s[r]`` is rank r's representative compute seconds per step
        over those steps (:meth:`StepTimer.report`), ``samples[r]`` its samples
        per step. Returns the rank to evict, or None.

        Raises:
            ValueError: ``step`` went backwards, or the sequences differ in length.
        """
        step = int(step)
        if step < self._last_step:
            raise ValueError(f"step ({step}) must not go back before the last observation ({self._last_step}); "
                             "call reset() after a rollback")
        began = self._last_step
        self._last_step = step
        if step == began:
            return None
        if began < self._warm_from:
            return None
        table = ratios(compute_s, samples)
        measured = [r for r, ratio in enumerate(table) if ratio is not None]
        if len(measured) < MIN_RANKS:
            self._slow_since.clear()
            return None
        slow = {r for r in measured if table[r] >= self.policy.factor}
        self._slow_since = {r: self._slow_since.get(r, began) for r in slow}
        due = [r for r in slow if step - self._slow_since[r] >= self.policy.window_steps]
        if not due:
            return None
        rank = min(due, key=lambda r: (-table[r], r))
        since = self._slow_since.pop(rank)
        return Eviction(rank=rank, step=step, ratio=float(table[rank]), slow_since=since,
                        ratios=tuple(float("nan") if x is None else float(x) for x in table))


def shares(global_batch: int, world_size: int) -> List[int]:
    """Samples per step of every rank under the partitioner (:func:`elastic_ext.data.partition.share`).

    Raises:
        PartitionError: the batch is smaller than the world, or the world is empty.
    """
    return [partition.share(global_batch, world_size, rank)[1] for rank in range(world_size)]
