"""The State's soft-failure part: the numeric guard's checked steps and the straggler timer.

A part of the public :class:`elastic_ext.State` (:mod:`elastic_ext.runtime.assembly`), built
with what it uses: the :class:`~elastic_ext.policies.guard.NumericGuard` given, its
:class:`~elastic_ext.policies.numeric_rollback.GuardedSteps`, the
:class:`~elastic_ext.policies.eviction.StragglerWatch`, the tracked objects and the State's
binding (looked up when a step is checked). The State shows ``guard``, ``step_timer`` and
``guard_step`` as its own. What a commit does with them is in ``State.commit`` (the step in
flight is judged before the snapshot) and :mod:`elastic_ext.state.decisions`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from elastic_ext.binding import Binding
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.policies.guard import NumericGuard, Verdict
from elastic_ext.policies.step_timer import StepTimer
from elastic_ext.state.tracked import Tracked


class SoftFailures:
    """``guard``, ``guard_step`` and ``step_timer`` (see the module docstring)."""

    def __init__(self, *, guard: Optional[NumericGuard], guarded: Any, straggler: Any, tracked: Tracked,
                 binding: Callable[[], Binding]) -> None:
        self._guard, self._guarded, self._straggler = guard, guarded, straggler
        self._tracked, self._binding = tracked, binding

    @property
    def guard(self) -> Optional[NumericGuard]:
        """The :class:`NumericGuard` given, or None."""
        return self._guard

    @property
    def step_timer(self) -> StepTimer:
        """Wrap this rank's own compute of a step in it (``with state.step_timer: ...``), not the
        waits for the others: straggler eviction compares these times (a no-op cost when off)."""
        return self._straggler.timer

    def guard_step(self, loss: Any, grads: Iterable[Any] = (), samples: int = 1,
                   step: Optional[int] = None) -> Optional[Verdict]:
        """Checks a step on every rank together (after the gradient allreduce, before ``commit()``); a bad
        one raises ``NumericFaultError``, which ``run`` turns into a rollback that skips its samples.

        When and how it is judged (carried on the gradient allreduce, in the
        background until the next call or commit, or blocking):
        :class:`elastic_ext.policies.numeric_rollback.GuardedSteps`, whose
        ``step`` says what it raises. Returns the verdict reached in this call.
        """
        objects = self._tracked.objects
        samplers = (name for name in self._tracked.synced(objects) if isinstance(objects[name], ElasticPartitioner))
        return self._guarded.step(self._binding(), objects, samplers, loss, grads, samples, step)
