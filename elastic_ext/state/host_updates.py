"""A commit's one collective: host updates, leaves, the commit-id check, early newcomers.

Horovod notifies only the coordinator of a host change. At every commit
each rank contributes a small vector to one max-allreduce
(:func:`agreement_vector`), so every rank reads the same answer at the same
commit and acts on it together:

- the newest host-update timestamp and whether hosts were removed or added;
- whether some rank was told to leave (SIGTERM): everyone resizes there,
  right after a commit, so nothing is lost;
- whether the newcomers of an early start are all waiting
  (:mod:`elastic_ext.worker.prestart`);
- the commit id, as its maximum and the maximum of its negation, so ranks
  that disagree on it fail at the commit where it happens, not at the next
  sync;
- whether rank 0's checkpoint writer failed ``checkpoint_failure_limit``
  times in a row: every rank then stops together (:class:`~elastic_ext.errors.CheckpointError`);
- anything else that rides along (the straggler table).
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Callable, Optional, Protocol, Tuple

import numpy as np

from elastic_ext.binding import Binding, allreduce_max_start
from elastic_ext.errors import StateDivergenceError


class EarlyStart(Protocol):
    """One rank's part in starting newcomers while training goes on (:class:`elastic_ext.worker.prestart.Prestart`).

    A Protocol: the commit's collective only asks whether the newcomers are
    there; how they are started is the launcher's business.
    """

    why: str                       # why it ended: "all_there", "removed", "timeout", ...
    next_size: Optional[int]       # the next world's size, once the driver answered

    def start(self) -> "EarlyStart": ...
    def ready(self) -> bool: ...
    def cancel(self) -> None: ...
    def finish(self, why: str) -> None: ...
    def waited_s(self) -> float: ...

# Horovod's HostUpdateResult flags, repeated here so the core needs no Horovod import.
HOSTS_REMOVED = 1
HOSTS_ADDED = 2
FIELDS = 8  # the vector's fixed part; the extra follows
_now = time.monotonic  # the clock of commit intervals (tests replace it)


@dataclasses.dataclass
class Agreed:
    """What every rank read from one commit's allreduce."""

    newest: int                 # newest host-update timestamp any rank was told of
    leaving: bool               # some rank was told to leave
    removed: bool
    added: bool
    newcomers_ready: bool       # an early start's newcomers are all waiting (or it gave up)
    extra: Optional[np.ndarray]  # element-wise maximum of every rank's extra
    stop: bool = False          # some rank asks every rank to stop (its checkpoints keep failing)


def agreement_vector(commit_id: int, newest: int, flags: int, leaving: bool,
                     extra: Optional[np.ndarray] = None, newcomers_ready: bool = False,
                     stop: bool = False) -> np.ndarray:
    """What one rank contributes to a commit's allreduce (see the module docstring)."""
    vector = np.array([newest, flags & HOSTS_REMOVED, (flags & HOSTS_ADDED) >> 1, int(leaving),
                       int(newcomers_ready), commit_id, -commit_id, int(stop)], dtype=np.int64)
    if extra is not None:
        vector = np.concatenate([vector, np.asarray(extra, dtype=np.int64)])
    return vector


def read_agreement(reduced: np.ndarray, commit_id: int, has_extra: bool) -> Agreed:
    """Reads a reduced agreement vector of commit ``commit_id``.

    Raises:
        StateDivergenceError: ranks held different commit ids.
    """
    newest, removed, added, leaving, ready, highest, negated_lowest, stop = (int(x) for x in reduced[:FIELDS])
    lowest = -negated_lowest
    if highest != lowest:
        raise StateDivergenceError(
            f"ranks hold different commit ids at this commit: from {lowest} to {highest} (this rank: "
            f"{commit_id}); every rank must call commit() the same number of times between syncs "
            "(save() is local and does not count for the others)")
    return Agreed(newest, bool(leaving), bool(removed), bool(added), bool(ready),
                  reduced[FIELDS:] if has_extra else None, bool(stop))


