"""What every rank decides together at a commit, from its one collective: resize, leave, evict, stop, replay.

(One decision is a single rank's: a leaver whose grace runs out before an
overlapped commit's leave could act leaves at its commit, see
:func:`decide_at_commit`.)

:class:`~elastic_ext.state.host_updates.HostUpdates` runs the commit's
allreduce; :func:`decide_at_commit` acts on what it agreed, the same way on
every rank: it stops the job when rank 0's checkpoints keep failing, sends
every rank back to replay when the replica check finds committed states that differ, evicts
a straggler the table names (through the leave path), reports an early
start of newcomers beginning or ending, and raises ``HostsUpdatedInterrupt``
everywhere when the world changes.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

from elastic_ext.binding import Binding
from elastic_ext.errors import CheckpointError
from elastic_ext.events import NEWCOMERS_JOINED, PRESTART, STRAGGLER, EventLog
from elastic_ext.policies.eviction import StragglerWatch, host_name
from elastic_ext.state.host_updates import EarlyStart, HostUpdates
from elastic_ext.state.replica import ReplicaCheck
from elastic_ext.liveness import Liveness


def decide_at_commit(hosts: HostUpdates, straggler: StragglerWatch, binding: Binding, objects: Iterable[Any],
                     commit_id: int, liveness: Liveness, term_grace_s: float, events: EventLog,
                     checkpoints_failing: Optional[str] = None, replica: Optional[ReplicaCheck] = None) -> None:
    """Runs the commit's collective and acts on it (see the module docstring).

    ``checkpoints_failing``: on the rank whose checkpoint writer failed
    ``checkpoint_failure_limit`` times in a row, what failed; every rank then stops.
    ``replica``: at its checked commits, each rank's digest rides along; ranks whose
    committed states differ send every rank back to the last agreed commit to replay
    (:mod:`elastic_ext.state.replica`).

    Raises:
        CheckpointError: on every rank together, when some rank's checkpoints keep failing.
        HostsUpdatedInterrupt: on every rank together, when hosts changed or a rank leaves.
        ReplicaMismatchError: on every rank together, when the replica check found committed
            states that differ (``run`` replays from the last agreed commit).
        StateDivergenceError: ranks hold different commit ids, or the replica check found a
            deterministic divergence.
    """
    rank, size = binding.rank(), binding.size()
    local_size = getattr(binding, "local_size", None)
    slots = straggler.slots(rank, size, objects, local_size() if local_size is not None and straggler.enabled else 1)
    digest = replica.slots(rank, size, commit_id) if replica is not None else None
    extra = slots if digest is None else np.concatenate([digest] + ([] if slots is None else [slots]))
    before = hosts.prestart
    evicted = seen = None

    def evicts(table: Optional[np.ndarray]) -> bool:
        # Each agreed table is observed once (the policy counts steps): agree() may have asked already.
        nonlocal evicted, seen
        if table is not None and evicted is None and table is not seen:
            seen, evicted = table, straggler.decide(table, size)
        return evicted is not None

    # A checked commit's collective blocks even where commits overlap: a replay must start before
    # any rank trains on from a commit that differs (its buffers are this commit's until the next snapshot).
    skip_sync, reduced = hosts.agree(binding, commit_id, liveness.leaving(), extra,
                                     stop=checkpoints_failing is not None, blocking=digest is not None,
                                     changes_world=evicts)
    if hosts.stopped:
        raise CheckpointError(
            f"stopping at commit {commit_id}: durable checkpoints keep failing on rank 0 "
            f"({checkpoints_failing or 'see its checkpoint_failed events'}); the job would otherwise train on "
            "with no checkpoint to resume from. Fix the storage and start the job again: it resumes from the "
            "newest valid checkpoint")
    if digest is not None and hosts.current:  # else a resize agreed by the previous commit acts first
        replica.act(reduced[:size], binding, commit_id, liveness, term_grace_s)
        reduced = reduced[size:] if slots is not None else None
    _report_prestart(hosts, before, commit_id, events)
    for table in (hosts.earlier_extra, reduced):  # an overlapped commit's table, then this one's
        evicts(table)
    if evicted is not None:
        # Every rank decided alike: a removal at this commit, like a SIGTERM leave.
        fields = evicted.fields()
        if evicted.rank == rank:
            host = host_name()
            straggler.exclude(host)
            fields["host"] = host
            liveness.ask_to_leave(term_grace_s, cause="straggler")
        events.emit(STRAGGLER, commit_id=commit_id, **fields)
        skip_sync = True if skip_sync is None else skip_sync
    if skip_sync is None and liveness.leaving() and hosts.too_late_to_wait(liveness.leave_time_left()):
        # An overlapped commit's leave acts at the next commit, which would come after this rank's
        # grace. Leave now, once every rank has taken this commit's snapshot (its collective done):
        # the others' next step fails and they roll back to this commit, one step at most.
        hosts.settle()
        skip_sync = True
    if skip_sync is not None:
        from horovod.common.exceptions import HostsUpdatedInterrupt
        raise HostsUpdatedInterrupt(skip_sync)


def _report_prestart(hosts: HostUpdates, before: Optional[EarlyStart], commit_id: int, events: EventLog) -> None:
    if hosts.prestart is not None and hosts.prestart is not before:
        events.emit(PRESTART, commit_id=commit_id)
    if hosts.joined is not None and hosts.joined is before:
        joined = hosts.joined
        events.emit(NEWCOMERS_JOINED, commit_id=commit_id, why=joined.why,
                    next_size=joined.next_size, waited_s=joined.waited_s())


def removed_at_resize(hosts: HostUpdates) -> bool:
    """True when the early start that ends at this resize found this slot left out of the next world."""
    joined = hosts.joined
    return joined is not None and joined.why == "removed"
