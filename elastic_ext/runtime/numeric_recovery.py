"""What ``run`` does on a :class:`~elastic_ext.errors.NumericFaultError`: roll back, skip the step, no reset.

:class:`NumericRecovery` (one per ``run``) counts numeric rollbacks in a row
(``ElasticConfig.rollback_limit``), restores the last commit, adds the bad
step's range to the samplers' skip lists and re-applies it after any further
restore until a commit includes it, and writes the ``numeric_rollback``
event. No collective failed, so Horovod is not reset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.errors import NumericFaultError, NumericRollbackLimitError
from elastic_ext.events import NUMERIC_ROLLBACK, ROLLBACK_LIMIT
from elastic_ext.policies.guard import FaultCounter
from elastic_ext.policies.numeric_rollback import Skip

if TYPE_CHECKING:
    from elastic_ext.runtime.assembly import State


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
            NumericRollbackLimitError: more numeric rollbacks in a row than ``rollback_limit``
                (a ``rollback_limit`` event with the verdict is written first).
        """
        verdict = exc.verdict
        if self._counter is None:
            self._counter = FaultCounter(state.config.rollback_limit)
        try:
            count = self._counter.note(state.commit_id, verdict)
        except NumericRollbackLimitError as limit:
            state.events.emit(ROLLBACK_LIMIT, commit_id=state.commit_id, rollbacks=self._counter.count,
                              limit=self._counter.limit, cause="numeric", **verdict.fields())
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
