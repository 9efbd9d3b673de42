"""The ``run`` decorator: rollback on failure, resize without rollback, limits, events.

Control flow, per worker (the same on every rank)::

    sync ──> call func ──> returns ──> finish
      ^          │
      │          ├─ HorovodInternalError (a collective failed):
      │          │     restore last commit, count the rollback, reset Horovod
      │          ├─ HostsUpdatedInterrupt (hosts added or removed, raised by commit):
      │          │     no rollback; reset Horovod
      │          └─ NumericFaultError (state.guard_step judged a step bad, on every rank):
      │                restore last commit, skip the step's samples; no reset
      └──────────┘  (sync sends no state when every rank already holds the agreed commit)

Differences from ``hvd.elastic.run``: one decorator for both frameworks;
TensorFlow op errors that come from a Horovod collective become
``HorovodInternalError`` and every other error propagates (Horovod's TF
wrapper returns None for them, so a worker could exit 0 on an error);
consecutive rollbacks without a new commit are limited
(``RollbackLimitError``); every reset writes a structured event; and the
watchdog (:mod:`elastic_ext.runtime.watchdog`) makes failures known to every rank
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

The step counter: a rollback event says how many steps were lost
(``steps_rolled_back``), read from the tracked integer named by
``run(counter=...)`` (``"step"`` by default) before and after the restore;
``None`` when the State tracks no such integer.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, TypeVar

import numpy as np

from elastic_ext.config import (ENV_CHECKPOINT_DIR, ENV_HOROVOD_GLOO_TIMEOUT, ENV_RESTART_IN_PLACE, ElasticConfig,
                                elastic_horovodrun)
from elastic_ext.runtime.connections import CollectiveConnections
from elastic_ext.errors import ConfigError, NumericFaultError, RollbackLimitError
from elastic_ext.launch import keeper, prestart
from elastic_ext.policies.numeric_rollback import NumericRecovery
from elastic_ext.events import (FINISH, LEAVE, RECOVERED, RESET, RESIZE, RESTARTED_IN_PLACE, ROLLBACK, ROLLBACK_LIMIT,
                                STALL, SUSPENDED)
from elastic_ext.runtime.watchdog import LEAVE_EXIT_CODE, LIVENESS, Liveness, Watchdog, install_sigterm, restore_sigterm

if TYPE_CHECKING:
    from elastic_ext.state.state import State

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_HOROVOD_MODULES = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow"}
# Event fields quote an exception's message up to this many characters (a Gloo
# error can carry a whole stack of peers; events are one JSON line each).
ERROR_DETAIL_CHARS = 500


def error_detail(exc: BaseException) -> str:
    """An exception's message as an event field: ``str(exc)`` cut at :data:`ERROR_DETAIL_CHARS`."""
    return str(exc)[:ERROR_DETAIL_CHARS]


@dataclasses.dataclass
class RollbackRecord:
    """Consecutive rollbacks without a new commit, agreed by every rank (``sync`` broadcasts it).

    ``run`` counts each rollback with :meth:`note` and stops at
    ``config.rollback_limit`` (:class:`RollbackLimitError`).
    """

    in_a_row: int = 0     # rollbacks since the last new commit
    commit_id: int = -1   # the commit they all went back to

    def note(self, commit_id: int) -> int:
        """Counts a rollback to ``commit_id``; returns how many happened in a row without a new commit."""
        if commit_id == self.commit_id:
            self.in_a_row += 1
        else:
            self.in_a_row, self.commit_id = 1, commit_id
        return self.in_a_row

    def to_json(self) -> Dict[str, int]:
        return {"in_a_row": self.in_a_row, "commit_id": self.commit_id}

    def load_json(self, data: Dict[str, int]) -> None:
        self.in_a_row, self.commit_id = int(data["in_a_row"]), int(data["commit_id"])


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


def _leave(state: "State", liveness: Liveness, kind: str, cause: str) -> None:
    """Makes the agreed commit durable (rank 0), then exits this process. Never returns."""
    remaining = liveness.leave_time_left()
    if remaining is None:
        remaining = state.config.term_grace_s
    durable = state.wait_for_checkpoint(max(0.0, remaining - 0.5))
    if kind == "mpi":
        # Every rank waits for rank 0's write: mpirun kills the others as soon as one exits.
        state.binding.allreduce_max(np.zeros(1, dtype=np.int64), "elastic_ext.leave")
    state.events.emit(LEAVE, commit_id=state.commit_id, cause=cause, durable_commit_id=durable)
    if kind == "gloo":
        _shut_down_with_the_others(state.binding, max(1.0, min(10.0, (liveness.leave_time_left() or 0.0))))
    logging.shutdown()
    # 143 (128 + SIGTERM), not 0: Horovod's driver then shrinks the job rather than ending it.
    os._exit(LEAVE_EXIT_CODE)


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


