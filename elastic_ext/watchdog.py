"""Fast failure detection: abort dead collectives, kill hung workers, leave on SIGTERM.

Measured on this machine with plain Horovod: when a worker is SIGKILLed, its
ring neighbours see "connection reset" at once, but the other survivors wait
in their collective for Gloo's timeout (30 s): the neighbour that failed
keeps its sockets open until it re-initialises, which needs the driver's
barrier, which needs the waiting survivors. Three mechanisms break that:

1. **Abort on failure** (:func:`abort_collective_connections`): the rank that
   sees a collective fail shuts down (``shutdown(2)``, not close) every
   established TCP connection of its process except those to horovodrun's
   rendezvous server. Its peers' pending reads then fail at once with
   "connection closed", they abort theirs, and the failure reaches every rank
   in milliseconds. Gloo still owns and closes the descriptors. Failure mode:
   other TCP connections the training process holds (rare: data loaders use
   pipes and shared memory) are cut too; turn it off with
   ``abort_connections=False``.
2. **Guardian** (:class:`Watchdog` + ``python -m elastic_ext.guardian``): a
   small sidecar process per worker reads a heartbeat byte from a pipe every
   ``heartbeat_period_s``. If none arrives for ``hang_timeout_s`` (the worker
   is SIGSTOPped, or frozen in native code holding the GIL) it SIGKILLs the
   worker: a hang becomes a failure, which (1) spreads and Horovod's driver
   sees as an exit. Failure mode: a machine so overloaded that a thread does
   not run for ``hang_timeout_s`` is declared hung; keep it well above the
   longest scheduling stall you expect.
3. **Stall check** (in the heartbeat thread): if the training loop reports no
   progress (commit or ``record_step``) for ``stall_timeout_s`` while its main
   thread is *not* inside a Horovod call, this worker is the one everybody
   waits for (a step that never ends), and it kills itself. Ranks waiting in
   a collective never fire, so a slow but healthy worker is never declared
   dead unless one of its steps exceeds ``stall_timeout_s``.

And a worker told to go (SIGTERM) keeps training to its next commit, where
every rank learns of it through the commit's host-update allreduce; the job
then resizes without a rollback and the leaver exits (:func:`install_sigterm`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from elastic_ext.config import ElasticConfig, horovod_rendezvous

logger = logging.getLogger(__name__)

LEAVE_EXIT_CODE = 143  # 128 + SIGTERM: non-zero, so Horovod's driver shrinks instead of ending the job

_last_progress = time.monotonic()
_leaving = threading.Event()
_in_training = threading.Event()


def progress() -> None:
    """Marks that training moved forward (called by commit and ``record_step``)."""
    global _last_progress
    _last_progress = time.monotonic()


def leaving() -> bool:
    """True once this worker was asked to leave (SIGTERM) and has not left yet."""
    return _leaving.is_set()


# ------------------------------------------------------------------ aborting

def abort_collective_connections(reason: str) -> int:
    """Shuts down this process's TCP connections (not the rendezvous ones).

    Returns how many were shut down. Never raises: detection must not turn
    into a second failure.
    """
    try:
        import psutil
        rendezvous = horovod_rendezvous()
        skip_ports = {rendezvous[1]} if rendezvous else set()
        count = 0
        process = psutil.Process()
        # psutil >= 6 calls it net_connections; older releases only have connections.
        list_connections = getattr(process, "net_connections", None) or process.connections
        for conn in list_connections(kind="tcp"):
            if conn.status != psutil.CONN_ESTABLISHED or conn.fd < 0 or not conn.raddr:
                continue
            if conn.raddr.port in skip_ports:
                continue
            try:
                dup = socket.socket(fileno=os.dup(conn.fd))
            except OSError:
                continue
            try:
                dup.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass
            finally:
                dup.close()
        logger.warning("collective failed (%s): shut down %d connection(s) so that every peer fails now",
                       reason[:200], count)
        return count
    except Exception:  # noqa: BLE001 - best effort; the failure is being handled already
        logger.exception("could not abort collective connections")
        return 0


# ----------------------------------------------------------------- watchdog

def _main_thread_in_horovod() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if f"{os.sep}horovod{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Watchdog:
    """The heartbeat thread, its guardian process and the stall check of one worker.

    Started by ``@elastic_ext.run`` for the duration of training.
    """

    def __init__(self, config: ElasticConfig, on_stall=None) -> None:
        self._config = config
        self._stop = threading.Event()
        self._guardian: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        self._on_stall = on_stall

    def start(self) -> None:
        if self._config.hang_timeout_s:
            self._guardian = subprocess.Popen(
                [sys.executable, "-m", "elastic_ext.guardian", "--pid", str(os.getpid()),
                 "--timeout-s", str(self._config.hang_timeout_s)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        progress()
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

    def _beat(self) -> None:
        period = self._config.heartbeat_period_s
        stall = self._config.stall_timeout_s
        while not self._stop.wait(period):
            if self._guardian is not None:
                try:
                    self._guardian.stdin.write(b".")
                    self._guardian.stdin.flush()
                except (BrokenPipeError, ValueError, OSError):
                    logger.error("guardian process is gone; hang detection is off for this worker")
                    self._guardian = None
            idle = time.monotonic() - _last_progress
            if stall and idle > stall and _in_training.is_set() and not _main_thread_in_horovod():
                logger.critical("no training progress for %.1fs (stall_timeout_s=%s) outside any collective: "
                                "this worker is stuck; killing it so the job can recover", idle, stall)
                if self._on_stall is not None:
                    self._on_stall(idle)
                os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------ SIGTERM

def install_sigterm(config: ElasticConfig):
    """Makes SIGTERM mean "leave at the next commit" while training runs.

    Outside training (e.g. while Horovod re-initialises, when the driver
    itself terminates workers of a removed host) SIGTERM keeps its default
    meaning. Only possible from the main thread; elsewhere this is a no-op.
    Returns the previous handler (to restore), or None.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        if not _in_training.is_set() or _leaving.is_set():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        _leaving.set()
        logger.warning("SIGTERM: leaving at the next commit (at most %.0fs from now)", config.term_grace_s)

        def give_up():
            logger.error("no commit within term_grace_s (%.0fs) after SIGTERM: exiting now", config.term_grace_s)
            os._exit(LEAVE_EXIT_CODE)

        timer = threading.Timer(config.term_grace_s, give_up)
        timer.daemon = True
        timer.start()

    return signal.signal(signal.SIGTERM, handler)


class training:
    """Context marking the span in which SIGTERM and the stall check apply."""

    def __enter__(self) -> "training":
        progress()
        _in_training.set()
        return self

    def __exit__(self, *exc) -> None:
        _in_training.clear()
