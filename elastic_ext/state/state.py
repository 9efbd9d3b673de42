"""Committed state: tracked objects, commit, restore, reset callbacks, the host-update listener.

:class:`CoreState` is the State without its policies: the public :class:`elastic_ext.State`
(:mod:`elastic_ext.runtime.assembly`) adds the numeric guard, the straggler policy and the
replica check, which plug into the commit through :mod:`elastic_ext.state.commit_slots`;
nothing here imports a policy.

The State holds named objects (a model, an optimizer, a sampler, the
epoch counter...), each handled by the adapter for its type. ``commit()``
captures them (nothing is touched yet, so a bad object raises
``StateError`` and leaves the previous commit as it was), copies them into
host buffers (:mod:`elastic_ext.state.buffers`: reuse, torn flag, double buffer),
then runs the host-update allreduce, which also checks that every rank holds
the same commit id. No rank finishes commit N+1 before every rank has
captured N+1, so after a failure the survivors' ids differ by at most one
and the newest is a consistent state. ``restore()`` brings every object back
to the last commit bitwise; ``sync()`` makes every rank hold the same commit
and checks that survivors agree on it (:mod:`elastic_ext.state.sync`).
Parts, each built with what it uses, carry Horovod's listener, the hand-off
to the checkpoint writer and the way back to a commit (:mod:`elastic_ext.state.parts`).

What must agree across ranks: parameters, optimizer state, plain values,
sampler positions; not *buffers* (``buffer_keys``: BatchNorm statistics,
Keras non-trainable variables), which ``sync()`` takes from the root as
Horovod's broadcast does. Per-rank objects (RNG streams, ``State(per_rank=...)``)
are never compared nor broadcast.

Every ``replica_check_every``-th commit a minority whose digest of what must
agree differs takes the majority's commit (:mod:`elastic_ext.policies.replica_check`).
With ``config.checkpoint_dir``, rank 0 hands every agreed commit that is due
to the background writer (:mod:`elastic_ext.checkpoint`), and a sync with no
survivors (a fresh job) resumes from the newest valid checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ContextManager, Dict, FrozenSet, Iterable, Optional, Tuple

from elastic_ext.state import sync as _sync
from elastic_ext.state.adapters import Adapter
from elastic_ext.binding import Binding, get_binding, guess_framework, rank_or_unknown
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.commit_slots import CommitSlots
from elastic_ext.state.digests import Digests
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import StateError
from elastic_ext.events import EventLog
from elastic_ext.state.durable import DurableCommits
from elastic_ext.state.host_updates import HostUpdates
from elastic_ext.state.listener import HorovodListener
from elastic_ext.state.parts import Delegated
from elastic_ext.state.records import CommitRecord, RollbackRecord
from elastic_ext.state.restoring import Restorer
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.state.tracked import Tracked, reserved_names
from elastic_ext.liveness import LIVENESS

logger = logging.getLogger(__name__)


class CoreState:
    """The committed state without its policies; :class:`elastic_ext.State` assembles it with them.

    The public class (:mod:`elastic_ext.runtime.assembly`) documents the arguments, and sets through
    the ``_plug_*`` methods its policies: ``_guard``, ``_straggler`` (a ``timer``, ``reset()``),
    ``_guarded`` (``settle()``, ``drop()``), ``_replica`` (``before_commit()``, ``synced()``,
    ``agreed``) and the contributions of ``_slots`` (those of the commit's collective). :meth:`_construct`
    builds the parts (:mod:`elastic_ext.state.parts`); they reach a policy only through a callable.
    """

    #: The constructor's own keywords besides the tracked objects, then those of the assembled State's policies.
    _KEYWORDS: Tuple[str, ...] = ("framework", "adapters", "config", "per_rank")
    _POLICY_KEYWORDS: Tuple[str, ...] = ()
    #: Names no tracked object may take besides the public members (:func:`.tracked.reserved_names`).
    _RESERVED_EXTRA: FrozenSet[str] = frozenset({"framework", "binding", "adapters", "config", "per_rank"})

    @classmethod
    def _on(cls, binding: Binding, **kwargs: Any) -> "CoreState":
        """A State whose collectives go through ``binding`` (the test seam :func:`elastic_ext.testing.state_on`)."""
        state = cls.__new__(cls)
        options = {k: kwargs.pop(k) for k in cls._KEYWORDS + cls._POLICY_KEYWORDS if k in kwargs}
        state._construct(binding, options.get("framework"), options.get("adapters", ()), options.get("config"),
                         options.get("per_rank", ()), kwargs, {k: options.get(k) for k in cls._POLICY_KEYWORDS})
        return state

    def _construct(self, binding: Optional[Binding], framework: Optional[str], adapters: Iterable[Adapter],
                   config: Optional[ElasticConfig], per_rank: Iterable[str], objects: Dict[str, Any],
                   policies: Dict[str, Any]) -> None:
        s = object.__setattr__
        s(self, "_liveness", LIVENESS)
        s(self, "_config", config or ElasticConfig.from_env())
        s(self, "_tracked", Tracked(objects, adapters, per_rank, reserved_names(type(self))))
        for name, obj in objects.items():
            self._track(name, obj)
        self._plug_objects(policies)
        frameworks = self._tracked.frameworks()  # also finds every adapter: StateError if one is missing
        self._tracked.prepare()  # e.g. Keras optimizers build their slots here, before any sync
        if binding is None:
            if len(frameworks) > 1 and framework is None:
                raise StateError(f"objects from several frameworks {frameworks} in one State; "
                                 "pass framework= to choose the one whose Horovod runs the collectives")
            binding = get_binding(framework or (frameworks[0] if frameworks else guess_framework()))
        s(self, "_binding", binding)
        self._plug_binding([*frameworks, binding.framework])
        s(self, "_buffers", CommitBuffers(self._config.commit_buffers))
        s(self, "_record", CommitRecord())
        s(self, "_hosts", HostUpdates(overlap=getattr(binding, "allreduce_max_start", None) is not None))
        s(self, "_rollbacks", RollbackRecord())
        s(self, "_events", EventLog(self._config.events_path, binding.rank, binding.size))
        s(self, "_digests", Digests())
        s(self, "_checkpointer", None)
        if self._config.checkpoint_dir is not None:
            from elastic_ext.checkpoint import Checkpointer
            s(self, "_checkpointer", Checkpointer(self._config, self._events, self._buffers))
        s(self, "_slots", CommitSlots())
        tracked, buffers, record = self._tracked, self._buffers, self._record
        s(self, "_restorer", Restorer(tracked=tracked, buffers=buffers, digests=self._digests, record=record,
                                      rewind_policies=self._rewind_policies, agreed=lambda: self._replica.agreed))
        s(self, "_durable", DurableCommits(writer=self._checkpointer, buffers=buffers, tracked=tracked,
                                           record=record, binding=lambda: self._binding))
        s(self, "_listener", HorovodListener(
            hosts=self._hosts, tracked=tracked, buffers=buffers, record=record, slots=self._slots,
            binding=lambda: self._binding, liveness=lambda: self._liveness, events=self._events,
            term_grace_s=self._config.term_grace_s, settle_restore=self._restorer.settle_restore,
            reset_policies=lambda: self._straggler.reset(), checkpoints_failing=self._durable.checkpoints_failing))
        self._plug_commit()

    # The assembled State's policies plug in when what they need is there (a policy may track its own objects).
    def _plug_objects(self, policies: Dict[str, Any]) -> None:
        """After the objects are tracked, before their adapters are found."""

    def _plug_binding(self, frameworks: Iterable[str]) -> None:
        """Once the binding is chosen (``frameworks``: the objects', then the binding's)."""

    def _plug_commit(self) -> None:
        """Once the buffers, the event log, the checkpoint writer and the parts are built: ``_slots`` is empty."""

    def _rewind_policies(self) -> None:
        """The objects went back to a commit (a restore, a replay): what the policies forget."""
        self._guarded.drop()  # the step in flight is undone
        self._straggler.reset()  # replayed steps are not measured against the others

    # ------ what the parts implement. Horovod's listener (state/listener.py): Horovod calls these on the State.
    register_reset_callbacks = Delegated("_listener", HorovodListener.register_reset_callbacks)
    on_reset = Delegated("_listener", HorovodListener.on_reset)
    reset = Delegated("_listener", HorovodListener.reset)
    on_hosts_updated = Delegated("_listener", HorovodListener.on_hosts_updated)
    check_host_updates = Delegated("_listener", HorovodListener.check_host_updates)
    host_update_pending = Delegated("_listener", HorovodListener.host_update_pending)
    set_early_start = Delegated("_listener", HorovodListener.set_early_start)
    start_early_at_sync = Delegated("_listener", HorovodListener.start_early_at_sync)
    settle_commits = Delegated("_listener", HorovodListener.settle_commits)
    early_start_under_way = Delegated("_listener", HorovodListener.early_start_under_way)
    removed_at_resize = Delegated("_listener", HorovodListener.removed_at_resize)
    # The hand-off to the checkpoint writer (state/durable.py).
    wait_for_checkpoint = Delegated("_durable", DurableCommits.wait_for_checkpoint)
    checkpoint_now = Delegated("_durable", DurableCommits.checkpoint_now)
    note_failure = Delegated("_durable", DurableCommits.note_failure)
    # The way back to a commit (state/restoring.py).
    restore = Delegated("_restorer", Restorer.restore)
    settle_restore = Delegated("_restorer", Restorer.settle_restore)
    replay_from_agreed = Delegated("_restorer", Restorer.replay_from_agreed)

    # ------------------------------------------------------------ attributes

    def __getattr__(self, name: str) -> Any:
        tracked = self.__dict__.get("_tracked")
        if tracked is not None and name in tracked.objects:
            return tracked.objects[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._tracked.objects:
            self._track(name, value)
        else:
            object.__setattr__(self, name, value)

    def _track(self, name: str, obj: Any) -> None:
        if isinstance(obj, ElasticPartitioner) and obj.on_progress is None:
            obj.on_progress = self._liveness.progress  # its steps count as progress for the stall check
        self._tracked.objects[name] = obj

    @property
    def commit_id(self) -> int:
        """Id of the last commit: 0 before the first, then +1 per commit."""
        return self._record.commit_id

    @property
    def committed(self) -> bool:
        """True once this process holds a commit (its own, or one a sync brought)."""
        return self._buffers.entries is not None

    @property
    def generation(self) -> int:
        """How many times the job (re)started its training function: 1 after the
        first sync, +1 after every reset. The same on every rank."""
        return self._record.generation

    @property
    def objects(self) -> Dict[str, Any]:
        """The tracked objects by name (a copy of the mapping)."""
        return dict(self._tracked.objects)

    config = property(lambda self: self._config, doc="The :class:`ElasticConfig` in force.")
    binding = property(lambda self: self._binding, doc="The Horovod operations in use.")
    events = property(lambda self: self._events, doc="This rank's :class:`EventLog`.")
    rollbacks = property(lambda self: self._rollbacks, doc="Rollbacks in a row without a new commit (``run``).")
    # What tests inspect: the last commit's entries, and the adapter found per name.
    _entries = property(lambda self: self._buffers.entries)
    _adapter_of = property(lambda self: self._tracked._adapter_of)

    @property
    def seconds_since_commit(self) -> Optional[float]:
        """Seconds since the last commit (None before the first): the work a rollback loses."""
        commit_time = self._record.commit_time
        return None if commit_time is None else time.time() - commit_time

    def _add_object(self, name: str, obj: Any, per_rank: bool = False) -> None:
        """Tracks one more object from now on, for an integration (``ElasticCallback``'s own entries);
        every rank adds it alike, before the commits that must hold it; ``per_rank`` as ``State(per_rank=)``."""
        self._tracked.add(name, obj, per_rank)

    def register_adapter(self, adapter: Adapter) -> None:
        """Adds ``adapter`` in front of this instance's lookup table."""
        self._tracked.register(adapter)

    def phase(self, name: str) -> ContextManager[None]:
        """``with state.phase("eval"):`` a long phase the stall check does not count (see :func:`elastic_ext.phase`)."""
        return self._liveness.phase(name)

    # ------------------------------------------------- commit, restore, sync

    def commit(self) -> None:
        """Snapshots every object to host memory, then checks for host updates.

        Raises:
            StateError: an object cannot be snapshotted; the previous commit
                is left intact.
            NumericFaultError: the guard judged the step in flight bad (PyTorch); nothing was committed.
            HostsUpdatedInterrupt: hosts were added or removed (after the
                commit has been made).
            CheckpointError: rank 0's checkpoint writes failed
                ``checkpoint_failure_limit`` times in a row; raised on every
                rank together (after the commit has been made).
        """
        self._liveness.progress()
        self._hosts.settle()  # an overlapped commit's collective, before this snapshot
        self._guarded.settle(self._tracked.objects)  # a bad step in flight must not be committed
        self.save()
        try:
            self._listener.check_host_updates()
        except Exception as exc:
            if type(exc).__name__ == "HostsUpdatedInterrupt":  # the commit is agreed all the same
                self._durable.checkpoint_commit()
            raise
        self._durable.checkpoint_commit()

    def save(self) -> None:
        """The local half of :meth:`commit`: snapshot without any collective."""
        self._restorer.settle_restore()
        captures = self._tracked.capture()
        self._replica.before_commit(self.commit_id)  # a synced commit the replica check keeps, before it goes
        try:
            self._buffers.copy(captures)
        except BaseException:
            if self._buffers.torn:
                logger.error("[rank %s] commit %d interrupted while copying; the previous commit is torn "
                             "and will not be restored from", rank_or_unknown(self._binding), self.commit_id + 1)
            raise
        self._record.commit_id += 1
        self._record.commit_time = time.time()

    def sync(self) -> None:
        """Makes every rank hold the same commit and the same live synced objects.

        The newest commit among survivors is broadcast from the lowest rank
        holding it to every rank not holding exactly those bytes (only one
        allgather runs when all do); a fresh job's root first resumes from
        the newest checkpoint. The steps are in :mod:`elastic_ext.state.sync`.

        Raises:
            StateDivergenceError: survivors' commit ids differ by more than
                one, or survivors at the same id differ in what must agree
                (the message names the first differing entry).
            CheckpointError: a fresh job cannot resume from its checkpoints.
        """
        self._restorer.settle_restore()
        if self._buffers.entries is None or self._buffers.torn:
            # A newcomer (or a torn survivor) snapshots what it has, so that
            # a fresh job starts from rank 0's initial objects.
            self._buffers.torn = False
            self.save()
            self._record.commit_id = 0
            self._record.participated = False
        party = _sync.Party(self._binding, self._tracked, self._buffers, self._record, self._hosts,
                            self._rollbacks, self._events, self._checkpointer, self._digests)
        _sync.sync(party)
        self._replica.synced(self.commit_id)
