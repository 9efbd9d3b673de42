"""Fast failure detection: abort dead collectives, kill hung workers, leave on SIGTERM.

Measured on this machine with plain Horovod: when a worker is SIGKILLed, its
ring neighbours see "connection reset" at once, but the other survivors wait
in their collective for Gloo's timeout (30 s): the neighbour that failed
keeps its sockets open until it re-initialises, which needs the driver's
barrier, which needs the waiting survivors. Three mechanisms break that:

1. **Abort on failure** (:class:`elastic_ext.runtime.connections.CollectiveConnections`):
   the rank that sees a collective fail shuts down (``shutdown(2)``, not
   close) its collective library's TCP connections, and only those (found by
   matching them with the other ranks' connections, see
   :mod:`elastic_ext.runtime.connections`). Its peers' pending reads then fail at once
   with "connection closed", they abort theirs, and the failure reaches every
   rank in milliseconds. Gloo still owns and closes the descriptors. Other
   connections of the process (an upload, a metrics logger) are untouched.
   Never under an MPI controller; always under Gloo (no case was found where
   waiting for Gloo's timeout instead was better).
2. **Guardian** (:class:`Watchdog` + ``python -m elastic_ext.runtime.guardian``): a
   small sidecar process per worker reads a heartbeat byte from a pipe every
   :data:`~elastic_ext.config.HEARTBEAT_PERIOD_S`. If none arrives for
   ``hang_timeout_s`` and the worker's main thread used the CPU for less
   than 2 % of that time (it is stopped by SIGSTOP, blocked, or
   deadlocked with the GIL held), it SIGKILLs the worker: a hang becomes a
   failure, which (1) spreads and Horovod's driver sees as an exit. A C call
   that holds the GIL while it computes keeps the heartbeat thread from
   running but keeps the CPU busy: the guardian waits.
3. **Stall check** (in the heartbeat thread): if for ``stall_timeout_s`` the
   training loop reports no progress (commit, ``record_step`` or
   :func:`progress`), its main thread is not inside a Horovod call (nor
   handling the exception of a failed one), no :func:`phase` is open, and
   the main thread neither moved nor ran on the CPU
   (:class:`~elastic_ext.runtime.activity.MainThread`), this worker is the
   one everybody waits for (a deadlock, a read that never returns), and it
   kills itself. Ranks waiting in a collective never fire. What a healthy
   worker does is never a stall: a long phase the user opened or forgot to
   open (an evaluation of an hour moves and computes), a compilation
   (computes), a slow step, and a suspension of the whole job (Slurm
   suspend, a cgroup freezer): the heartbeat thread sees its own tick
   arrive far later than its period and restarts the idle clock instead of
   counting the frozen time as idle.

And a worker told to go (SIGTERM) keeps training to its next commit, where
every rank learns of it through the commit's host-update allreduce; the job
then resizes without a rollback and the leaver exits (:mod:`elastic_ext.worker.sigterm`).
Under ``elastic-horovodrun`` that holds from the worker's start, also while the job re-forms.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, List, Optional

from elastic_ext import config as _config
from elastic_ext.config import ElasticConfig
from elastic_ext.liveness import LIVENESS, Liveness
from elastic_ext.runtime.activity import MainThread

logger = logging.getLogger(__name__)

# A heartbeat tick this many periods late (and at least JUMP_MIN_S) means the
# whole process was not running (suspended), not that training stalled.
JUMP_FACTOR = 3.0
JUMP_MIN_S = 2.0

def stall_verdict(idle_s: float, stall_timeout_s: float, phases: List[str], in_training: bool,
                  in_collective: bool) -> Optional[str]:
    """Why this worker is stuck, or None if it is not (a pure function, for tests).

    Args:
        idle_s: seconds since the main thread last made progress, waited in
            a collective, moved or ran on the CPU.
        stall_timeout_s: the limit (0: off).
        phases: open phases (none may be open for a stall).
        in_training: inside ``@elastic_ext.run``'s training function.
        in_collective: the main thread waits in a Horovod call.
    """
    if not in_training or in_collective or phases or not stall_timeout_s or idle_s <= stall_timeout_s:
        return None
    return (f"no training progress for {idle_s:.1f}s (stall_timeout_s={stall_timeout_s}) outside any collective "
            "and any phase, and the main thread neither moved nor ran on the CPU")


# ----------------------------------------------------------------- watchdog

# Where a main thread waits inside TensorFlow's executor: a ``@tf.function``
# step (or an eager op) whose Horovod allreduce runs as a graph node leaves no
# Python frame of Horovod on the stack, only these.
_TF_EXECUTOR_FRAMES = {("execute.py", "quick_execute"), ("context.py", "call_function")}
_TF_EAGER_DIR = f"{os.sep}tensorflow{os.sep}python{os.sep}eager{os.sep}"


def _main_thread_waits_or_fails() -> bool:
    """True if the main thread may be waiting on its peers or is on its way out
    of a failed step, so that it is not the worker everybody waits for.

    Failing: handling an exception (a collective failed and Keras or
    TensorFlow builds its traceback, seconds on a loaded machine); the
    exception reaches ``@elastic_ext.run``, which recovers, so killing the
    worker then only loses a healthy one. Waiting: :func:`main_thread_waits`.
    """
    return main_thread_handles_exception() or main_thread_waits()


def main_thread_handles_exception() -> bool:
    """True if the main thread is handling an exception (an ``except`` or ``finally`` block runs)."""
    handled = sys._current_exceptions().get(threading.main_thread().ident)
    # Python 3.11 gives an exc_info tuple ((None, None, None) when there is no
    # exception), later versions the exception or None.
    return (handled[1] if isinstance(handled, tuple) else handled) is not None


def main_thread_waits() -> bool:
    """True if the main thread is in a Python frame of Horovod, or inside TensorFlow's executor
    (graph code can hold a Horovod op): it may be waiting on its peers in a collective."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        filename = frame.f_code.co_filename
        if f"{os.sep}horovod{os.sep}" in filename:
            return True
        if _TF_EAGER_DIR in filename and (os.path.basename(filename), frame.f_code.co_name) in _TF_EXECUTOR_FRAMES:
            return True
        frame = frame.f_back
    return False


