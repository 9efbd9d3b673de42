"""The State as Horovod's host-update listener, and what resets and host changes do to it.

A mixin of :class:`elastic_ext.State`, which provides ``_hosts`` (its
:class:`~elastic_ext.state.host_updates.HostUpdates`), ``_straggler``,
``_tracked``, ``_binding``, ``_liveness``, ``_config``, ``_events``,
``_reset_callbacks``, ``_slots`` (the policies' part in the commit) and ``commit_id``. The names are Horovod's own
(``on_reset``, ``on_hosts_updated``, ``check_host_updates``,
``register_reset_callbacks``), so the State plugs into Horovod's
notification manager as Horovod's ``State`` does.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from elastic_ext.events import PRESTART
from elastic_ext.state import decisions as _decisions
from elastic_ext.state.host_updates import EarlyStart


class HorovodListener:
    """Reset callbacks, host-update notifications and the commit's decision (see the module docstring)."""

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callbacks run after every reset (worker added or removed), e.g. to rescale the LR."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.settle_restore()  # the callbacks may use the objects a rollback restores
        self._hosts.clear()
        self._straggler.reset()
        self.reset()
        for callback in self._reset_callbacks:
            callback()
        if self._reset_callbacks and self.committed and not self._buffers.torn:
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
            self._events.emit(PRESTART, commit_id=self.commit_id, at_sync=True)

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
        _decisions.decide_at_commit(self._hosts, self._slots, self._binding, self._tracked.objects.values(),
                         self.commit_id, self._liveness, self._config.term_grace_s, self._events,
                         self._checkpoints_failing())
