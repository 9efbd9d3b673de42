"""How the driver's rendezvous server takes its connections: a listen queue sized for a job, served by one loop.

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
   second at most, and a thread held for each request that waits (Gloo's
   exchange, a rank request): at 1,024 workers a thousand threads that,
   woken together, took the store's lock and the interpreter in turn.
   Here the server's ``serve_forever`` thread runs its
   :class:`~elastic_ext.launch.store_loop.Loop`, which accepts, reads,
   serves, holds and answers requests without a thread each; only those
   that wait on the driver get a (reused) thread.

Who may connect and what a request may do is unchanged
(:mod:`elastic_ext.launch.store_guard`: ``verify_request`` runs on the
loop as it accepts each connection).
"""

from __future__ import annotations

import socket
from typing import Any, List

from elastic_ext.control.horovod_seam import Change
from elastic_ext.launch import store_guard, store_loop

BACKLOG = max(4096, socket.SOMAXCONN)  # a burst of every worker's requests of a thousand-worker job


def _serve_forever(self: Any, poll_interval: float = 0.5) -> None:
    store_loop.loop_of(self, store_guard.MAX_BODY_BYTES).serve_forever(poll_interval)


def changes() -> List[Change]:
    """What makes the driver's rendezvous servers created from now on in this process serve as the module
    docstring says (:func:`elastic_ext.launch.horovod_changes.install_launcher` makes it)."""
    from horovod.runner.http.http_server import RendezvousHTTPServer

    return [(RendezvousHTTPServer, "request_queue_size", BACKLOG),
            (RendezvousHTTPServer, "serve_forever", _serve_forever)]


__all__ = ["BACKLOG", "changes"]
