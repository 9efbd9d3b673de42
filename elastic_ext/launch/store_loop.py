"""The driver's store served by one thread: requests read, answered and held without a thread each.

Under load the store's threads were its cost: at 1,024 workers a reset held
a thousand Gloo exchanges on a thousand threads, and when they woke they
took the store's lock and the interpreter one after the other while every
plain read queued behind them (``bench/README.md``, "The control plane at
scale"). Here the thread of the server's ``serve_forever`` runs its
:class:`Loop`, which takes every connection waiting (each checked by the
server's ``verify_request``: the guard) and for each:

1. **reads** the request without blocking until its head (up to
   :data:`HEAD_MAX` bytes) and the body its ``Content-Length`` announces
   have arrived (a body over the guard's limit is not read: the handler
   refuses it); a request not complete within the handler's timeout
   (Horovod's: 3 s) is answered 408;
2. **serves** it with the server's own handler (Horovod's, as the guard
   changed it) on the request held in memory, on this thread: reads and
   writes of the store take microseconds. Only the requests that wait on
   the driver go to a thread (:data:`THREADED_SCOPES`; the guard's handler
   holds rank requests itself, its ``HELD_SCOPES``, :mod:`.held_ranks`; a
   worker's registration waits until the driver reaches it); threads are reused
   (:class:`~elastic_ext.launch.store_threads.ReusedThreads`);
3. **holds** a request whose handler deferred its answer
   (:meth:`~elastic_ext.launch.store_requests.InMemory.defer`:
   Gloo's exchange until its last rank publishes) without a thread, and
   answers it when the handler's callback gives the answer or, at the end
   of the hold, with what the handler said then;
4. **writes** the answer without blocking and closes the connection
   (HTTP/1.0, as Horovod's server answers).

A failure while serving one connection closes that connection and is
logged; the loop goes on. The server's ``shutdown()`` ends it, as it ends
socketserver's own loop, and closes the connections still open (the
client of a held request asks again, of the driver's next store).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import selectors
import socket
import threading
import time
from typing import Any, Callable, List, Optional, Set, Tuple

from elastic_ext.launch.store_threads import ReusedThreads
from elastic_ext.launch.store_requests import InMemory, body_length, response

logger = logging.getLogger(__name__)

HEAD_MAX = 1 << 16  # bytes of a request line and headers (http.server refuses a line over 65,536)
ACCEPT_BATCH = 256  # connections taken at once before the loop serves those it has
THREADED_SCOPES = frozenset({"rank_and_size", "worker_addresses"})  # Horovod's scopes that wait on the driver


class _Connection:
    """One accepted connection and where it is: reading, served, held, writing."""

    __slots__ = ("sock", "address", "inbox", "need", "outbox", "sent", "deadline", "at_end", "done")

    def __init__(self, sock: socket.socket, address: Any) -> None:
        self.sock, self.address = sock, address
        self.inbox, self.need = bytearray(), -1     # -1: the head is not complete yet
        self.outbox, self.sent = b"", 0
        self.deadline = 0.0
        self.at_end: Optional[Callable[[], None]] = None  # a held request's answer at its hold's end
        self.done = False                           # answered (or closed): a later answer is dropped


class Loop:
    """What serves a server's connections on the thread of its ``serve_forever`` (the module docstring)."""

    def __init__(self, server: Any, body_limit: int) -> None:
        self._server, self._body_limit = server, body_limit
        self._threaded = THREADED_SCOPES - getattr(server.RequestHandlerClass, "HELD_SCOPES", frozenset())  # not held
        self._threads = ReusedThreads()
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._calls: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._deadlines: List[Tuple[float, int, _Connection]] = []
        self._order = itertools.count()
        self._open: Set[_Connection] = set()
        self._ident: Optional[int] = None
        self._timeout = float(getattr(server.RequestHandlerClass, "timeout", None) or 3.0)

    def answer(self, connection: _Connection, data: bytes) -> None:
        """Answers a request with ``data`` (from any thread; dropped if it was answered already)."""
        if threading.get_ident() == self._ident:
            self._send(connection, data)
        else:
            self._call(lambda: self._send(connection, data))

    def _call(self, call: Callable[[], None]) -> None:
        self._calls.put(call)
        try:
            self._wake_write.send(b"\0")
        except (BlockingIOError, InterruptedError):
            pass  # the loop has wake-ups pending already

    def serve_forever(self, poll_interval: float) -> None:
        """Serves until the server's ``shutdown()`` (checked every ``poll_interval`` at least), as
        ``socketserver.BaseServer.serve_forever`` does; then closes the connections still open."""
        server = self._server
        server._BaseServer__is_shut_down.clear()
        self._ident = threading.get_ident()
        server.socket.setblocking(False)
        self._selector.register(server.socket, selectors.EVENT_READ, server)
        try:
            while not server._BaseServer__shutdown_request:
                now = time.monotonic()
                wait = poll_interval if not self._deadlines else min(poll_interval, self._deadlines[0][0] - now)
                for key, events in self._selector.select(max(0.0, wait)):
                    if key.data is None:
                        self._drain_wake_ups()
                    elif key.data is server:
                        self._accept_all()
                    else:
                        self._guarded(key.data, self._readable if events & selectors.EVENT_READ else self._writable)
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    when, _, connection = heapq.heappop(self._deadlines)
                    if when == connection.deadline and connection.sock.fileno() >= 0:
                        self._guarded(connection, self._expired)
                server.service_actions()
        finally:
            self._selector.unregister(server.socket)
            for connection in list(self._open):
                self._close(connection)
            self._deadlines.clear()
            self._ident = None
            server._BaseServer__shutdown_request = False
            server._BaseServer__is_shut_down.set()

    def _accept_all(self) -> None:
        """Takes every connection waiting, each checked by the server's ``verify_request`` (the guard)."""
        server = self._server
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = server.get_request()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # as socketserver: a failed accept is dropped
                return
            try:
                if server.verify_request(sock, address):
                    self._accept(sock, address)
                    continue
            except Exception:  # noqa: BLE001 - as socketserver's _handle_request_noblock
                server.handle_error(sock, address)
            server.shutdown_request(sock)

    def _drain_wake_ups(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                call()
            except Exception:  # noqa: BLE001 - one connection's failure; the loop serves on
                logger.exception("elastic_ext: the driver's store failed on a connection")

    def _guarded(self, connection: _Connection, step: Callable[[_Connection], None]) -> None:
        try:
            step(connection)
        except Exception:  # noqa: BLE001 - one connection's failure; the loop serves on
            logger.exception("elastic_ext: the driver's store failed serving %s", connection.address)
            self._close(connection)

    def _set_deadline(self, connection: _Connection, after_s: float) -> None:
        connection.deadline = time.monotonic() + after_s
        heapq.heappush(self._deadlines, (connection.deadline, next(self._order), connection))

    def _accept(self, sock: socket.socket, address: Any) -> None:
        sock.setblocking(False)
        connection = _Connection(sock, address)
        self._open.add(connection)
        self._selector.register(sock, selectors.EVENT_READ, connection)
        self._set_deadline(connection, self._timeout)

    def _readable(self, connection: _Connection) -> None:
        try:
            chunk = connection.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client closed or reset before its request was complete
            self._close(connection)
            return
        connection.inbox += chunk
        if connection.need < 0:
            end = connection.inbox.find(b"\r\n\r\n")
            if end < 0:
                if len(connection.inbox) > HEAD_MAX:
                    self._selector.unregister(connection.sock)
                    self._send(connection, response(431))
                return
            connection.need = end + 4 + body_length(bytes(connection.inbox[:end]), self._body_limit)
        if len(connection.inbox) >= connection.need:
            self._selector.unregister(connection.sock)
            self._serve(connection)

    def _serve(self, connection: _Connection) -> None:
        data, connection.inbox = bytes(connection.inbox), bytearray()
        connection.deadline = 0.0  # no read deadline any more
        path = data[:data.find(b"\r\n")].split(b" ")
        scope = path[1].split(b"/")[1] if len(path) > 1 and path[1].count(b"/") >= 2 else b""
        memory = InMemory(data, lambda answer: self.answer(connection, answer))
        if scope.decode("latin-1") in self._threaded:
            self._threads.submit(lambda: self._handle(connection, memory, threaded=True))
        else:
            self._handle(connection, memory, threaded=False)

    def _handle(self, connection: _Connection, memory: InMemory, threaded: bool) -> None:
        try:
            self._server.finish_request(memory, connection.address)  # the server's handler, on the request
        except Exception:  # noqa: BLE001 - as socketserver: logged through the server, the connection closed
            self._server.handle_error(memory, connection.address)
        if memory.hold_s is not None and not memory.out:
            if threaded:
                self._call(lambda: self._hold(connection, memory))
            else:
                self._hold(connection, memory)
        else:
            self.answer(connection, bytes(memory.out))

    def _hold(self, connection: _Connection, memory: InMemory) -> None:
        if not connection.done:
            connection.at_end = memory.end_hold
            self._set_deadline(connection, memory.hold_s or 0.0)

    def _expired(self, connection: _Connection) -> None:
        if connection.at_end is not None:  # a held request's hold has ended
            connection.at_end()
        elif connection.outbox:  # its client has read nothing for the handler's timeout
            self._close(connection)
        else:  # its request was not complete in time
            self._selector.unregister(connection.sock)
            self._send(connection, response(408))

    def _send(self, connection: _Connection, data: bytes) -> None:
        if connection.done:
            return
        connection.done, connection.at_end = True, None
        connection.outbox, connection.sent = data, 0
        self._writable(connection, registered=False)

    def _writable(self, connection: _Connection, registered: bool = True) -> None:
        try:
            while connection.sent < len(connection.outbox):
                connection.sent += connection.sock.send(memoryview(connection.outbox)[connection.sent:])
        except (BlockingIOError, InterruptedError):
            if not registered:
                self._selector.register(connection.sock, selectors.EVENT_WRITE, connection)
            self._set_deadline(connection, self._timeout)
            return
        except OSError:  # the client has gone
            pass
        if registered:
            self._selector.unregister(connection.sock)
        self._close(connection, registered=False)

    def _close(self, connection: _Connection, registered: Optional[bool] = None) -> None:
        if connection.sock.fileno() < 0:
            return
        connection.done = True
        if registered is not False:
            try:
                self._selector.unregister(connection.sock)
            except (KeyError, ValueError):
                pass
        try:
            connection.sock.shutdown(socket.SHUT_WR)  # as socketserver's shutdown_request
        except OSError:
            pass
        connection.sock.close()
        self._open.discard(connection)


def loop_of(server: Any, body_limit: int) -> Loop:
    """The server's loop (made by its ``serve_forever``: one thread, no race)."""
    loop = server.__dict__.get("_elastic_ext_loop")
    if loop is None:
        loop = server.__dict__["_elastic_ext_loop"] = Loop(server, body_limit)
    return loop


__all__ = ["ACCEPT_BATCH", "HEAD_MAX", "Loop", "THREADED_SCOPES", "loop_of"]
