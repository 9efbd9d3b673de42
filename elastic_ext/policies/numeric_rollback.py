"""The numeric guard wired into ``State`` and ``run``: the checked step, the rollback, the skip.

:mod:`elastic_ext.policies.guard` decides whether a step is a numeric fault; this
module is what ``State(guard=...)``, ``state.guard_step(...)`` and the
``run`` decorator do with that decision:

- :func:`attach` tracks the guard's :class:`~elastic_ext.policies.guard.LossWindow`
  in the State as the reserved committed object :data:`WINDOW_NAME`, so a
  rollback restores it and ``sync`` hands it to newcomers.
- :func:`guard_step` computes this rank's signal row with the framework's
  helper, runs the guard's one allgather and judges the step. On a fault
  every rank raises the same :class:`~elastic_ext.errors.NumericFaultError`,
  carrying the sample range each elastic sampler would have consumed.
- :class:`NumericRecovery` (one per ``run``) counts numeric rollbacks in a
  row (``NumericGuard.max_rollbacks``), restores the last commit, adds the
  bad step's range to the samplers' skip lists and re-applies it after any
  further restore until a commit includes it, and writes the
  ``numeric_rollback`` event. No collective failed, so Horovod is not reset.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Tuple

import numpy as np

from elastic_ext.errors import ConfigError, NumericFaultError, NumericRollbackLimitError, StateError
from elastic_ext.events import NUMERIC_ROLLBACK, ROLLBACK_LIMIT
from elastic_ext.policies.guard import FaultCounter, LocalSignal, NumericGuard, Verdict, agree
from elastic_ext.data.sampler import ElasticPartitioner

if TYPE_CHECKING:
    from elastic_ext.state.state import State

#: Name under which a State with a guard tracks the guard's LossWindow (reserved: no user object may take it).
WINDOW_NAME = "numeric_guard_window"

Skip = Tuple[str, int, int, int]  # (sampler name, epoch, start, stop)


def attach(tracked: Any, guard: Optional[NumericGuard]) -> None:
    """Tracks ``guard``'s loss window among ``tracked``'s objects (a no-op for None).

    Raises:
        ConfigError: ``guard`` is neither None nor a :class:`NumericGuard`.
    """
    if guard is None:
        return
    if not isinstance(guard, NumericGuard):
        raise ConfigError(f"guard ({guard!r}) must be an elastic_ext.NumericGuard or None")
    tracked.objects[WINDOW_NAME] = guard.new_window()


#: The module whose ``local_row`` computes a framework's signal row, imported by name
#: (like the bindings) so that the core imports no framework package.
_ROW_MODULES = {"torch": "elastic_ext.torch.guard", "tensorflow": "elastic_ext.tensorflow.guard"}


def _local_row(framework: str, loss: Any, grads: Iterable[Any], samples: int) -> np.ndarray:
    module = _ROW_MODULES.get(framework)
    if module is not None:
        local_row = importlib.import_module(module).local_row
        return np.asarray(local_row(loss, grads, samples), dtype=np.float64)
    loss = float(loss)  # another binding (tests): a plain loss, no gradients
    return LocalSignal(loss=loss, samples=int(samples), loss_finite=np.isfinite(loss)).row()


def partitioners(state: "State") -> List[str]:
    """Names of the synced elastic samplers the State tracks."""
    objects = state.objects
    return [name for name in state._tracked.synced(objects) if isinstance(objects[name], ElasticPartitioner)]


def guard_step(state: "State", loss: Any, grads: Iterable[Any] = (), samples: int = 1,
               step: Optional[int] = None) -> Verdict:
    """Judges one step on every rank together (one allgather); a good step's loss joins the window.

    Raises:
        StateError: the State has no guard, or no global step is known
            (pass ``step=`` or track an integer named ``step``).
        ConfigError: ``samples`` is not an integer >= 0.
        NumericFaultError: the step is bad (the same verdict on every rank);
            its ``skips`` name the sample ranges the step would have consumed.
    """
    guard = state.guard
    if guard is None:
        raise StateError("guard_step() needs a guard: State(..., guard=elastic_ext.NumericGuard())")
    if step is None:
        step = state.objects.get("step")
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
        raise StateError(f"guard_step() needs the global step as an int, got step={step!r}: pass step= or "
                         "track an integer named 'step' in the State")
    if not isinstance(samples, (int, np.integer)) or isinstance(samples, bool) or samples < 0:
        raise ConfigError(f"samples ({samples!r}) must be an integer >= 0")
    signal = agree(state.binding, _local_row(state.binding.framework, loss, grads, samples))
    try:
        return guard.check(int(step), signal, state.objects[WINDOW_NAME])
    except NumericFaultError as exc:
        objects = state.objects
        for name in partitioners(state):
            epoch, start, stop = objects[name].step_range()
            if stop > start:
                exc.skips.append((name, epoch, start, stop))
        raise


class NumericRecovery:
    """What ``run`` does on a :class:`NumericFaultError`, and the skips it keeps until committed."""

    def __init__(self) -> None:
        self._counter: Optional[FaultCounter] = None
        self._pending: List[Tuple[int, Skip]] = []  # (commit id restored to, skip)

    def roll_back(self, state: "State", exc: NumericFaultError, step_now: Optional[int],
                  steps: Any) -> None:
        """Counts the rollback, restores the last commit, skips the step's samples, writes the event.

        ``steps(state)`` reads the step counter after the restore (for ``steps_rolled_back``).

        Raises:
            NumericRollbackLimitError: more numeric rollbacks in a row than ``max_rollbacks``
                (a ``rollback_limit`` event with the verdict is written first).
        """
        guard, verdict = state.guard, exc.verdict
        if self._counter is None:
            self._counter = FaultCounter(guard)
        try:
            count = self._counter.note(state.commit_id, verdict)
        except NumericRollbackLimitError as limit:
            state.events.emit(ROLLBACK_LIMIT, commit_id=state.commit_id, rollbacks=self._counter.count,
                              limit=guard.max_rollbacks, cause="numeric", **verdict.fields())
            raise limit from exc
        state.restore()
        committed = steps(state)
        for skip in exc.skips:
            self._pending.append((state.commit_id, tuple(skip)))
        self.reapply(state)
        state.events.emit(NUMERIC_ROLLBACK, **verdict.fields(), commit_id=state.commit_id,
                          rollbacks_in_a_row=count,
                          steps_rolled_back=(step_now - committed if None not in (step_now, committed) else None),
                          skipped=[list(skip) for skip in exc.skips])

    def reapply(self, state: "State") -> None:
        """After a restore: adds back the skips no commit holds yet (those newer commits hold are dropped)."""
        self._pending = [(cid, skip) for cid, skip in self._pending if cid >= state.commit_id]
        objects = state.objects
        for _, (name, epoch, start, stop) in self._pending:
            sampler = objects.get(name)
            if isinstance(sampler, ElasticPartitioner):
                sampler.skip(epoch, start, stop)
