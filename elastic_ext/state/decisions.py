"""What every rank decides together at a commit, from its one collective: resize, leave, stop, and the policies' say.

(One decision is a single rank's: a leaver whose grace runs out before an
overlapped commit's leave could act leaves at its commit, see
:func:`decide_at_commit`.)

:class:`~elastic_ext.state.host_updates.HostUpdates` runs the commit's
allreduce; :func:`decide_at_commit` gathers the policies' rows into it
(:mod:`elastic_ext.state.commit_slots`) and acts on what it agreed, the same
way on every rank: it stops the job when rank 0's checkpoints keep failing,
hands each policy its columns (the replica check may send every rank back to
replay, the straggler policy may evict a rank through the leave path),
reports an early start of newcomers beginning or ending, and raises
``HostsUpdatedInterrupt`` everywhere when the world changes.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

from elastic_ext.binding import Binding
from elastic_ext.errors import CheckpointError
from elastic_ext.events import NEWCOMERS_JOINED, PRESTART, EventLog
from elastic_ext.state.commit_slots import CommitPoint, CommitSlots, Layout, columns
from elastic_ext.state.host_updates import EarlyStart, HostUpdates
from elastic_ext.liveness import Liveness


def decide_at_commit(hosts: HostUpdates, slots: CommitSlots, binding: Binding, objects: Iterable[Any],
                     commit_id: int, liveness: Liveness, term_grace_s: float, events: EventLog,
                     checkpoints_failing: Optional[str] = None) -> None:
    """Runs the commit's collective and acts on it (see the module docstring).

    ``slots``: the policies that add columns to the collective, in column order.
    ``checkpoints_failing``: on the rank whose checkpoint writer failed
    ``checkpoint_failure_limit`` times in a row, what failed; every rank then stops.

    Raises:
        CheckpointError: on every rank together, when some rank's checkpoints keep failing.
        HostsUpdatedInterrupt: on every rank together, when hosts changed or a rank leaves.
        ReplicaMismatchError: on every rank together, when the replica check found committed
            states that differ (``run`` replays from the last agreed commit).
        StateDivergenceError: ranks hold different commit ids, or the replica check found a
            deterministic divergence.
    """
    at = CommitPoint(binding, binding.rank(), binding.size(), commit_id, objects, liveness, term_grace_s, events)
    extra, layout, blocking = slots.rows(at)
    earlier = slots.earlier
    before = hosts.prestart
    seen: Optional[np.ndarray] = None

    def observe(table: Optional[np.ndarray], laid_out: Layout) -> bool:
        # Each agreed table is observed once (a policy may count steps): agree() may have asked already.
        nonlocal seen
        changes = False
        if table is not None and table is not seen:
            seen = table
            for contribution in slots.contributions:
                changes = contribution.observe(columns(table, laid_out, contribution), at) or changes
        return changes

    # A blocking commit's collective blocks even where commits overlap: a replay must start before
    # any rank trains on from a commit that differs (its buffers are this commit's until the next snapshot).
    skip_sync, reduced = hosts.agree(binding, commit_id, liveness.leaving(), extra,
                                     stop=checkpoints_failing is not None, blocking=blocking,
                                     changes_world=lambda table: observe(table, earlier))
    if not blocking:
        slots.earlier = layout
    if hosts.stopped:
        raise CheckpointError(
            f"stopping at commit {commit_id}: durable checkpoints keep failing on rank 0 "
            f"({checkpoints_failing or 'see its checkpoint_failed events'}); the job would otherwise train on "
            "with no checkpoint to resume from. Fix the storage and start the job again: it resumes from the "
            "newest valid checkpoint")
    if hosts.current:  # else a resize agreed by the previous commit acts first
        for contribution, _ in layout:
            contribution.check(columns(reduced, layout, contribution), at)
    _report_prestart(hosts, before, commit_id, events)
    observe(hosts.earlier_extra, earlier)  # an overlapped commit's table, then this one's
    observe(reduced, layout if hosts.current else earlier)
    changes = False
    for contribution in slots.contributions:
        changes = contribution.enact(at) or changes
    if changes:
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
