"""A collective that waits on connections already closed: end the worker instead of waiting for Gloo's timeout.

When a connection of Gloo (the version Horovod 0.28.1 builds) fails, Gloo
wakes the operations pending on it with an error, except a send that is
already in the connection's transmit queue (a ring segment larger than the
socket buffer, or written while the peer died): its wait ends only at
Gloo's timeout, 120 s under elastic_ext (``rendezvous_timeout_s``). Seen in
a three-worker Keras job: after a SIGKILL, one survivor re-formed at once and
the other waited 120 s ("Timed out waiting 120000ms for send operation to
complete"), every one of its collective connections long closed, and the
job with it, since the next round needs every survivor. Cutting the links
(:mod:`elastic_ext.runtime.connections`) does not wake that send either.

While this worker trains in a round, :class:`ClosedLinksWatch` looks every
:data:`POLL_S`: when the main thread waits in a collective (not handling an
exception) and none of the round's collective connections
(:meth:`~elastic_ext.runtime.connections.CollectiveConnections.all_closed`)
is still established, for :data:`STUCK_S` in a row, the collective cannot
complete. Under ``elastic-horovodrun`` the worker then writes a
``links_closed`` event and ends itself at once (:func:`end_worker`, exit status
:data:`~elastic_ext.exit_codes.PEERS_FAILED`): the
launcher's driver sees one failed worker and forms the next round from the
others, which hold the same commit. That status tells the driver that the
worker's peers failed, not its host: a host whose other workers were lost in
the same round (one SIGKILLed, its host mate stuck on the dead worker's
connection) is not taken for a lost machine and blacklisted
(:mod:`elastic_ext.launch.driver`). Under plain ``horovodrun`` a
worker's death costs its whole host (Horovod blacklists the host of every
failed worker and ends its other workers), so there the worker only says
what it waits for (the event with ``killed`` false, and an error in its
log) and waits for Gloo's timeout.
:data:`STUCK_S` is far above the time a failed collective takes to reach
the training loop as an exception (milliseconds, seconds on a loaded
machine), and far below Gloo's timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

from elastic_ext.exit_codes import PEERS_FAILED
from elastic_ext.runtime.watchdog import main_thread_handles_exception, main_thread_waits

logger = logging.getLogger(__name__)

POLL_S = 1.0
STUCK_S = 10.0


def end_worker() -> None:
    """Ends this process now with :data:`~elastic_ext.exit_codes.PEERS_FAILED`, from any thread (no cleanup runs:
    the main thread is stuck in the collective library). Never returns."""
    os._exit(PEERS_FAILED)


class ClosedLinksWatch:
    """The thread of the module docstring, for one worker.

    Args:
        links: the worker's ``CollectiveConnections``.
        liveness: the worker's liveness record (``in_training``).
        on_stuck: called with the seconds waited and whether the worker is killed, before it dies
            (writes the event).
        kill_worker: kill the worker (under ``elastic-horovodrun``) or only say it waits.
        waits: whether the main thread waits in a collective and handles no exception (replaced in tests).
        kill: ends the process (:func:`end_worker`; replaced in tests).
        clock: monotonic seconds.
    """

    def __init__(self, links: Any, liveness: Any, on_stuck: Callable[[float, bool], None], kill_worker: bool,
                 waits: Callable[[], bool] = lambda: main_thread_waits() and not main_thread_handles_exception(),
                 kill: Callable[[], Any] = end_worker,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._links, self._liveness, self._on_stuck, self._kill_worker = links, liveness, on_stuck, kill_worker
        self._told = False  # this wait was reported (a worker that is not killed says it once)
        self._waits, self._kill, self._clock = waits, kill, clock
        self._since: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "ClosedLinksWatch":
        self._thread = threading.Thread(target=self._run, name="elastic_ext-closed-links", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=POLL_S * 3)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.check()

    def check(self) -> None:
        """One look (the cheap conditions first: the connection list is read only while the main thread waits)."""
        now = self._clock()
        if not (self._liveness.in_training and self._waits() and self._links.all_closed()):
            self._since, self._told = None, False
            return
        if self._since is None:
            self._since = now
            return
        waited = now - self._since
        if waited < STUCK_S or self._told:
            return
        self._told = True
        if not self._kill_worker:
            logger.error("this worker has waited %.1fs in a collective whose every connection (%d) is closed: its "
                         "peers failed and Gloo will end the wait only at its timeout (HOROVOD_GLOO_TIMEOUT_SECONDS); "
                         "under plain horovodrun ending this worker would cost its whole host. elastic-horovodrun "
                         "ends it instead", waited, len(self._links.known))
            self._on_stuck(waited, False)
            return
        logger.critical("this worker has waited %.1fs in a collective whose every connection (%d) is closed: its "
                        "peers failed and the collective cannot complete (Gloo would wait for its timeout); "
                        "ending this worker (exit status %d: its peers failed, not its host) so the job re-forms "
                        "without it now", waited, len(self._links.known), PEERS_FAILED)
        self._on_stuck(waited, True)
        self._kill()
