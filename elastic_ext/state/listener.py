"""The State's listener part: reset callbacks, Horovod's host-update notifications, the commit's decision.

:class:`HorovodListener` is a part of :class:`elastic_ext.state.state.CoreState`,
built with what it uses (its constructor's arguments) and nothing else of the
State. The State exposes its methods under Horovod's own names (``on_reset``,
``on_hosts_updated``, ``check_host_updates``, ``register_reset_callbacks``,
``reset``), so the State plugs into Horovod's notification manager as
Horovod's ``State`` does.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional

from elastic_ext.binding import Binding
from elastic_ext.events import PRESTART, EventLog
from elastic_ext.liveness import Liveness
from elastic_ext.state import decisions as _decisions
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.commit_slots import CommitSlots
from elastic_ext.state.host_updates import EarlyStart, HostUpdates
from elastic_ext.state.records import CommitRecord
from elastic_ext.state.tracked import Tracked


class HorovodListener:
    """Reset callbacks, host-update notifications and the commit's decision (see the module docstring).

    Args:
        hosts: the host updates and the commit's collective (:class:`~elastic_ext.state.host_updates.HostUpdates`).
        tracked: the tracked objects (told of a world change, captured again after the reset callbacks).
        buffers: the commit buffers (the reset callbacks' changes go into the commit held there).
        record: where this rank stands (its commit id, read when a method runs).
        slots: the policies' contributions to the commit's collective (filled once the State is assembled).
        binding: the collectives of the commit's decision, asked for when it runs (the State's, which a
            test may replace: a survivor moved to a new world).
        liveness: this process's liveness (a leave asked for, its grace), asked for when the commit decides
            (the State's: a test that runs ranks as threads gives each its own).
        events: this rank's event log.
        term_grace_s: how long a rank told to leave may still train (``ElasticConfig.term_grace_s``).
        settle_restore: waits for a background restore under way (the reset callbacks use the objects).
        reset_policies: what a reset does to the policies (the straggler watch measures afresh).
        checkpoints_failing: on rank 0, what failed once its checkpoint writes kept failing; else None.
    """

    def __init__(self, *, hosts: HostUpdates, tracked: Tracked, buffers: CommitBuffers, record: CommitRecord,
                 slots: CommitSlots, binding: Callable[[], Binding], liveness: Callable[[], Liveness],
                 events: EventLog, term_grace_s: float, settle_restore: Callable[[], Any],
                 reset_policies: Callable[[], None], checkpoints_failing: Callable[[], Optional[str]]) -> None:
        self._hosts, self._tracked, self._buffers, self._record = hosts, tracked, buffers, record
        self._slots, self._binding, self._liveness, self._events = slots, binding, liveness, events
        self._term_grace_s = term_grace_s
        self._settle_restore, self._reset_policies = settle_restore, reset_policies
        self._checkpoints_failing = checkpoints_failing
        self.reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after every reset (worker added or removed), e.g. to rescale the LR."""
        self.reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Horovod's reset: the world changed; runs the reset callbacks, in the order registered."""
        self._settle_restore()  # the callbacks may use the objects a rollback restores
        self._hosts.clear()
        self._reset_policies()
        self.reset()
        for callback in self.reset_callbacks:
            callback()
        if self.reset_callbacks and self._buffers.entries is not None and not self._buffers.torn:
            # What the callbacks changed (Horovod's documented ``lr * hvd.size()``) is what every
            # rank must hold next: under Horovod the sync after them broadcasts rank 0's live objects.
            # Here the sync ships the commit, so the commit takes their changes, under the same id;
            # the newcomers load them, and the survivors' agreement check covers them.
            self._buffers.copy(self._tracked.capture())

    def reset(self) -> None:
        """Tells objects that track the world size (samplers) that it changed."""
        for obj in self._tracked.objects.values():
            hook = getattr(obj, "on_world_change", None)
            if callable(hook):
                hook()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Called by Horovod's notification service (on the coordinator)."""
        self._hosts.put(timestamp, update_res)

    def host_update_pending(self) -> bool:
        """True if Horovod has announced a host change this rank has not acted on yet."""
        return self._hosts.pending()

    def set_early_start(self, factory: Optional[Callable[[], Optional[EarlyStart]]],
                        capacity_left_out: Optional[Callable[[], bool]] = None) -> None:
        """How this rank starts newcomers early at a host addition, and how it learns at a sync that the
        round left capacity out (``run`` sets both under the launcher)."""
        self._hosts.prestart_factory = factory
        self._hosts.capacity_left_out = capacity_left_out

    def start_early_at_sync(self) -> None:
        """Right after a sync: starts the newcomers early when the round left capacity out (a failed slot),
        rather than at the commit that would agree the driver's notification of it."""
        if self._hosts.start_for_capacity_left_out():
            self._events.emit(PRESTART, commit_id=self._record.commit_id, at_sync=True)

    def settle_commits(self) -> None:
        """Waits for this rank's overlapped commit collective, if one is in flight.

        Before a rank leaves the training function (or resets on its own
        account) every rank must have submitted it: a rank that shut Horovod
        down first would fail the others' submission ("Horovod has been shut
        down"), and they would roll back a finished job.
        """
        self._hosts.settle()

    def early_start_under_way(self) -> bool:
        """True while newcomers started early are on their way (the same on every rank: agreed at a commit)."""
        return self._hosts.prestart is not None

    def removed_at_resize(self) -> bool:
        """True when the early start that ends at this resize found this slot left out of the next world."""
        return _decisions.removed_at_resize(self._hosts)

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every rank together if hosts changed or a rank leaves
        (:func:`elastic_ext.state.decisions.decide_at_commit`).

        Raises:
            StateDivergenceError: ranks hold different commit ids.
            CheckpointError: rank 0's checkpoints keep failing (every rank stops together).
            StateDivergenceError: the replica check found ranks that differ with no strict majority.
        """
        _decisions.decide_at_commit(self._hosts, self._slots, self._binding(), self._tracked.objects.values(),
                                    self._record.commit_id, self._liveness(), self._term_grace_s, self._events,
                                    self._checkpoints_failing())
