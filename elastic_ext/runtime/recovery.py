"""What ``run`` does on each kind of interruption, one handler each, and the way out for a leaver.

- :meth:`Recoverer.numeric_fault`: every rank judged a step bad together;
  restore the last commit and skip the step's samples, no Horovod reset.
- :meth:`Recoverer.replica_mismatch`: the replica check found ranks that
  differ; every rank goes back to the last commit all agreed on and trains
  again, no Horovod reset.
- :meth:`Recoverer.collective_failed`: a collective failed; cut the Gloo
  links so every rank learns it at once, count the rollback against
  ``rollback_limit``, restore the last commit.
- :meth:`Recoverer.hosts_updated`: hosts were added or removed, or a rank
  leaves; no rollback. A leaving rank makes the agreed commit durable and
  exits (:func:`leave`).
- :meth:`Recoverer.reset`: re-initialise Horovod with the new world.

After either of the last two the next sync reports a ``recovered`` event
(:meth:`Recoverer.synced`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

import numpy as np

from elastic_ext.config import launched
from elastic_ext.errors import NumericFaultError, ReplicaMismatchError, RollbackLimitError, error_detail
from elastic_ext.events import LEAVE, LINKS_CLOSED, RECOVERED, RESET, RESIZE, ROLLBACK, ROLLBACK_LIMIT
from elastic_ext.worker.gloo_timeout import reset_timeout
from elastic_ext.runtime.closed_links import ClosedLinksWatch
from elastic_ext.runtime.connections import CollectiveConnections
from elastic_ext.runtime.driver_watch import DriverWatch
from elastic_ext.runtime.numeric_recovery import NumericRecovery
from elastic_ext import exit_codes
from elastic_ext.policies.eviction import exclude_host, host_name
from elastic_ext.liveness import Liveness

if TYPE_CHECKING:
    from elastic_ext.runtime.assembly import State

logger = logging.getLogger(__name__)

_HOROVOD_MODULES = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow"}


def controller(binding: Any) -> str:
    """"mpi" when Horovod runs on MPI (no in-job recovery possible), else "gloo" (or "solo")."""
    module = _HOROVOD_MODULES.get(getattr(binding, "framework", ""))
    if module is None:
        return "solo"
    hvd = importlib.import_module(module)
    return "mpi" if hvd.mpi_enabled() else "gloo"


@dataclasses.dataclass
class Recovery:
    """A rollback or resize in progress: reported as ``recovered`` once the next sync is done."""

    cause: str                 # "collective_failed" or "hosts_updated"
    commit_id: int
    started: float             # time.perf_counter() when the failure or resize was seen
    fields: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def event(self, size: int, generation: int) -> Dict[str, Any]:
        """The ``recovered`` event's fields."""
        return {"cause": self.cause, **self.fields, "commit_id": self.commit_id, "size": size,
                "generation": generation, "recovery_s": time.perf_counter() - self.started}