class HostUpdates:
    """Horovod's host-update notifications this rank has not acted on, and the newest it acted on.

    Overlapped commits: where the binding can run the allreduce in Horovod's
    background thread (``overlap``: PyTorch), the allreduce of commit *k*
    runs while training goes on, and commit *k + 1* reads it: no commit
    waits for a collective, and what it agrees (a resize, a leave, an
    eviction, the commit-id check) acts one commit later. Every rank reads
    the same reduced vector at the same commit, so they still act together.
    A reset drops the one in flight (:meth:`clear`). Elsewhere the
    allreduce blocks and its commit acts on it.

    With ``prestart`` (a factory of :class:`EarlyStart`, which ``run`` sets
    under an elastic ``horovodrun``; its answer is None where it cannot
    start newcomers early) a pure host addition
    starts the newcomers while training goes on; the resize comes at the
    first commit that agrees they are all waiting. A removal or a leave
    meanwhile resizes at once, with the newcomers. While an early start is
    under way the commits' allreduces block even with ``overlap``: the
    newcomers' arrival acts at the commit that carries it, so the survivors
    do not train one more commit interval on the smaller world once the
    newcomers are there. That costs the allreduce's latency (milliseconds)
    at each of those few commits.
    """

    def __init__(self, overlap: bool = False,
                 prestart: Optional[Callable[[], Optional[EarlyStart]]] = None) -> None:
        self._messages: "queue.Queue[Tuple[int, int]]" = queue.Queue()
        self.last_timestamp = 0
        self.overlap = overlap
        self.prestart_factory = prestart
        # Under the launcher: whether the driver formed this round without capacity it has (a failed slot).
        self.capacity_left_out: Optional[Callable[[], bool]] = None
        self.prestart: Optional[EarlyStart] = None   # the early start under way
        self.joined: Optional[EarlyStart] = None     # the one that ended at the last resize
        self.stopped = False  # some rank asked every rank to stop (its checkpoints keep failing)
        # (wait for the result, the commit id it agrees, whether it carries extra)
        self._in_flight: Optional[Tuple[Callable[[], np.ndarray], int, bool]] = None
        self._settled: Optional[Tuple[np.ndarray, int, bool]] = None  # its result, once waited for
        self._agreed_at: Optional[float] = None  # time.monotonic() of this rank's last commit collective
        self.earlier_extra: Optional[np.ndarray] = None  # a blocking commit's: the previous commit's reduced extra
        self.current = False  # the last agree() returned its own commit's extra (not the previous one's)
        self.interval_s: Optional[float] = None   # the time between its last two

    def put(self, timestamp: int, update_res: int) -> None:
        self._messages.put((timestamp, int(update_res)))

    def pending(self) -> bool:
        return not self._messages.empty()

    def clear(self) -> None:
        self._messages = queue.Queue()
        self._in_flight = None  # a collective of the previous Horovod context: never waited for
        self._settled = None
        if self.prestart is not None:  # a reset: the driver counts the newcomers in already
            self.prestart.cancel()
            self.prestart = None

    def settle(self) -> None:
        """With ``overlap``: waits for the previous commit's allreduce, before this commit's snapshot.

        It completes once every rank has taken the previous snapshot, so no
        rank takes snapshot *k + 1* while another has not taken *k*: after a
        failure, survivors' commit ids still differ by one at most.
        """
        if self._in_flight is not None:
            wait, agreed_id, has_extra = self._in_flight
            self._in_flight = None
            self._settled = (wait(), agreed_id, has_extra)

    def _drain(self) -> Tuple[int, int]:
        newest, flags = self.last_timestamp, 0
        while not self._messages.empty():
            timestamp, update = self._messages.get()
            if timestamp > self.last_timestamp:
                newest = max(newest, timestamp)
                flags |= update
        return newest, flags

    def agree(self, binding: Binding, commit_id: int, leaving: bool,
              extra: Optional[np.ndarray] = None, stop: bool = False, blocking: bool = False,
              changes_world: Optional[Callable[[Optional[np.ndarray]], bool]] = None,
              ) -> Tuple[Optional[bool], Optional[np.ndarray]]:
        """Runs a commit's allreduce. Returns (None if nothing changed, else
        ``skip_sync`` for the ``HostsUpdatedInterrupt`` every rank then raises together;
        the reduced ``extra``). With ``overlap``, both are those of the previous
        commit's allreduce, (None, None) if there is none, unless ``blocking``
        (a commit whose extra must act at once: the replica check) or an
        early start is under way: then the previous one acts first (its
        extra in :attr:`earlier_extra`) and this one runs blocking. :attr:`current` says whether the extra returned is
        this commit's. ``stop``: this rank asks every rank to stop;
        :attr:`stopped` says whether some rank did. ``changes_world(extra)``
        (overlap only): the caller's decision on the previous commit's
        reduced extra (an eviction); when it changes the world, no allreduce
        is left in flight, as for a resize: a rank slower to start it would
        find the leaver gone and fail where the others resize.

        Raises:
            StateDivergenceError: ranks hold different commit ids.
        """
        newest, flags = self._drain()
        ready = self.prestart is not None and self.prestart.ready()
        vector = agreement_vector(commit_id, newest, flags, leaving, extra, ready, stop)
        now = _now()
        self.interval_s = None if self._agreed_at is None else now - self._agreed_at
        self._agreed_at = now
        self.earlier_extra, self.current = None, not self.overlap
        if not self.overlap:
            return self._act(read_agreement(binding.allreduce_max(vector, "elastic_ext.hosts"), commit_id,
                                            extra is not None))
        self.settle()
        previous, self._settled = self._settled, None
        result: Tuple[Optional[bool], Optional[np.ndarray]] = (None, None)
        if previous is not None:
            reduced, agreed_id, has_extra = previous
            result = self._act(read_agreement(reduced, agreed_id, has_extra))
            if result[0] is not None:
                return result  # every rank resizes now: nothing more runs on this Horovod context
        if not blocking and changes_world is not None and changes_world(result[1]):
            return result  # the same on every rank: they resize now
        # While an early start is under way (every rank started it at the same commit), the collective
        # blocks: the commit that carries "the newcomers are all there" resizes at once, not one later.
        if blocking or self.prestart is not None:
            self.earlier_extra, self.current = result[1], True
            return self._act(read_agreement(binding.allreduce_max(vector, "elastic_ext.hosts"), commit_id,
                                            extra is not None))
        self._in_flight = (allreduce_max_start(binding, vector, "elastic_ext.hosts"), commit_id, extra is not None)
        return result

    def _act(self, agreed: Agreed) -> Tuple[Optional[bool], Optional[np.ndarray]]:
        self.stopped = self.stopped or agreed.stop
        changed = agreed.newest > self.last_timestamp
        if changed:
            self.last_timestamp = agreed.newest
        if self.prestart is not None:
            if agreed.newcomers_ready or agreed.leaving or (changed and agreed.removed):
                self.joined, self.prestart = self.prestart, None
                self.joined.cancel()
                self.joined.finish("agreed" if agreed.newcomers_ready else "interrupted")  # others keep theirs
                return False, agreed.extra  # the newcomers are in the next world: they need the state
            return None, agreed.extra  # a further addition joins with these newcomers
        if not (changed or agreed.leaving):
            return None, agreed.extra
        if agreed.added and not (agreed.removed or agreed.leaving) and self._start_prestart():
            return None, agreed.extra
        # removals need no sync: every remaining rank holds this commit
        return (agreed.removed or agreed.leaving) and not agreed.added, agreed.extra

    def start_for_capacity_left_out(self) -> bool:
        """At a sync: starts the newcomers early when ``capacity_left_out()`` says the round left capacity out.

        Every rank of the round reads the same answer at its sync, before
        its first commit, so they all start it at the same point, as at a
        commit. Returns whether it started one.
        """
        if self.prestart is not None or self.capacity_left_out is None or not self.capacity_left_out():
            return False
        return self._start_prestart()

    def _start_prestart(self) -> bool:
        prestart = self.prestart_factory() if self.prestart_factory is not None else None
        if prestart is None:
            return False
        self.prestart, self.joined = prestart.start(), None
        return True

    def too_late_to_wait(self, time_left_s: Optional[float]) -> bool:
        """True when this commit's collective is in flight and the next commit, which would read it,
        is not expected within ``time_left_s`` (a leaver's grace): see :func:`decide_at_commit`."""
        return (self._in_flight is not None and time_left_s is not None and self.interval_s is not None
                and time_left_s < self.interval_s)
