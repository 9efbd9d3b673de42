"""The ``run`` decorator: rollback on failure, resize without rollback, limits, events.

Control flow, per worker (the same on every rank)::

    sync ──> call func ──> returns ──> finish
      ^          │
      │          ├─ HorovodInternalError (a collective failed):
      │          │     restore last commit, count the rollback, reset Horovod
      │          ├─ HostsUpdatedInterrupt (hosts added or removed, raised by commit):
      │          │     no rollback; reset Horovod
      │          ├─ NumericFaultError (state.guard_step judged a step bad, on every rank):
      │          │     restore last commit, skip the step's samples; no reset
      │          └─ ReplicaMismatchError (the replica check found ranks that differ, on every rank):
      │                back to the last commit all agreed on, train again to the one that differed
      │                (no reset, no sync: the replay is what a failure-free run did)
      └──────────┘  (sync sends no state when every rank already holds the agreed commit)

Differences from ``hvd.elastic.run``: one decorator for both frameworks;
TensorFlow op errors that come from a Horovod collective become
``HorovodInternalError`` and every other error propagates (Horovod's TF
wrapper returns None for them, so a worker could exit 0 on an error);
consecutive rollbacks without a new commit are limited
(``RollbackLimitError``); every reset writes a structured event; and the
watchdog (:mod:`elastic_ext.runtime.watchdog`) makes failures known to every rank
at once, turns hung workers into failures, and lets a worker told to leave
(SIGTERM) go at its next commit without a rollback. One handler per kind of
interruption: :mod:`elastic_ext.runtime.recovery`.

Durability on the way out: at every resize, and above all when a worker
leaves (SIGTERM: preemption, ``scancel``, the driver ending the job), rank 0
starts writing the agreed commit as a durable checkpoint even if it is not
due under ``checkpoint_every``; a leaving rank 0 waits for that write (at most
what is left of ``term_grace_s``) before it exits. When the training
function returns, rank 0 writes the last commit too, and waits for it.

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

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

from elastic_ext.config import ENV_CHECKPOINT_DIR, ENV_RESTART_IN_PLACE, launched
from elastic_ext.errors import ConfigError, NumericFaultError, ReplicaMismatchError
from elastic_ext.events import FINISH, GUARDIAN_LOST, RESTARTED_IN_PLACE, STALL, SUSPENDED
from elastic_ext.worker import keeper, newcomer, prestart, round_watch
from elastic_ext.worker.gloo_timeout import reset_timeout
from elastic_ext.runtime.recovery import Recoverer, controller
from elastic_ext.worker.sigterm import install_sigterm, restore_sigterm
from elastic_ext.runtime.watchdog import Watchdog
from elastic_ext.liveness import LIVENESS

if TYPE_CHECKING:
    from elastic_ext.runtime.assembly import State

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def _announce_mpi(config: Any) -> None:
    durable = (f"durable checkpoints in {config.checkpoint_dir} let a restarted (requeued) job resume at any "
               f"world size" if config.checkpoint_dir else
               "checkpoint_dir is not set, so a restarted job starts from scratch")
    logger.warning("elastic_ext under an MPI controller: in-job recovery, resizing, host updates and the "
                   "connection abort are off (MPI cannot re-form a job); a failed worker ends the job, SIGTERM "
                   "stops every rank at the next commit after rank 0 made it durable; %s", durable)


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@contextlib.contextmanager
def _elastic_session(state: "State", kind: str) -> Iterator[None]:
    """What surrounds the training loop on this worker: Horovod's host-update listener, the watchdog,
    SIGTERM as "leave", the Gloo timeout of the resets, the join of a newcomer started early."""
    from horovod.common.elastic import notification_manager

    binding, events, config = state.binding, state.events, state.config
    if kind == "mpi":
        _announce_mpi(config)
    if keeper.restarts() and config.checkpoint_dir is None:
        raise ConfigError(
            f"this worker was restarted in place ({ENV_RESTART_IN_PLACE}=1) and holds no commit; without a "
            f"checkpoint_dir ({ENV_CHECKPOINT_DIR}) a job whose every worker was restarted would train again "
            "from scratch: set one, or turn restarts in place off")
    if keeper.restarts():
        events.emit(RESTARTED_IN_PLACE, restarts=keeper.restarts())
    if launched():  # the newcomers' side of an early start needs the launcher's entry module
        state.set_early_start(prestart.early_start_factory(binding, config.rendezvous_timeout_s or 120.0),
                              round_watch.capacity_left_out)
    notification_manager.init()
    notification_manager.register_listener(state)
    dog = Watchdog(config, on_stall=lambda idle: events.emit(STALL, idle_s=idle),
                   on_suspend=lambda gap: events.emit(SUSPENDED, gap_s=gap), liveness=LIVENESS,
                   on_guardian_lost=lambda code, error: events.emit(GUARDIAN_LOST, exit_code=code, error=error))
    dog.start()
    previous_sigterm = install_sigterm(config, LIVENESS)
    try:
        if kind == "gloo":
            reset_timeout(config, binding.size())
            newcomer.join(binding)  # a newcomer started early joins now, its model built
        yield
    finally:
        dog.stop()
        restore_sigterm(previous_sigterm)
        notification_manager.remove_listener(state)


def run(func: Optional[F] = None, *, counter: Optional[str] = "step") -> Any:
    """Decorates a training function ``func(state, *args, **kwargs)`` for elastic execution.

    The function must not start with a collective of its own: the first
    thing that runs is ``state.sync()``. Use it bare (``@elastic_ext.run``)
    or with options (``@elastic_ext.run(counter="iteration")``).

    Its end must follow from the State (an epoch counter, a step count), as
    a job resumed from a checkpoint needs: when it returns while newcomers
    started early are on their way, every rank commits, takes them in, and
    calls it again from that commit, where it must return at once (every
    rank runs the same collectives, newcomers included, and returns its
    result). An end decided from a local variable would train on there.

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
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

        kind = controller(state.binding)
        with _elastic_session(state, kind):
            started = time.perf_counter()
            recover = Recoverer(state, LIVENESS, kind, steps_now)
            try:
                replaying = False
                while True:
                    try:
                        if not replaying:  # a replay starts from a commit every rank holds alike
                            recover.sync()
                        replaying = False
                        result = _train(state, func, args, kwargs)
                        recover.finish_with_newcomers()  # the newcomers of an early start under way end with the job
                        state.checkpoint_now()  # the end of training is on disk, whatever the cadence
                        state.wait_for_checkpoint()
                        state.events.emit(FINISH, commit_id=state.commit_id,
                                          duration_s=time.perf_counter() - started)
                        return result
                    except NumericFaultError as exc:
                        recover.numeric_fault(exc)
                        continue
                    except ReplicaMismatchError as exc:
                        recover.replica_mismatch(exc)
                        replaying = True
                        continue
                    except HorovodInternalError as exc:
                        recover.collective_failed(exc)
                    except HostsUpdatedInterrupt as exc:
                        recover.hosts_updated(bool(exc.skip_sync))
                    recover.reset()
            finally:
                recover.close()

    return wrapper


def _train(state: "State", func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Calls the training function; a framework error that came from a Horovod collective becomes
    ``HorovodInternalError``, every other error propagates."""
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    try:
        with LIVENESS.training():
            return func(state, *args, **kwargs)
    except (HorovodInternalError, HostsUpdatedInterrupt, NumericFaultError, ReplicaMismatchError):
        raise
    except Exception as exc:
        translated = state.binding.as_internal_error(exc)
        if translated is None:
            raise
        raise translated from exc
