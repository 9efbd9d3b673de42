"""The public :class:`State`: the committed state (:mod:`elastic_ext.state.state`) assembled with its policies.

The core imports no policy; the policies plug into it here, above both:
the numeric guard (its checked steps, :mod:`elastic_ext.policies.numeric_rollback`),
the straggler policy (its timer and its table on the commit's collective,
:mod:`elastic_ext.policies.eviction`) and the replica check
(:mod:`elastic_ext.policies.replica_check`). What a policy adds to the
commit goes through :class:`~elastic_ext.state.commit_slots.CommitContribution`,
in the order :meth:`State._plug_commit` lists them: that order is the
order of the columns in the commit's collective.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterable, Optional

from elastic_ext.binding import Binding
from elastic_ext.config import ElasticConfig
from elastic_ext.policies import numeric_rollback as _numeric
from elastic_ext.policies.eviction import StragglerAtCommit, StragglerWatch
from elastic_ext.policies.guard import NumericGuard
from elastic_ext.policies.replica_check import ReplicaCheck
from elastic_ext.policies.soft_failures import SoftFailures
from elastic_ext.policies.straggler import StragglerPolicy
from elastic_ext.state import state as _core
from elastic_ext.state.adapters import Adapter
from elastic_ext.state.parts import Delegated
from elastic_ext.state.tracked import reserved_names as _reserved_names


class State(_core.CoreState):
    """Committed state of a training job, for PyTorch or TensorFlow.

    Every keyword argument becomes an attribute (``state.model``,
    ``state.epoch``) whose object is committed, restored and synced by the
    adapter that handles its type. Assigning a new value to such an attribute
    (``state.epoch += 1``) replaces the tracked object.

    Args:
        framework: "torch" or "tensorflow"; guessed from the objects, or from
            which Horovod module is imported, when left out.
        adapters: extra adapters tried before the built-in ones, for this
            instance only.
        config: an :class:`ElasticConfig`; read from the environment if None.
        per_rank: names of objects that each rank keeps for itself (a
            per-rank metric, a rank's own data-loader state): committed and
            restored locally, never compared nor broadcast, not in durable
            checkpoints, like RNG streams.
        guard: an :class:`elastic_ext.NumericGuard` (opt-in): enables
            :meth:`guard_step`; its loss window is committed as
            ``numeric_guard_window`` (see :mod:`elastic_ext.policies.numeric_rollback`).
        straggler: an :class:`elastic_ext.StragglerPolicy` (opt-in): a rank much slower than the others,
            per ``state.step_timer``, is asked to leave at a commit (see
            :mod:`elastic_ext.policies.eviction`). Every rank must pass the same policy.
        **objects: the objects to track, by name.

    Raises:
        StateError: an object has no adapter, a name is reserved (a public
            member of State, or starts with ``_``) or not an identifier, or
            ``per_rank`` names an object that is not tracked.
        ConfigError: the framework cannot be determined.

    The run loop's contract (what :func:`elastic_ext.run` and
    :mod:`elastic_ext.runtime.recovery` call, besides ``commit``, ``sync``
    and Horovod's listener methods; a loop of one's own may call them too):

    - :meth:`restore` ``(background=True)``: after a failed collective, the
      large entries restored on a thread beside Horovod's re-forming;
      :meth:`settle_restore` waits for it (and says how long it ran).
    - :meth:`replay_from_agreed`: after a replica mismatch, every rank back
      to the last commit on which all agreed.
    - :meth:`note_failure`: a rollback, for ``checkpoint_every="auto"``.
    - :meth:`set_early_start`, :meth:`start_early_at_sync`,
      :meth:`early_start_under_way`, :meth:`removed_at_resize`: the early
      start of newcomers under the launcher.
    - :meth:`settle_commits`: waits for an overlapped commit's collective
      before this rank leaves the training function.
    """

    _POLICY_KEYWORDS = ("guard", "straggler")
    _RESERVED_EXTRA = _core.CoreState._RESERVED_EXTRA | {"guard", "straggler", _numeric.WINDOW_NAME}

    def __init__(self, *, framework: Optional[str] = None, adapters: Iterable[Adapter] = (),
                 config: Optional[ElasticConfig] = None, per_rank: Iterable[str] = (),
                 guard: Optional[NumericGuard] = None, straggler: Optional[StragglerPolicy] = None,
                 **objects: Any) -> None:
        self._construct(None, framework, adapters, config, per_rank, objects, {"guard": guard, "straggler": straggler})

    @classmethod
    def _on(cls, binding: Binding, **kwargs: Any) -> "State":
        """A State whose collectives go through ``binding`` instead of Horovod (the test seam
        :func:`elastic_ext.testing.state_on`)."""
        return super()._on(binding, **kwargs)

    def _plug_objects(self, policies: Dict[str, Any]) -> None:
        guard = policies.get("guard")
        _numeric.attach(self._tracked, guard)  # ConfigError for anything but a NumericGuard
        object.__setattr__(self, "_guard", guard)
        object.__setattr__(self, "_straggler", StragglerWatch(policies.get("straggler"), self._config.exclude_file))

    def _plug_binding(self, frameworks: Iterable[str]) -> None:
        object.__setattr__(self, "_guarded", _numeric.GuardedSteps(self._guard, frameworks))
        object.__setattr__(self, "_soft", SoftFailures(guard=self._guard, guarded=self._guarded,
                                                       straggler=self._straggler, tracked=self._tracked,
                                                       binding=lambda: self._binding))

    # ------ the soft-failure part (policies/soft_failures.py)
    guard = property(lambda self: self._soft.guard, doc=SoftFailures.guard.__doc__)
    step_timer = property(lambda self: self._soft.step_timer, doc=SoftFailures.step_timer.__doc__)
    guard_step = Delegated("_soft", SoftFailures.guard_step)

    def _plug_commit(self) -> None:
        replica = ReplicaCheck(self._config.replica_check_every, self._tracked, self._buffers, self._events,
                               self._config.exclude_file)
        replica.checkpoints = self._checkpointer
        object.__setattr__(self, "_replica", replica)
        # The columns of the commit's collective, in this order: the replica check's digests, then the
        # straggler table.
        self._slots.contributions.extend([replica, StragglerAtCommit(self._straggler)])


def reserved_names() -> FrozenSet[str]:
    """Names no tracked object may take: every public member of :class:`State`
    (methods, properties, attributes) and its constructor's own keywords."""
    return _reserved_names(State)