def _main_thread_stack(depth: int = 8) -> str:
    """The main thread's innermost ``depth`` frames, for the log of a stall (where it was stuck)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)[-depth:]) if frame is not None else "(no frame)"


class Watchdog:
    """The heartbeat thread, its guardian process and the stall check of one worker.

    Started by ``@elastic_ext.run`` for the duration of training; reads
    ``liveness`` (this process's :data:`LIVENESS` by default).
    """

    def __init__(self, config: ElasticConfig, on_stall: Optional[Callable[[float], None]] = None,
                 on_suspend: Optional[Callable[[float], None]] = None,
                 liveness: Optional[Liveness] = None,
                 on_guardian_lost: Optional[Callable[[Optional[int], str], None]] = None) -> None:
        self._config = config
        self._liveness = liveness or LIVENESS
        self._on_suspend = on_suspend
        self._on_guardian_lost = on_guardian_lost
        self._stop = threading.Event()
        self._guardian: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        self._on_stall = on_stall
        self._waited_at = float("-inf")  # when the main thread was last seen waiting in a collective
        self._main = MainThread()
        self._active_at = float("-inf")  # when the main thread was last seen moving or computing
        self.period_s = _config.HEARTBEAT_PERIOD_S  # read now: elastic_ext.testing.heartbeat_period changes it

    def start(self) -> None:
        if self._config.hang_timeout_s:
            self._guardian = subprocess.Popen(
                [sys.executable, "-m", "elastic_ext.runtime.guardian", "--pid", str(os.getpid()),
                 "--timeout-s", str(self._config.hang_timeout_s)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self._liveness.progress()
        self._thread = threading.Thread(target=self._beat, name="elastic_ext-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._guardian is not None:
            try:
                self._guardian.stdin.close()  # EOF: the guardian exits quietly
            except OSError:
                pass
            try:
                self._guardian.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._guardian.kill()

    def _guardian_lost(self, exc: BaseException) -> None:
        """The guardian cannot be reached: hang detection is off; ``on_guardian_lost`` learns it (an event)."""
        guardian, self._guardian = self._guardian, None
        if self._on_guardian_lost is None:
            return
        try:
            self._on_guardian_lost(guardian.poll(), f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - a side channel: the heartbeat and the stall check go on
            logger.exception("could not report the lost guardian")

    def stall_check(self, now: float, in_collective: bool, moved: bool = False) -> Optional[str]:
        """One tick of the stall check: why this worker is stuck, or None.

        Time spent waiting in a collective is not idle time: a rank that
        waited there for a slow peer (an evaluation phase elsewhere) leaves it
        with a fresh ``stall_timeout_s`` to reach its next progress. Counting
        from the last progress instead killed such a rank when a tick fell in
        the few milliseconds between the end of its wait and its next
        ``record_step``. Nor is time in which the main thread ``moved`` or
        computed.
        """
        live = self._liveness
        if in_collective:
            self._waited_at = now
        if moved:
            self._active_at = now
        idle = now - max(live.last_progress, self._waited_at, self._active_at)
        return stall_verdict(idle, self._config.stall_timeout_s, live.open_phases(), live.in_training,
                             in_collective)

    def _beat(self) -> None:
        live = self._liveness
        period = self.period_s
        tick = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            gap, tick = now - tick, now
            if gap > max(JUMP_MIN_S, JUMP_FACTOR * period):
                # This thread did not run for `gap` seconds: the process was
                # suspended (or the machine starved it), not stuck in a step.
                logger.warning("heartbeat thread did not run for %.1fs (its period: %ss): the process was "
                               "suspended; restarting the stall clock", gap, period)
                live.last_progress = max(live.last_progress, now)
                if self._on_suspend is not None:
                    self._on_suspend(gap)
            if self._guardian is not None:
                try:
                    self._guardian.stdin.write(b".")
                    self._guardian.stdin.flush()
                except (BrokenPipeError, ValueError, OSError) as exc:
                    logger.error("guardian process is gone; hang detection is off for this worker")
                    self._guardian_lost(exc)
            in_collective = live.in_training and _main_thread_waits_or_fails()
            now = time.monotonic()
            verdict = self.stall_check(now, in_collective, self._main.moved(now))
            if verdict is not None:
                idle = time.monotonic() - live.last_progress
                logger.critical("%s: this worker is stuck; killing it so the job can recover. Its main thread "
                                "is in:\n%s", verdict, _main_thread_stack())
                if self._on_stall is not None:
                    self._on_stall(idle)
                os.kill(os.getpid(), signal.SIGKILL)


