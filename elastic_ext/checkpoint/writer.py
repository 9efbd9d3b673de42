"""The background checkpoint writer of rank 0: thread, due/skip policy, resume bookkeeping.

Who writes: rank 0 alone, the synced entries only. They are identical on
every rank (``sync`` checks it), so one copy is the whole state; sharding by
rank would need a second agreement round on which shards are complete, and
the write is off the training path anyway. Per-rank entries (RNG streams)
are not checkpointed: after a restart from storage each rank keeps the
streams its script seeded.

The write reads the commit's own buffers, leased from
:class:`~elastic_ext.state.buffers.CommitBuffers` and released when it is done;
the buffers decide where later commits copy meanwhile.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Dict, Iterable, Optional, Set, Tuple

from elastic_ext.state.buffers import CommitBuffers, Lease
from elastic_ext.checkpoint.files import write_checkpoint
from elastic_ext.checkpoint.format import Loaded
from elastic_ext.checkpoint.lock import DirectoryLock, job_id
from elastic_ext.checkpoint.store import CheckpointStore
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import CheckpointError, error_detail
from elastic_ext.checkpoint.cadence import Cadence
from elastic_ext.events import (CHECKPOINT, CHECKPOINT_CADENCE, CHECKPOINT_FAILED, CHECKPOINT_FAILING,
                                CHECKPOINT_RESUMED, CHECKPOINT_SKIPPED, EventLog)

logger = logging.getLogger(__name__)

# At exit, a write still running after this long is hung (an object store that stopped answering), not slow:
# the finished worker leaves without it rather than stay forever. Generous, as the last checkpoint matters most.
EXIT_WAIT_S = 600.0


class Checkpointer:
    """Background checkpoint writes for :class:`~elastic_ext.State` (rank 0).

    Bound policy: at most one write is in flight. When a checkpoint is due
    while the previous write still runs, this commit's checkpoint is skipped
    (warning and a ``checkpoint_skipped`` event) and the next commit is
    checkpointed instead: a commit never waits on storage. Only a forced
    write (a leave, a resize) waits for the running one first.

    With ``checkpoint_every="auto"`` a :class:`~elastic_ext.checkpoint.cadence.Cadence`
    decides when a checkpoint is due, from what rank 0 measures here (the
    commits' intervals with and without a write) and the failures seen.

    A failed write is retried at the next commit. After
    ``checkpoint_failure_limit`` failures in a row, :meth:`failing` says
    what failed (and a ``checkpoint_failing`` event is written once): the
    State then stops every rank at its next commit.

    Args:
        config: the State's :class:`~elastic_ext.ElasticConfig`.
        events: where ``checkpoint*`` events go.
        buffers: the State's commit buffers; a write leases the ones it reads.
    """

    def __init__(self, config: ElasticConfig, events: EventLog, buffers: CommitBuffers) -> None:
        self.store = CheckpointStore(config.checkpoint_dir)
        self.lock = DirectoryLock(config.checkpoint_dir, job_id())  # taken at the first resume or write
        self._config = config
        self._events = events
        self._buffers = buffers
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[Tuple[int, Optional[BaseException]]] = None
        self._owed = False                               # a due checkpoint was skipped
        self._result_id = -1                             # commit id of the running (or last) write
        self.last_written: Optional[int] = None
        self.failures_in_a_row = 0
        self._last_error: Optional[str] = None
        self.cadence: Optional[Cadence] = Cadence() if config.checkpoint_every == "auto" else None
        self._wrote_since_commit = False                 # a write ran since the last observed commit
        self._duration_s = 0.0                           # the last write's duration
        atexit.register(_wait_at_exit, weakref.ref(self))

    def _collect(self) -> None:
        """On the training thread: takes a finished write's result."""
        if self._thread is None or self._thread.is_alive():
            return
        self._thread.join()
        self._thread = None
        commit_id, error = self._result
        if error is None:
            self.last_written = max(commit_id, self.last_written or 0)
            self.failures_in_a_row = 0
            if self.cadence is not None:
                self._cadence_event(self.cadence.on_write_done(self._duration_s), commit_id)
            return
        self._owed = True  # the next commit tries again rather than waiting a whole interval
        self.failures_in_a_row += 1
        self._last_error = error_detail(error)
        limit = self._config.checkpoint_failure_limit
        if self.failures_in_a_row == limit:
            logger.critical("%d checkpoint writes failed in a row (checkpoint_failure_limit); the job stops at the "
                            "next commit. Last error: %s", limit, self._last_error)
            self._events.emit(CHECKPOINT_FAILING, commit_id=commit_id, failures_in_a_row=limit, limit=limit,
                              error=self._last_error)

    def failing(self) -> Optional[str]:
        """What failed, once ``checkpoint_failure_limit`` writes failed in a row; else None."""
        self._collect()
        if self.failures_in_a_row < self._config.checkpoint_failure_limit:
            return None
        return (f"{self.failures_in_a_row} writes in a row to {self.store.directory} failed, the last with: "
                f"{self._last_error}")

    # writing --------------------------------------------------------------

    def due(self, commit_id: int) -> bool:
        """True if commit ``commit_id`` should be checkpointed (every N-th, or one was skipped)."""
        if self.cadence is not None:
            if self._thread is not None and self._thread.is_alive():
                return False  # the cadence waits for a running write rather than skip or owe a checkpoint
            regular = self.cadence.due(commit_id, self.last_written)
        else:
            regular = commit_id % self._config.checkpoint_every == 0
        return (regular or self._owed) and commit_id != self.last_written

    def observe_commit(self) -> None:
        """Rank 0, at each commit before :meth:`due`: the interval since the previous one, for the cadence."""
        if self.cadence is None:
            return
        running = self._thread is not None and self._thread.is_alive()
        self.cadence.on_commit(self._wrote_since_commit or running)
        self._wrote_since_commit = running

    def note_failure(self) -> None:
        """A rollback: the cadence counts it (every rank; only rank 0's decides)."""
        if self.cadence is not None:
            self._cadence_event(self.cadence.on_failure(), None)

    def _cadence_event(self, fields: Optional[Dict[str, Any]], commit_id: Optional[int]) -> None:
        if fields is not None:
            logger.info("checkpoint cadence: every %d commits (%.0fs; write cost %.3fs, mean time between "
                        "failures %.0fs)", fields["every"], fields["interval_s"], fields["write_cost_s"],
                        fields["mtbf_s"])
            self._events.emit(CHECKPOINT_CADENCE, commit_id=commit_id, **fields)

    def on_commit(self, commit_id: int, names: Iterable[str], info: Dict[str, Any], force: bool = False) -> None:
        """Starts the background write of the last commit's entries ``names`` if one is due.

        Called after the commit is agreed. ``force`` writes it even if not due
        (a leave or a resize makes the agreed commit durable), waiting for a
        running write first however long.
        """
        self._collect()
        if commit_id == self.last_written or (self._thread is not None and commit_id == self._result_id):
            return
        if not force and not self.due(commit_id):
            return
        if self._thread is not None:
            self.wait(None if force else 0.0)
            if self._thread is not None:
                self._owed = True
                logger.warning("checkpoint of commit %d skipped: the write of commit %d is still running; "
                               "the next commit is checkpointed instead", commit_id, self._result_id)
                self._events.emit(CHECKPOINT_SKIPPED, commit_id=commit_id, running=self._result_id)
                return
        self._owed = False
        lease = self._buffers.lease(names)
        self._result_id = commit_id
        if self.cadence is not None:
            info = {**info, "cadence": self.cadence.to_manifest()}  # a restarted job goes on counting
            self.cadence.on_write_started()
            self._wrote_since_commit = True
        self._thread = threading.Thread(target=self._write, args=(commit_id, lease, dict(info)),
                                        name=f"elastic_ext-checkpoint-{commit_id}", daemon=True)
        self._thread.start()

    def _write(self, commit_id: int, lease: Lease, info: Dict[str, Any]) -> None:
        # The result is recorded before anything is reported: whatever happens to the
        # reporting, _collect counts this write (checkpoint_failure_limit depends on it),
        # and a thread that dies unexpectedly counts as a failed write, never as a stale result.
        self._result = (commit_id, CheckpointError(f"the write of commit {commit_id} ended without a result"))
        started = time.perf_counter()
        try:
            self.lock.acquire()  # another job's directory: a failed write, counted like any other
            path = write_checkpoint(self.store.directory, commit_id, lease.entries, info)
        except Exception as exc:  # noqa: BLE001 - reported here and in the event; training goes on
            self._result = (commit_id, exc)
            logger.error("checkpoint of commit %d failed: %s", commit_id, exc)
            self._events.emit(CHECKPOINT_FAILED, commit_id=commit_id, error=error_detail(exc),
                              failures_in_a_row=self.failures_in_a_row + 1)
            return
        finally:
            lease.release()
        self._duration_s = time.perf_counter() - started
        # The checkpoint is durable now. Retention is housekeeping: what it cannot
        # delete is logged (once) by the store, and never makes this write count as
        # failed, which would change the cadence (a full write at every commit).
        deleted = self.store.apply_retention(commit_id, self._config.checkpoint_keep_last)
        self._result = (commit_id, None)
        nbytes = sum(int(a.nbytes) for e in lease.entries.values() for a in e.arrays.values())
        self._events.emit(CHECKPOINT, commit_id=commit_id, path=path, bytes=nbytes, deleted=deleted,
                          not_deleted=list(self.store.not_deleted), duration_s=self._duration_s)

    def hold(self, commit_id: int) -> None:
        """Retention keeps the newest checkpoint at or before ``commit_id`` until :meth:`release`
        (:meth:`CheckpointStore.hold`: the replica check's last agreed commit, when ranks disagree)."""
        self.store.hold(commit_id)

    def release(self) -> None:
        """Ends :meth:`hold`."""
        self.store.release()

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Waits for the running write (at most ``timeout_s``); True if none is left running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        self._collect()
        return self._thread is None

    # resuming -------------------------------------------------------------

    def newest(self, synced: Set[str]) -> Tuple[Optional[Loaded], Optional[str]]:
        """The newest valid checkpoint for a State whose synced objects are ``synced``.

        Returns ``(checkpoint or None, None)``, or ``(None, message)`` when it
        cannot be used: another job holds the directory, the directory cannot
        be read, its checkpoints exist but none can be used (see
        :meth:`CheckpointStore.load_newest`), or the checkpoint holds objects
        this State does not track as synced.
        """
        try:
            self.lock.acquire()  # before reading: another job's checkpoints are not this job's to resume
            loaded = self.store.load_newest(fresh_start=self._config.checkpoint_fresh_start)
        except CheckpointError as exc:  # another job holds it, none usable, or the directory cannot be read
            return None, f"cannot resume from the checkpoints in {self._config.checkpoint_dir}: {exc}"
        if loaded is None:
            return None, None
        foreign = sorted(set(loaded.entries) - synced)
        if foreign:
            return None, (f"cannot resume from checkpoint {loaded.path}: CheckpointError: it holds objects "
                          f"{foreign} that this State does not track as synced objects (it tracks {sorted(synced)})")
        missing = sorted(synced - set(loaded.entries))
        if missing:
            logger.warning("[rank 0] checkpoint %s holds no %s; they keep their initial values", loaded.path, missing)
        return loaded, None

    def resumed(self, loaded: Loaded) -> None:
        """Records that the job resumed from ``loaded`` (that commit is not written again)."""
        self.last_written = loaded.commit_id
        self._events.emit(CHECKPOINT_RESUMED, commit_id=loaded.commit_id, path=loaded.path,
                          world_size=loaded.manifest.get("world_size"),
                          data_cursor=loaded.manifest.get("data_cursor"))
        if self.cadence is not None:
            self._cadence_event(self.cadence.resumed(loaded.manifest.get("cadence")), loaded.commit_id)


def _wait_at_exit(ref: "weakref.ref[Checkpointer]") -> None:
    # Daemon threads die at interpreter exit; let the last write finish first, within EXIT_WAIT_S.
    checkpointer = ref()
    if checkpointer is not None and checkpointer._thread is not None:
        commit_id = checkpointer._result_id
        logger.info("waiting for the checkpoint of commit %d before exiting (at most %gs)", commit_id, EXIT_WAIT_S)
        if not checkpointer.wait(EXIT_WAIT_S):
            logger.error("the checkpoint of commit %d did not finish within %gs of exit: abandoned (a resume "
                         "takes the newest complete checkpoint; a cut write has no manifest)", commit_id, EXIT_WAIT_S)
