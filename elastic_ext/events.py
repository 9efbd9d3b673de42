"""Structured recovery events: one JSON object per line, plus a log line.

Events are what benchmarks and users read to learn what a job went through.
Every event carries ``event`` (its name), ``time`` (Unix seconds), ``rank``,
``size`` (as seen when it was written) and ``pid``; the names below are the
only ones elastic_ext emits, each a constant of this module, with the fields
it adds:

State (``state.py``):

- ``sync`` (:data:`SYNC`): state brought in line across ranks; ``commit_id``,
  ``generation``, ``root``, ``loaded`` (this rank received bytes),
  ``broadcast``, ``bytes`` (the state payload sent to the ranks that lacked
  it; 0 when every rank already held the commit), ``senders`` (the ranks
  that each sent one stripe of it), ``newcomers``, ``duration_s``.

The run loop (``run.py``):

- ``rollback`` (:data:`ROLLBACK`): a collective failed and the state went
  back to the last commit; ``cause``, ``detail``, ``commit_id``,
  ``rollbacks_in_a_row``, ``steps_rolled_back``, ``lost_work_s``,
  ``failed_at`` (Unix time the failure reached the run loop), ``abort_s``
  (cutting the collective connections), ``restore_s`` (the commit restored).
- ``rollback_limit`` (:data:`ROLLBACK_LIMIT`): too many rollbacks in a row,
  the job ends with :class:`~elastic_ext.errors.RollbackLimitError`;
  ``commit_id``, ``rollbacks``, ``limit``, ``cause``.
- ``resize`` (:data:`RESIZE`): hosts were added or removed, no rollback;
  ``skip_sync``, ``commit_id``.
- ``prestart`` (:data:`PRESTART`): under ``elastic-horovodrun``, a host
  addition at this commit starts the newcomers while training goes on;
  ``commit_id``; ``at_sync`` (True) when it started right after a sync,
  in a round the driver formed without a failed worker's slot.
- ``newcomers_joined`` (:data:`NEWCOMERS_JOINED`): that early start ends in
  a resize at this commit (a ``resize`` event follows); ``commit_id``,
  ``why`` (on rank 0, which polls: ``all_there``, ``newcomer_failed``, ``timeout``,
  ``error: ...``; on the others: ``agreed``; ``removed`` on a rank left out
  of the next world, which then leaves; ``interrupted`` by a removal or
  leave), ``next_size``, ``waited_s`` (the survivors trained all that time).
- ``reset`` (:data:`RESET`): Horovod re-initialised after a rollback or a
  resize; ``duration_s``, ``cause``, ``reinit_s`` (Horovod's shutdown and
  init: the rendezvous with the driver's new round and the Gloo context),
  ``shutdown_s`` (the shutdown's part of it, where the binding times it),
  ``callbacks_s`` (the State's reset callbacks); after a rollback whose
  restore went to a thread (:mod:`elastic_ext.state.restore`) also
  ``restore_background_s`` (the thread's time) and ``restore_wait_s`` (what
  the reset waited for it after Horovod's init), which ``recovered`` repeats.
- ``recovered`` (:data:`RECOVERED`): the first sync after a rollback or
  resize is done; the fields of that ``rollback``/``resize`` plus ``size``,
  ``generation``, ``recovery_s``, ``learn_connections_s`` (the collective
  that learns the new connections) and ``sync_s`` (``State.sync()``).
- ``numeric_rollback`` (:data:`NUMERIC_ROLLBACK`): the numeric guard
  (``State(guard=...)``) judged a step bad, every rank went back to the last
  commit without a Horovod reset and skips that step's samples; the
  verdict's fields (``step``, ``reason``, ``loss``, ``bad_ranks``, ...),
  ``commit_id``, ``rollbacks_in_a_row``, ``steps_rolled_back``, ``skipped``
  (``[sampler, epoch, start, stop]`` ranges). A numeric rollback over
  ``ElasticConfig.rollback_limit`` writes ``rollback_limit`` with ``cause``
  ``"numeric"`` and the verdict's fields instead.
- ``finish`` (:data:`FINISH`): the training function returned; ``commit_id``,
  ``duration_s``.
- ``stall`` (:data:`STALL`): this worker declared itself stuck; ``idle_s``.
- ``suspended`` (:data:`SUSPENDED`): the process did not run for ``gap_s``
  seconds (the job was suspended); the stall clock restarted.
- ``guardian_lost`` (:data:`GUARDIAN_LOST`, :mod:`elastic_ext.runtime.watchdog`): this
  worker's guardian process is gone (killed, crashed): hang detection is off
  for this worker from now on; ``exit_code`` (the guardian's, None if it had
  not exited yet), ``error`` (why its heartbeat pipe failed).
- ``leave`` (:data:`LEAVE`): a SIGTERMed worker, or every rank under MPI,
  leaves at a commit; ``commit_id``, ``cause``, ``durable_commit_id`` (the
  newest checkpoint rank 0 made durable first); after a preemption notice
  (``cause`` ``"preemption"``, :mod:`elastic_ext.worker.notices`) also
  ``notice``: its ``source``, ``kind``, ``detail`` and ``seen`` (Unix time).
- ``straggler`` (:data:`STRAGGLER`): every rank, when the commit's table
  shows one rank slow for long enough (:mod:`elastic_ext.policies.eviction`);
  ``commit_id``, ``evicted_rank``, ``step``, ``ratio``, ``slow_since``,
  ``slow_steps``, ``ratios``, and ``host`` on the evicted rank.
- ``replica_replay`` (:data:`REPLICA_REPLAY`): every rank, when the
  replica check (``replica_check_every``) found ranks whose committed states
  differ (:mod:`elastic_ext.policies.replica_check`): every rank goes back to
  ``back_to`` (the last commit on which all agreed) and trains again to
  ``commit_id``; ``wrong_ranks``, ``wrong_hosts``, ``majority_ranks`` (empty
  when no strict majority), ``first_difference`` (the first entry that
  differs), ``last_agreed_commit_id``, ``replays``.
- ``replica_mismatch`` (:data:`REPLICA_MISMATCH`): every rank, when a
  mismatch is explained, with the same fields and ``cause``:
  ``"transient"`` (all agree after the replay: a hardware fault, ``healed``
  True, ``struck_hosts`` the hosts a strict majority named wrong,
  ``repeat_hosts`` those struck before within the window: their wrong ranks
  leave and the host goes into ``exclude_file``), ``"divergence"`` (the
  same ranks differ again: the job stops with ``StateDivergenceError``, no
  strike) or ``"unexplained"`` (nothing to replay from, or the mismatch kept
  moving: the job stops); ``replayed_from``, ``replays``.
- ``restarted_in_place`` (:data:`RESTARTED_IN_PLACE`, at ``@elastic_ext.run``
  of a worker its keeper restarted, see :mod:`elastic_ext.worker.keeper`): Gloo
  aborted the previous process of this slot inside ``hvd.init()``;
  ``restarts`` (how many times this slot's keeper restarted it).
- ``member_failed`` (:data:`MEMBER_FAILED`, from the driver watch,
  :mod:`elastic_ext.runtime.driver_watch`): the launcher's driver reports a
  member of this worker's round failed (its host went silent: no TCP reset
  told the collective); this worker cut its collective links so the job
  rolls back now; ``round``, ``member`` (``host:local_rank``), ``links_cut``.
- ``links_closed`` (:data:`LINKS_CLOSED`, :mod:`elastic_ext.runtime.closed_links`):
  this worker waited ``waited_s`` seconds in a collective whose every
  connection (``links``) was closed; ``killed``: it ends itself (exit status
  76, which the launcher's driver does not charge to its host) so the job
  re-forms without waiting for Gloo's timeout (under ``elastic-horovodrun``),
  or it waits for that timeout (plain ``horovodrun``, where its death would
  cost its whole host).
- ``fenced`` (:data:`FENCED`, from the driver watch): this worker could not
  reach its driver for ``unreachable_s`` seconds (``attempts`` failed
  requests, the last ``error``) and exits rather than train cut off from
  its job.
- ``job_restart`` (:data:`JOB_RESTART`, written by ``python -m
  elastic_ext.launch.supervise`` with rank -1): the whole job failed and is started
  again; ``exit_code``, ``restart``, ``max_restarts``, ``ran_s``.

Durable checkpoints (the checkpoint writer, and State on resume):

- ``checkpoint`` (:data:`CHECKPOINT`): a checkpoint is durable;
  ``commit_id``, ``path``, ``bytes``, ``deleted``, ``not_deleted``,
  ``duration_s``.
- ``checkpoint_skipped`` (:data:`CHECKPOINT_SKIPPED`): a checkpoint was
  due while the previous write still ran; ``commit_id``, ``running``.
- ``checkpoint_failed`` (:data:`CHECKPOINT_FAILED`): a write failed,
  training goes on (the next commit tries again); ``commit_id``, ``error``,
  ``failures_in_a_row``.
- ``checkpoint_failing`` (:data:`CHECKPOINT_FAILING`): writes failed
  ``checkpoint_failure_limit`` times in a row; at its next commit every rank
  stops with ``CheckpointError``; ``commit_id``, ``failures_in_a_row``,
  ``limit``, ``error``.
- ``checkpoint_resumed`` (:data:`CHECKPOINT_RESUMED`): a new job started
  from a checkpoint; ``commit_id``, ``path``, ``world_size``,
  ``data_cursor``.
- ``checkpoint_cadence`` (:data:`CHECKPOINT_CADENCE`): with
  ``checkpoint_every="auto"``, rank 0 changed the cadence
  (:mod:`elastic_ext.checkpoint.cadence`); ``every`` (commits),
  ``interval_s``, ``reason`` (``write``, ``failure``), ``write_cost_s``,
  ``write_s``, ``commit_interval_s``, ``mtbf_s``, ``failures``,
  ``training_s``, ``commit_id``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

SYNC = "sync"
ROLLBACK = "rollback"
ROLLBACK_LIMIT = "rollback_limit"
RESIZE = "resize"
PRESTART = "prestart"
NEWCOMERS_JOINED = "newcomers_joined"
RESET = "reset"
RECOVERED = "recovered"
FINISH = "finish"
STALL = "stall"
SUSPENDED = "suspended"
GUARDIAN_LOST = "guardian_lost"
LEAVE = "leave"
CHECKPOINT = "checkpoint"
CHECKPOINT_SKIPPED = "checkpoint_skipped"
CHECKPOINT_FAILED = "checkpoint_failed"
CHECKPOINT_FAILING = "checkpoint_failing"
CHECKPOINT_RESUMED = "checkpoint_resumed"
CHECKPOINT_CADENCE = "checkpoint_cadence"
NUMERIC_ROLLBACK = "numeric_rollback"
STRAGGLER = "straggler"
REPLICA_MISMATCH = "replica_mismatch"
REPLICA_REPLAY = "replica_replay"
JOB_RESTART = "job_restart"
RESTARTED_IN_PLACE = "restarted_in_place"
MEMBER_FAILED = "member_failed"
FENCED = "fenced"
LINKS_CLOSED = "links_closed"

#: Every event name elastic_ext emits (the module docstring says what each means).
ALL_EVENTS = (SYNC, ROLLBACK, ROLLBACK_LIMIT, RESIZE, PRESTART, NEWCOMERS_JOINED, RESET, RECOVERED,
              FINISH, STALL, SUSPENDED, GUARDIAN_LOST, LEAVE, CHECKPOINT, CHECKPOINT_SKIPPED, CHECKPOINT_FAILED,
              CHECKPOINT_FAILING, CHECKPOINT_RESUMED, CHECKPOINT_CADENCE, NUMERIC_ROLLBACK, STRAGGLER, REPLICA_MISMATCH,
              REPLICA_REPLAY, JOB_RESTART, RESTARTED_IN_PLACE, MEMBER_FAILED, FENCED, LINKS_CLOSED)


class EventLog:
    """Appends events to a JSON-lines file (if a path is given) and logs them.

    Args:
        path: file to append to; ``{rank}`` is replaced by ``rank_fn()`` the
            first time an event is written. ``None`` only logs.
        rank_fn: returns this worker's current rank.
        size_fn: returns the current world size.
    """

    def __init__(self, path: Optional[str], rank_fn: Callable[[], int], size_fn: Callable[[], int]) -> None:
        self._path_template = path
        self._rank_fn = rank_fn
        self._size_fn = size_fn
        self._file = None
        self._lock = threading.Lock()
        self.history: list[dict] = []

    def _safe(self, fn: Callable[[], int]) -> int:
        # Rank and size are unavailable while Horovod is shut down during a reset.
        try:
            return int(fn())
        except Exception:  # noqa: BLE001 - an event must never fail because Horovod is down
            return -1

    def emit(self, event: str, **fields: Any) -> dict:
        """Writes one event (a name from :data:`ALL_EVENTS`) and returns its record.

        Never raises for the file: events are a side channel, and a full disk
        (ENOSPC), an I/O error or a closed file must not turn a rollback, a
        failed checkpoint or a fence into a crash. The first failure is logged
        once; the file is then closed and events go to the log (and
        :attr:`history`) only.
        """
        record = {"event": event, "time": time.time(), "rank": self._safe(self._rank_fn),
                  "size": self._safe(self._size_fn), "pid": os.getpid()}
        record.update(fields)
        self.history.append(record)
        line = json.dumps(record, sort_keys=True, default=str)
        logger.info("[rank %s] %s", record["rank"], line)
        if self._path_template is not None:
            with self._lock:
                if self._path_template is not None:  # checked again: a failed write turns the file off
                    self._append(record["rank"], line)
        return record

    def _append(self, rank: int, line: str) -> None:
        path = self._path_template.replace("{rank}", str(rank)) if self._path_template else ""
        try:
            if self._file is None:
                parent = os.path.dirname(path)
                if parent:
                    os.makedirs(parent, exist_ok=True)
                # 0o600: events name hosts, paths and errors of one user's job.
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._file = os.fdopen(fd, "a", encoding="utf-8")
            self._file.write(line + "\n")
            self._file.flush()
        except (OSError, ValueError) as exc:  # ValueError: a closed file
            logger.error("cannot write events to %s (%s: %s); events go to the log only from now on",
                         path, type(exc).__name__, exc)
            self._path_template = None
            file, self._file = self._file, None
            if file is not None:
                try:
                    file.close()
                except (OSError, ValueError) as close_exc:  # its buffer holds the line that failed
                    logger.debug("closing the events file %s failed: %s", path, close_exc)


def read_events(path: str) -> list[dict]:
    """Reads a JSON-lines event file written by :class:`EventLog`.

    A missing file reads as no events: a worker that never emitted one
    never opened its file. A last line without its newline that does not
    parse is a write cut short (the worker died in it) and is skipped with a
    warning; a bad line anywhere else raises ``ValueError``.
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = [line for line in handle if line.strip()]
    events = []
    for index, line in enumerate(lines):
        try:
            events.append(json.loads(line))
        except ValueError:
            if index < len(lines) - 1 or line.endswith("\n"):
                raise  # damage inside the file: not a write cut short
            # The last line, without its newline: a writer that died mid-write (or is writing now).
            logger.warning("%s: ignoring its torn last line (%d characters)", path, len(line))
    return events
