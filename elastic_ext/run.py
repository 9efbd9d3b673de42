"""The ``run`` decorator: rollback on failure, resize without rollback, limits, events.

Control flow, per worker (the same on every rank)::

    sync ──> call func ──> returns ──> finish
      ^          │
      │          ├─ HorovodInternalError (a collective failed):
      │          │     restore last commit, count the rollback, reset Horovod
      │          └─ HostsUpdatedInterrupt (hosts added or removed, raised by commit):
      │                no rollback; reset Horovod
      └──────────┘  (sync sends no state when every rank already holds the agreed commit)

Differences from ``hvd.elastic.run``: one decorator for both frameworks;
TensorFlow op errors that come from a Horovod collective become
``HorovodInternalError`` and every other error propagates (Horovod's TF
wrapper returns None for them, so a worker could exit 0 on an error);
consecutive rollbacks without a new commit are limited
(``RollbackLimitError``); every reset writes a structured event; and the
watchdog (:mod:`elastic_ext.watchdog`) makes failures known to every rank
at once, turns hung workers into failures, and lets a worker told to leave
(SIGTERM) go at its next commit without a rollback.

Durability on the way out: at every resize, and above all when a worker
leaves (SIGTERM: preemption, ``scancel``, the driver ending the job), rank 0
starts writing the agreed commit as a durable checkpoint even if it is not
due under ``checkpoint_every``; a leaving rank 0 waits for that write (at most
what is left of ``term_grace_s``) before it exits.

Under an MPI controller (``horovodrun --mpi``, ``mpirun``) Horovod cannot
re-form a job: a failed collective ends the job (the launcher kills every
rank), and a SIGTERM makes every rank stop at the next commit once rank 0
has made that commit durable. Commits and checkpoints work as usual, so a
requeued job resumes from the newest checkpoint at any world size. One log
line at start-up says so.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import signal
import time
from typing import Any, Callable, Optional, TypeVar

import numpy as np

from elastic_ext import watchdog
from elastic_ext.connections import CollectiveConnections
from elastic_ext.errors import RollbackLimitError

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_HOROVOD_MODULES = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow"}


def controller(binding: Any) -> str:
    """"mpi" when Horovod runs on MPI (no in-job recovery possible), else "gloo" (or "solo")."""
    module = _HOROVOD_MODULES.get(getattr(binding, "framework", ""))
    if module is None:
        return "solo"
    hvd = importlib.import_module(module)
    return "mpi" if hvd.mpi_enabled() else "gloo"


def _announce_mpi(config: Any) -> None:
    durable = (f"durable checkpoints in {config.checkpoint_dir} let a restarted (requeued) job resume at any "
               f"world size" if config.checkpoint_dir else
               "checkpoint_dir is not set, so a restarted job starts from scratch")
    logger.warning("elastic_ext under an MPI controller: in-job recovery, resizing, host updates and the "
                   "connection abort are off (MPI cannot re-form a job); a failed worker ends the job, SIGTERM "
                   "stops every rank at the next commit after rank 0 made it durable; %s", durable)


def _leave(state: Any, kind: str, cause: str) -> None:
    """Makes the agreed commit durable (rank 0), then exits this process. Never returns."""
    remaining = watchdog.leave_time_left()
    if remaining is None:
        remaining = state.config.term_grace_s
    durable = state.wait_for_checkpoint(max(0.0, remaining - 0.5))
    if kind == "mpi":
        # Every rank waits for rank 0's write: mpirun kills the others as soon as one exits.
        state.binding.allreduce_max(np.zeros(1, dtype=np.int64), "elastic_ext.leave")
    state.events.emit("leave", commit_id=state.commit_id, cause=cause, durable_commit_id=durable)
    logging.shutdown()
    os._exit(watchdog.LEAVE_EXIT_CODE)


def run(func: Optional[F] = None) -> Any:
    """Decorates a training function ``func(state, *args, **kwargs)`` for elastic execution.

    The function must not start with a collective of its own: the first
    thing that runs is ``state.sync()``. Use it bare (``@elastic_ext.run``).

    Raises:
        RollbackLimitError: more consecutive rollbacks than
            ``state.config.rollback_limit`` without a commit in between.
        StateDivergenceError: ranks disagree on the committed state.
    """
    if func is None:
        return run

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        from horovod.common.elastic import notification_manager
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

        binding = state.binding
        events = state.events
        config = state.config
        kind = controller(binding)
        if kind == "mpi":
            _announce_mpi(config)
        notification_manager.init()
        notification_manager.register_listener(state)
        dog = watchdog.Watchdog(config, on_stall=lambda idle: events.emit("stall", idle_s=idle),
                                on_suspend=lambda gap: events.emit("suspended", gap_s=gap))
        dog.start()
        previous_sigterm = watchdog.install_sigterm(config)
        links = CollectiveConnections()
        cut_links = config.abort_connections and kind == "gloo"
        pending: Optional[dict] = None
        started = time.perf_counter()
        try:
            while True:
                try:
                    if cut_links:
                        links.learn_from_peers(binding)
                    state.sync()
                    if pending is not None:
                        pending["size"] = binding.size()
                        pending["generation"] = state.generation
                        pending["recovery_s"] = time.perf_counter() - pending.pop("_t0")
                        events.emit("recovered", **pending)
                        pending = None
                    try:
                        with watchdog.training():
                            result = func(state, *args, **kwargs)
                    except HorovodInternalError:
                        raise
                    except HostsUpdatedInterrupt:
                        raise
                    except Exception as exc:
                        translated = binding.as_internal_error(exc)
                        if translated is None:
                            raise
                        raise translated from exc
                    events.emit("finish", commit_id=state.commit_id, duration_s=time.perf_counter() - started)
                    return result
                except HorovodInternalError as exc:
                    t0 = time.perf_counter()
                    if kind == "mpi":
                        logger.error("a collective failed under an MPI controller, where Horovod cannot re-form "
                                     "the job: ending it; a restarted job resumes from the newest checkpoint")
                        raise
                    if cut_links:
                        links.abort(str(exc))
                    count = state.note_rollback()
                    lost_s = state.seconds_since_commit
                    step_now = state.value_if_int("step")
                    if count > state.config.rollback_limit:
                        events.emit("rollback_limit", commit_id=state.commit_id, rollbacks=count,
                                    limit=state.config.rollback_limit, cause=str(exc)[:500])
                        raise RollbackLimitError(
                            f"{count} rollbacks in a row without a new commit (commit id {state.commit_id}) "
                            f"exceed rollback_limit ({state.config.rollback_limit}); last cause: {exc}") from exc
                    state.restore()
                    step_committed = state.value_if_int("step")
                    steps_back = (step_now - step_committed
                                  if step_now is not None and step_committed is not None else None)
                    pending = {"cause": "collective_failed", "detail": str(exc)[:500], "_t0": t0,
                               "commit_id": state.commit_id, "rollbacks_in_a_row": count,
                               "steps_rolled_back": steps_back, "lost_work_s": lost_s}
                    events.emit("rollback", **{k: v for k, v in pending.items() if k != "_t0"})
                except HostsUpdatedInterrupt as exc:
                    # The commit is agreed on every rank: rank 0 makes it durable now,
                    # whether or not it was due (a leaver may be rank 0 itself).
                    state.checkpoint_now()
                    if watchdog.leaving() or kind == "mpi":
                        _leave(state, kind, "sigterm" if watchdog.leaving() else "peer_sigterm")
                    pending = {"cause": "hosts_updated", "skip_sync": bool(exc.skip_sync),
                               "commit_id": state.commit_id, "steps_rolled_back": 0, "_t0": time.perf_counter()}
                    events.emit("resize", skip_sync=bool(exc.skip_sync), commit_id=state.commit_id)
                reset_started = time.perf_counter()
                links.before_init()
                binding.reset()
                links.after_init()
                state.on_reset()
                events.emit("reset", duration_s=time.perf_counter() - reset_started, cause=pending["cause"])
        finally:
            dog.stop()
            if previous_sigterm is not None:
                signal.signal(signal.SIGTERM, previous_sigterm)
            notification_manager.remove_listener(state)

    return wrapper