# The value first_rendezvous_timeout() set at import, which a config given in code may replace.
_TIMEOUT_SET_AT_IMPORT: Optional[str] = None


def _timeout_value(seconds: float) -> str:
    return str(max(1, int(round(seconds))))


def rendezvous_timeout(config: Any, environ: Any = None) -> Optional[str]:
    """Sets Horovod's Gloo timeout for the resets to come (see ``ElasticConfig.rendezvous_timeout_s``).

    Horovod reads ``HOROVOD_GLOO_TIMEOUT_SECONDS`` at every ``hvd.init()``,
    so the survivors' re-initialisation after a failure waits this long for
    newcomers. A value the user set is left alone. Returns the value in force.
    """
    env = os.environ if environ is None else environ
    ours = ENV_HOROVOD_GLOO_TIMEOUT not in env or env[ENV_HOROVOD_GLOO_TIMEOUT] == _TIMEOUT_SET_AT_IMPORT
    if config.rendezvous_timeout_s and ours:
        env[ENV_HOROVOD_GLOO_TIMEOUT] = _timeout_value(config.rendezvous_timeout_s)
    return env.get(ENV_HOROVOD_GLOO_TIMEOUT)


def first_rendezvous_timeout(environ: Any = None) -> Optional[str]:
    """At ``import elastic_ext`` in a worker of an elastic ``horovodrun``: the same Gloo timeout for its first
    ``hvd.init()``, from the ``ELASTIC_EXT_*`` configuration, unless the user set one.

    A newcomer's first ``hvd.init()`` runs before any elastic_ext code: with
    Horovod's 30 s it gave up on a peer (another newcomer still importing, a
    survivor still restoring) that the survivors, under
    :func:`rendezvous_timeout`, still waited for. Returns the value set, or None.
    """
    global _TIMEOUT_SET_AT_IMPORT
    env = os.environ if environ is None else environ
    if not elastic_horovodrun(env) or ENV_HOROVOD_GLOO_TIMEOUT in env:
        return None
    try:
        seconds = ElasticConfig.from_env(env).rendezvous_timeout_s
    except ConfigError:
        return None  # the State's own config raises it, with its message
    if not seconds:
        return None
    env[ENV_HOROVOD_GLOO_TIMEOUT] = _TIMEOUT_SET_AT_IMPORT = _timeout_value(seconds)
    return _TIMEOUT_SET_AT_IMPORT


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def run(func: Optional[F] = None, *, counter: Optional[str] = "step") -> Any:
    """Decorates a training function ``func(state, *args, **kwargs)`` for elastic execution.

    The function must not start with a collective of its own: the first
    thing that runs is ``state.sync()``. Use it bare (``@elastic_ext.run``)
    or with options (``@elastic_ext.run(counter="iteration")``).

    Args:
        counter: name of the tracked integer that counts steps, for the
            ``steps_rolled_back`` field of rollback events (None: not reported).

    Raises:
        RollbackLimitError: more consecutive rollbacks than
            ``state.config.rollback_limit`` without a commit in between.
        StateDivergenceError: ranks disagree on the committed state.
    """
    if func is None:
        return functools.partial(run, counter=counter)

    def steps_now(state: "State") -> Optional[int]:
        return None if counter is None else _int_or_none(state.objects.get(counter))

    @functools.wraps(func)
    def wrapper(state: "State", *args: Any, **kwargs: Any) -> Any:
        from horovod.common.elastic import notification_manager
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

        binding, events, config, liveness = state.binding, state.events, state.config, LIVENESS
        kind = controller(binding)
        if kind == "mpi":
            _announce_mpi(config)
        else:
            rendezvous_timeout(config)
        if keeper.restarts() and config.checkpoint_dir is None:
            raise ConfigError(
                f"this worker was restarted in place ({ENV_RESTART_IN_PLACE}=1) and holds no commit; without a "
                f"checkpoint_dir ({ENV_CHECKPOINT_DIR}) a job whose every worker was restarted would train again "
                "from scratch: set one, or turn restarts in place off")
        if keeper.restarts():
            events.emit(RESTARTED_IN_PLACE, restarts=keeper.restarts())
        notification_manager.init()
        notification_manager.register_listener(state)
        dog = Watchdog(config, on_stall=lambda idle: events.emit(STALL, idle_s=idle),
                       on_suspend=lambda gap: events.emit(SUSPENDED, gap_s=gap), liveness=liveness)
        dog.start()
        previous_sigterm = install_sigterm(config, liveness)
        if kind == "gloo":
            prestart.join(binding)  # a newcomer started early joins now, its model built
        links = CollectiveConnections()
        cut_links = config.abort_connections and kind == "gloo"
        pending: Optional[Recovery] = None
        numeric = NumericRecovery()
        started = time.perf_counter()
        try:
            while True:
                try:
                    if cut_links:
                        links.learn_from_peers(binding)
                    state.sync()
                    numeric.reapply(state)  # sync loads the commit, which may not hold a numeric skip yet
                    if pending is not None:
                        events.emit(RECOVERED, **pending.event(binding.size(), state.generation))
                        pending = None
                    try:
                        with liveness.training():
                            result = func(state, *args, **kwargs)
                    except (HorovodInternalError, HostsUpdatedInterrupt, NumericFaultError):
                        raise
                    except Exception as exc:
                        translated = binding.as_internal_error(exc)
                        if translated is None:
                            raise
                        raise translated from exc
                    events.emit(FINISH, commit_id=state.commit_id, duration_s=time.perf_counter() - started)
                    return result
                except NumericFaultError as exc:
                    # Every rank raised it together and no collective failed: no Horovod reset.
                    numeric.roll_back(state, exc, steps_now(state), steps_now)
                    continue
                except HorovodInternalError as exc:
                    t0 = time.perf_counter()
                    if kind == "mpi":
                        logger.error("a collective failed under an MPI controller, where Horovod cannot re-form "
                                     "the job: ending it; a restarted job resumes from the newest checkpoint")
                        raise
                    if cut_links:
                        links.abort(str(exc))
                    count = state.rollbacks.note(state.commit_id)
                    lost_s = state.seconds_since_commit
                    step_now = steps_now(state)
                    if count > config.rollback_limit:
                        events.emit(ROLLBACK_LIMIT, commit_id=state.commit_id, rollbacks=count,
                                    limit=config.rollback_limit, cause=error_detail(exc))
                        raise RollbackLimitError(
                            f"{count} rollbacks in a row without a new commit (commit id {state.commit_id}) "
                            f"exceed rollback_limit ({config.rollback_limit}); last cause: {exc}") from exc
                    if state.committed:
                        state.restore()
                    # else: a fresh process failed before its first sync (in the collective that
                    # learns the connections): nothing to roll back; the next sync brings the state.
                    numeric.reapply(state)  # skips of numeric rollbacks no commit holds yet
                    step_committed = steps_now(state)
                    steps_back = (step_now - step_committed
                                  if step_now is not None and step_committed is not None else None)
                    pending = Recovery("collective_failed", state.commit_id, t0, {
                        "detail": error_detail(exc), "rollbacks_in_a_row": count,
                        "steps_rolled_back": steps_back, "lost_work_s": lost_s})
                    events.emit(ROLLBACK, cause=pending.cause, **pending.fields, commit_id=pending.commit_id)
                except HostsUpdatedInterrupt as exc:
                    # The commit is agreed on every rank: rank 0 makes it durable now,
                    # whether or not it was due (a leaver may be rank 0 itself).
                    state.checkpoint_now()
                    removed = state._removed_at_resize()
                    if liveness.leaving() or kind == "mpi" or removed:
                        # An early start's answer can say that this slot is not in the next world:
                        # leave now, as Horovod would end it at its next hvd.init().
                        cause = ("removed" if removed else
                                 liveness.leave_cause if liveness.leaving() else "peer_sigterm")
                        _leave(state, liveness, kind, cause)
                    pending = Recovery("hosts_updated", state.commit_id, time.perf_counter(),
                                       {"skip_sync": bool(exc.skip_sync), "steps_rolled_back": 0})
                    events.emit(RESIZE, skip_sync=bool(exc.skip_sync), commit_id=state.commit_id)
                reset_started = time.perf_counter()
                links.before_init()
                binding.reset()
                links.after_init()
                state.on_reset()
                events.emit(RESET, duration_s=time.perf_counter() - reset_started, cause=pending.cause)
        finally:
            dog.stop()
            restore_sigterm(previous_sigterm)
            notification_manager.remove_listener(state)

    return wrapper
