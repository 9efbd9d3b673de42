"""Replica check: which ranks committed a state the others did not (silent data corruption).

In data-parallel training every rank applies the same allreduced gradients
with the same deterministic update, so what must agree across ranks
(parameters, optimizer state, plain values, sampler positions) is bitwise
the same on every rank after each step. A rank whose copy differs was hit
by silent data corruption (a flipped bit in memory, a faulty core).

Every ``replica_check_every`` commits each rank puts a digest of what it
committed into its own slot of the commit's max-allreduce
(:func:`pack_digest`; every other slot holds -1, so the element-wise maximum
is every rank's digest). This module decides from that table, a pure
function of values every rank holds alike (:func:`judge`):

- every digest equal: nothing to do;
- a strict majority (more than half the ranks) holds one digest: those
  ranks are right, the others are wrong and take the majority's state;
- no strict majority (two ranks that differ, or a tie): nobody can tell the
  right copy; the job stops (see ``docs/state.md`` for why not a rollback).

:class:`RepeatOffenders` remembers which hosts were wrong when: a host wrong
twice within :data:`REPEAT_WINDOW_S` is asked to leave.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

#: What a rank writes into the slots of the others (digests are >= 0).
NOT_MINE = -1
#: A host wrong twice within this many seconds leaves the job (hardware that corrupts
#: data once tends to do it again; two hits in a day is more than chance).
REPEAT_WINDOW_S = 24 * 3600.0


def pack_digest(rank: int, size: int, digest: int) -> np.ndarray:
    """This rank's ``size`` int64 slots for the commit's max-allreduce: ``digest`` in slot ``rank``.

    Raises:
        ValueError: ``rank`` is outside ``[0, size)`` or ``digest`` is negative.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank ({rank}) must be in [0, size ({size}))")
    if digest < 0:
        raise ValueError(f"digest ({digest}) must be >= 0")
    slots = np.full(size, NOT_MINE, dtype=np.int64)
    slots[rank] = digest
    return slots


@dataclasses.dataclass(frozen=True)
class ReplicaVerdict:
    """What one check found; equal on every rank for the same table.

    ``majority`` are the ranks holding the digest that more than half hold
    (empty when none does); ``wrong`` the ranks that differ from it (with no
    majority: every rank that does not hold the most common digest, the
    lowest such digest on a tie).
    """

    digests: Tuple[int, ...]
    majority: Tuple[int, ...]
    wrong: Tuple[int, ...]

    @property
    def agreed(self) -> bool:
        return not self.wrong

    @property
    def healable(self) -> bool:
        """Some ranks differ and a strict majority can tell them the right state."""
        return bool(self.wrong) and bool(self.majority)


def judge(digests: Sequence[int]) -> ReplicaVerdict:
    """The verdict on one table of digests (one per rank, in rank order).

    Raises:
        ValueError: the table is empty or a rank's slot holds no digest (it did not take part).
    """
    table = tuple(int(d) for d in digests)
    if not table or min(table) < 0:
        raise ValueError(f"replica digest table {table} must hold one digest >= 0 per rank")
    counts = collections.Counter(table)
    best = min(counts, key=lambda digest: (-counts[digest], digest))
    holders = tuple(r for r, d in enumerate(table) if d == best)
    wrong = tuple(r for r, d in enumerate(table) if d != best)
    majority = holders if 2 * len(holders) > len(table) else ()
    return ReplicaVerdict(table, majority, wrong)


class RepeatOffenders:
    """Hosts found wrong, with when; :meth:`note` says whether a host was wrong before within the window.

    Kept by each process (not committed): the ranks that stay agree on it
    because every rank notes every verdict, and a host's own ranks, which
    act on it, were there the first time unless they restarted since.
    """

    def __init__(self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self._clock = clock
        self._seen: Dict[str, List[float]] = {}

    def note(self, hosts: Sequence[str]) -> List[str]:
        """Records that ``hosts`` were wrong now; returns those also wrong earlier within the window."""
        now = self._clock()
        repeat = []
        for host in dict.fromkeys(hosts):  # a host with two wrong ranks counts once per check
            times = [t for t in self._seen.get(host, []) if now - t <= self.window_s]
            if times:
                repeat.append(host)
            self._seen[host] = times + [now]
        return repeat

    def times(self, host: str) -> List[float]:
        return list(self._seen.get(host, []))


def describe(verdict: ReplicaVerdict, hosts: Optional[Sequence[str]] = None) -> str:
    """``rank 1 (host-a): 0x...`` for every rank, for error messages."""
    return ", ".join(f"rank {r}" + (f" ({hosts[r]})" if hosts else "") + f": {d:#018x}"
                     for r, d in enumerate(verdict.digests))


__all__ = ["NOT_MINE", "REPEAT_WINDOW_S", "ReplicaVerdict", "RepeatOffenders", "describe", "judge", "pack_digest"]
