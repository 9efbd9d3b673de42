"""The ``run`` decorator: rollback on failure, resize without rollback, limits, events.

Control flow, per worker (the same on every rank)::

    sync ──> call func ──> returns ──> finish
      ^          │
      │          ├─ HorovodInternalError (a collective failed):
      │          │     restore last commit, count the rollback, reset Horovod
      │          └─ HostsUpdatedInterrupt (hosts added or removed, raised by commit):
      │                no rollback; reset Horovod
      └──────────┘  (after a removal-only resize, verify ids instead of a full sync)

Differences from ``hvd.elastic.run``: one decorator for both frameworks;
TensorFlow op errors that come from a Horovod collective become
``HorovodInternalError`` and every other error propagates (Horovod's TF
wrapper returns None for them, so a worker could exit 0 on an error);
consecutive rollbacks without a new commit are limited
(``RollbackLimitError``); every reset writes a structured event; and the
watchdog (:mod:`elastic_ext.watchdog`) makes failures known to every rank
at once, turns hung workers into failures, and lets a worker told to leave
(SIGTERM) go at its next commit without a rollback.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from typing import Any, Callable, Optional, TypeVar

from elastic_ext import watchdog
from elastic_ext.errors import RollbackLimitError

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


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
        notification_manager.init()
        notification_manager.register_listener(state)
        dog = watchdog.Watchdog(config, on_stall=lambda idle: events.emit("stall", idle_s=idle))
        dog.start()
        previous_sigterm = watchdog.install_sigterm(config)
        skip_sync = False
        pending: Optional[dict] = None
        started = time.perf_counter()
        try:
            while True:
                try:
                    if skip_sync:
                        state.verify()
                    else:
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
                    if config.abort_connections:
                        watchdog.abort_collective_connections(str(exc))
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
                    skip_sync = False
                except HostsUpdatedInterrupt as exc:
                    if watchdog.leaving():
                        events.emit("leave", commit_id=state.commit_id, cause="sigterm")
                        logging.shutdown()
                        os._exit(watchdog.LEAVE_EXIT_CODE)
                    pending = {"cause": "hosts_updated", "skip_sync": bool(exc.skip_sync),
                               "commit_id": state.commit_id, "steps_rolled_back": 0, "_t0": time.perf_counter()}
                    events.emit("resize", skip_sync=bool(exc.skip_sync), commit_id=state.commit_id)
                    skip_sync = exc.skip_sync
                reset_started = time.perf_counter()
                binding.reset()
                state.on_reset()
                events.emit("reset", duration_s=time.perf_counter() - reset_started, cause=pending["cause"])
        finally:
            dog.stop()
            if previous_sigterm is not None:
                signal.signal(signal.SIGTERM, previous_sigterm)
            notification_manager.remove_listener(state)

    return wrapper