class Recoverer:
    """One worker's handlers for the interruptions of its training function (see the module docstring).

    Args:
        state: the job's State.
        liveness: this process's liveness record.
        kind: :func:`controller`'s answer.
        steps_now: the tracked step counter now, or None (for ``steps_rolled_back``).
    """

    def __init__(self, state: "State", liveness: Liveness, kind: str,
                 steps_now: Callable[["State"], Optional[int]]) -> None:
        self.state, self.liveness, self.kind, self.steps_now = state, liveness, kind, steps_now
        self.links = CollectiveConnections()
        self.cut_links = kind == "gloo"  # never under MPI, which cannot re-form a job anyway
        self.numeric = NumericRecovery()
        self.pending: Optional[Recovery] = None
        # A member lost without a TCP reset, or this worker cut off from its driver (never under MPI).
        self.driver = DriverWatch.for_this_worker(self.links.abort, state.events) if kind == "gloo" else None
        # A collective stuck on connections Gloo already closed (never under MPI).
        self.closed_links = ClosedLinksWatch(
            self.links, liveness, lambda waited, killed: state.events.emit(
                LINKS_CLOSED, waited_s=round(waited, 3), links=len(self.links.known), killed=killed),
            kill_worker=launched()).start() if kind == "gloo" else None

    def close(self) -> None:
        """Stops what runs beside the training (when ``run`` returns or raises)."""
        try:
            self.state.settle_restore()
        except Exception:  # noqa: BLE001 - run is raising already, or its last sync joined it
            logger.exception("the background restore failed")
        if self.driver is not None:
            self.driver.stop()
        if self.closed_links is not None:
            self.closed_links.stop()

    def sync(self) -> None:
        """Brings every rank to the agreed commit; reports the recovery that led here, if any."""
        state = self.state
        started = time.perf_counter()
        if self.cut_links:
            self.links.learn_from_peers(state.binding)
        learned = time.perf_counter()
        if self.driver is not None:
            self.driver.joined()  # the links just learned are this round's
        state.sync()
        self.numeric.reapply(state)  # sync loads the commit, which may not hold a numeric skip yet
        state.start_early_at_sync()  # a failed slot's new worker starts now, while the survivors train
        if self.pending is not None:
            state.events.emit(RECOVERED, **self.pending.event(state.binding.size(), state.generation),
                              learn_connections_s=learned - started, sync_s=time.perf_counter() - learned)
            self.pending = None

    def numeric_fault(self, exc: NumericFaultError) -> None:
        """Every rank raised it together and no collective failed: roll back and skip, no Horovod reset."""
        self.numeric.roll_back(self.state, exc, self.steps_now(self.state), self.steps_now)

    def replica_mismatch(self, exc: ReplicaMismatchError) -> None:
        """Every rank raised it together at a checked commit: back to the last commit all agreed on, no reset.

        The training function is then called again from that commit, without a sync (every rank holds
        the same bytes already), so the replay takes the steps a failure-free run took, and the check
        at the commit that differed tells a transient fault from a deterministic divergence.
        """
        self.state.replay_from_agreed()
        self.numeric.reapply(self.state)  # skips of numeric rollbacks no commit holds yet

    def collective_failed(self, exc: BaseException) -> None:
        """Restores the last commit after a failed collective.

        Raises:
            HorovodInternalError: under MPI, where Horovod cannot re-form the job (``exc`` again).
            RollbackLimitError: too many rollbacks in a row without a new commit.
        """
        state, config, t0, failed_at = self.state, self.state.config, time.perf_counter(), time.time()
        if self.driver is not None:
            self.driver.left()
        if self.kind == "mpi":
            logger.error("a collective failed under an MPI controller, where Horovod cannot re-form "
                         "the job: ending it; a restarted job resumes from the newest checkpoint")
            raise exc
        if self.cut_links:
            self.links.abort(str(exc))
        aborted = time.perf_counter()
        count = state.rollbacks.note(state.commit_id)
        state.note_failure()  # checkpoint_every="auto" follows the failures seen
        lost_s, step_now = state.seconds_since_commit, self.steps_now(state)
        if count > config.rollback_limit:
            state.events.emit(ROLLBACK_LIMIT, commit_id=state.commit_id, rollbacks=count,
                              limit=config.rollback_limit, cause=error_detail(exc))
            raise RollbackLimitError(
                f"{count} rollbacks in a row without a new commit (commit id {state.commit_id}) "
                f"exceed rollback_limit ({config.rollback_limit}); last cause: {exc}") from exc
        if state.committed:
            # The large entries are copied back, and the commit digested, on a thread
            # while reset() re-forms Horovod; reset() waits for it before the callbacks.
            state.restore(background=True)
        # else: a fresh process failed before its first sync (in the collective that
        # learns the connections): nothing to roll back; the next sync brings the state.
        self.numeric.reapply(state)  # skips of numeric rollbacks no commit holds yet
        step_committed = self.steps_now(state)
        steps_back = step_now - step_committed if step_now is not None and step_committed is not None else None
        self.pending = Recovery("collective_failed", state.commit_id, t0, {
            "detail": error_detail(exc), "rollbacks_in_a_row": count,
            "steps_rolled_back": steps_back, "lost_work_s": lost_s,
            "failed_at": failed_at, "abort_s": aborted - t0,
            "restore_s": time.perf_counter() - aborted})  # the calling thread's part
        state.events.emit(ROLLBACK, cause=self.pending.cause, **self.pending.fields, commit_id=self.pending.commit_id)

    def hosts_updated(self, skip_sync: bool) -> None:
        """A resize agreed at a commit; a rank that leaves (or was removed, or runs under MPI) exits here."""
        state, liveness = self.state, self.liveness
        if self.driver is not None:
            self.driver.left()
        # The commit is agreed on every rank: rank 0 makes it durable now,
        # whether or not it was due (a leaver may be rank 0 itself).
        state.checkpoint_now()
        removed = state.removed_at_resize()
        if liveness.leaving() or self.kind == "mpi" or removed:
            # An early start's answer can say that this slot is not in the next world:
            # leave now, as Horovod would end it at its next hvd.init().
            cause = "removed" if removed else liveness.leave_cause if liveness.leaving() else "peer_sigterm"
            leave(state, liveness, self.kind, cause)
        self.pending = Recovery("hosts_updated", state.commit_id, time.perf_counter(),
                                {"skip_sync": skip_sync, "steps_rolled_back": 0})
        state.events.emit(RESIZE, skip_sync=skip_sync, commit_id=state.commit_id)

    def finish_with_newcomers(self) -> None:
        """When training ends while newcomers started early are on their way, takes them into the job first.

        Horovod's driver started them for the next round; left behind, they
        would be killed when the job ends, and the job reported as failed.
        Every rank returned from the training function together and knows of
        the early start, so every rank commits here and resizes with them:
        the function is then called again in the larger world (from the
        commit, which already holds the end of training).

        First, and also when no newcomer is on its way, it waits for the last
        commit's overlapped collective (see ``State.settle_commits``).

        Raises:
            HostsUpdatedInterrupt: on every rank together, when an early start is under way.
        """
        self.state.settle_commits()
        if not self.state.early_start_under_way():
            return
        from horovod.common.exceptions import HostsUpdatedInterrupt
        self.state.commit()  # may agree the resize itself (the newcomers are there)
        self.state.settle_commits()
        raise HostsUpdatedInterrupt(False)

    def reset(self) -> None:
        """Re-initialises Horovod for the next world, then the State's reset callbacks."""
        started = time.perf_counter()
        if self.kind == "gloo":
            reset_timeout(self.state.config, self.state.binding.size())
        self.links.before_init()
        reinit = time.perf_counter()
        try:
            self.state.binding.reset()
        finally:
            reinit_done = time.perf_counter()
            restore_s = self.state.settle_restore()  # a rollback's restore, beside the re-forming
        waited = time.perf_counter()
        self.links.after_init()
        callbacks = time.perf_counter()
        self.state.on_reset()
        done = time.perf_counter()
        background = {} if restore_s is None else {"restore_background_s": restore_s,
                                                   "restore_wait_s": waited - reinit_done}
        shutdown_s = getattr(self.state.binding, "shutdown_s", None)
        parts = {} if shutdown_s is None else {"shutdown_s": shutdown_s}
        self.pending.fields.update(background)
        self.state.events.emit(RESET, duration_s=done - started, cause=self.pending.cause,
                               reinit_s=reinit_done - reinit, callbacks_s=done - callbacks, **parts, **background)


