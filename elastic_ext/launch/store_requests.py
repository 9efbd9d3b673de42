"""A request of the driver's store held in memory: what its handler reads and writes (:mod:`~.store_loop`)."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Optional, Tuple


def response(status: int, body: bytes = b"") -> bytes:
    """An HTTP/1.0 answer with ``body``, as Horovod's handler sends one."""
    reason = BaseHTTPRequestHandler.responses.get(status, ("",))[0]
    return b"HTTP/1.0 %d %s\r\nContent-Length: %d\r\n\r\n" % (status, reason.encode("latin-1"), len(body)) + body


def body_length(head: bytes, limit: int) -> int:
    """The body bytes to read after ``head`` (a request line and headers): its first ``Content-Length``,
    0 when there is none, it is not a byte count or it exceeds ``limit`` (the handler refuses those)."""
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"content-length":
            value = value.strip()
            return int(value) if value.isdigit() and int(value) <= limit else 0
    return 0


class InMemory:
    """What a handler takes for its connection: the request read, the answer written, in memory.

    ``socketserver.StreamRequestHandler`` reads ``makefile('rb')`` and writes through ``sendall``.
    """

    def __init__(self, data: bytes, answer: Callable[[bytes], None]) -> None:
        self.data, self._answer = data, answer
        self.out = bytearray()
        self.hold_s: Optional[float] = None  # deferred: how long the loop holds the request
        self._at_end: Callable[[], Tuple[int, bytes]] = lambda: (404, b"")
        self._lock = threading.Lock()
        self._replied = False

    def settimeout(self, timeout: Optional[float]) -> None:
        pass

    def setsockopt(self, *args: Any) -> None:
        pass

    def makefile(self, mode: str = "r", buffering: Optional[int] = None) -> Any:
        if "r" not in mode:
            raise ValueError(f"mode {mode!r}: a request in memory is read only ('rb')")
        return io.BytesIO(self.data)

    def sendall(self, data: bytes) -> None:
        self.out += data

    def defer(self, hold_s: float, at_end: Callable[[], Tuple[int, bytes]]) -> Callable[[int, bytes], bool]:
        """Tells the store's loop that the handler answers later, with :meth:`reply` (from any thread); if it
        has not replied within ``hold_s``, the loop answers ``at_end()`` (:meth:`end_hold`)."""
        self.hold_s, self._at_end = hold_s, at_end
        return self.reply

    def reply(self, status: int, body: bytes = b"") -> bool:
        """Sends a deferred request's answer, once: False (nothing sent) if it had one already."""
        with self._lock:
            if self._replied:
                return False
            self._replied = True
        self._answer(response(status, body))
        return True

    def end_hold(self) -> None:
        self.reply(*self._at_end())


__all__ = ["InMemory", "body_length", "response"]
