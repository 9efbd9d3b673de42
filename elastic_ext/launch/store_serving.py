"""How the driver's rendezvous server takes its connections: a listen queue sized for a job, threads reused.

Horovod's rendezvous server is a ``socketserver.ThreadingMixIn`` HTTP
server with socketserver's defaults, which do not hold a thousand workers
(``bench/README.md``, "The control plane at scale"):

1. **A listen queue of 5.** Every worker polls the store once a second
   (its driver watch) and a reset sends a burst of every worker's Gloo
   rendezvous: connections beyond the queue are dropped by the kernel and
   their clients retry the handshake 1, 3 and 7 s later, so an answer the
   driver would give in milliseconds arrives seconds late. :func:`changes`
   make the queue :data:`BACKLOG` (the kernel caps it at
   ``net.core.somaxconn``) for every server created afterwards in this
   process. A full queue is also what the driver watch of a worker takes
   for a partition (:mod:`elastic_ext.runtime.driver_watch`): a handshake
   not completed.
2. **A new thread per request**, started on the server's accept loop
   (``Thread.start`` waits until the thread runs), about 500 requests a
   second at most. Here a request goes to a thread that finished its
   previous one and waits for the next, and a new thread starts only when
   none waits. Requests may block (Horovod's elastic rank requests wait for
   the driver's round), so the number of threads is
   not bounded, as before: a fixed pool could hold every thread on such
   requests while those that would end their wait sit in the queue. A thread idle for
   :data:`IDLE_S` ends.

Who may connect and what a request may do is unchanged
(:mod:`elastic_ext.launch.store_guard`: ``verify_request`` runs on the
accept loop before a request is handed to a thread).
"""

from __future__ import annotations

import queue
import socket
import threading
from typing import Any, List, Tuple

from elastic_ext.control.horovod_seam import Change

BACKLOG = max(4096, socket.SOMAXCONN)  # a burst of every worker's requests of a thousand-worker job
IDLE_S = 30.0  # a reused thread waits this long for another request, then ends



class ReusedThreads:
    """The threads of one server: each serves requests one after another; a new one only when none is idle.

    Invariant (under ``_lock``): ``_idle`` = threads waiting on the queue minus requests queued, never
    negative: every queued request has a waiting thread that will take it.
    """

    def __init__(self, server: Any) -> None:
        self._server = server
        self._queue: "queue.SimpleQueue[Tuple[Any, Any]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, request: Any, client_address: Any) -> None:
        with self._lock:
            promised = self._idle > 0
            if promised:
                self._idle -= 1
                self._queue.put((request, client_address))
        if not promised:  # every thread is busy: a new one, with this request as its first
            threading.Thread(target=self._serve, args=(request, client_address), name="elastic_ext-store",
                             daemon=True).start()

    def _serve(self, request: Any, client_address: Any) -> None:
        while True:
            # socketserver's own: serves, logs an error through handle_error, always closes the connection
            self._server.process_request_thread(request, client_address)
            with self._lock:
                self._idle += 1
            while True:
                try:
                    request, client_address = self._queue.get(timeout=IDLE_S)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # more waiting threads than queued requests: this one may end
                            self._idle -= 1
                            return
                    # every waiting thread was promised a request that is on its way: wait for it


def _process_request(self: Any, request: Any, client_address: Any) -> None:
    threads = self.__dict__.get("_elastic_ext_threads")
    if threads is None:  # the accept loop is one thread: no race on creating it
        threads = self.__dict__["_elastic_ext_threads"] = ReusedThreads(self)
    threads.submit(request, client_address)


def changes() -> List[Change]:
    """What makes the driver's rendezvous servers created from now on in this process serve as the module
    docstring says (:func:`elastic_ext.launch.horovod_changes.install_launcher` makes it)."""
    from horovod.runner.http.http_server import RendezvousHTTPServer

    return [(RendezvousHTTPServer, "request_queue_size", BACKLOG),
            (RendezvousHTTPServer, "process_request", _process_request)]


__all__ = ["BACKLOG", "IDLE_S", "ReusedThreads", "changes"]