def leave(state: "State", liveness: Liveness, kind: str, cause: str) -> None:
    """Makes the agreed commit durable (rank 0), then exits this process. Never returns."""
    remaining = liveness.leave_time_left()
    if remaining is None:
        remaining = state.config.term_grace_s
    durable = state.wait_for_checkpoint(max(0.0, remaining - 0.5))
    if kind == "mpi":
        # Every rank waits for rank 0's write: mpirun kills the others as soon as one exits.
        state.binding.allreduce_max(np.zeros(1, dtype=np.int64), "elastic_ext.leave")
    notice = {"notice": liveness.leave_notice} if liveness.leave_notice and cause == liveness.leave_cause else {}
    if notice:  # the driver drops the host for this job; the exclude file keeps it out of a restarted one too
        exclude_host(state.config.exclude_file, host_name(), f"{notice['notice']['source']} preemption notice")
    state.events.emit(LEAVE, commit_id=state.commit_id, cause=cause, durable_commit_id=durable, **notice)
    if kind == "gloo":
        _shut_down_with_the_others(state.binding, max(1.0, min(10.0, (liveness.leave_time_left() or 0.0))))
    logging.shutdown()
    # 143 (128 + SIGTERM), not 0: Horovod's driver then shrinks the job rather than ending it.
    os._exit(exit_codes.LEAVE)


def _shut_down_with_the_others(binding: Any, timeout_s: float) -> None:
    """Takes part in Horovod's shutdown, which every other rank runs now too, before exiting.

    Each rank's background loop coordinates with all the others until they
    agree to shut down. A leaver that exited first broke that last round:
    the rank coordinating it (rank 0) lost its loop to "connection reset"
    while its process lived on, and the others waited on it for Gloo's
    timeout (30 s) before they could re-form. Bounded by ``timeout_s``.
    """
    shutdown = getattr(binding, "shutdown", None)
    if shutdown is None:
        return
    worker = threading.Thread(target=shutdown, name="elastic_ext-leave-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("Horovod's shutdown did not finish within %.0fs; leaving anyway", timeout_s)
