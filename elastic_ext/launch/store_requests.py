"""A request of the driver's store held in memory: what its handler reads and writes (:mod:`~.store_loop`)."""

from __future__ import annotations

import io
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, List, Optional, Tuple

HEADER_LINE_MAX = 65536  # http.client's limits: longer lines and more headers get http.server's answer
HEADERS_MAX = 100


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


def plain_head(data: bytes) -> Optional[Tuple[List[str], List[Tuple[str, str]], int]]:
    """The request line's three words, the headers as (name, value) and where the body starts, for a request
    whose head ``http.server`` would read the same way as this plain split: a version HTTP/1.0 or 1.1, a
    path with one leading ``/``, every line ended by CRLF, every header line ``NAME:value`` with a name of
    printable ASCII (the email parser's rule), within http.client's limits. None for anything else."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    words = lines[0].split()
    if (len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1") or not words[1].startswith("/")
            or words[1].startswith("//") or "\n" in lines[0] or len(lines) > HEADERS_MAX + 1):
        return None
    fields = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if (not colon or not name or len(line) > HEADER_LINE_MAX or "\n" in line or "\r" in line
                or not (name.isascii() and name.isprintable()) or " " in name):
            return None
        fields.append((name, value.lstrip(" \t")))
    return words, fields, end + 4


class PlainHead:
    """A handler of the store's loop (Horovod's, as the guard changed it) that reads a plain request's head
    with :func:`plain_head` instead of the email parser ``http.server`` uses (about a sixth of the driver's
    CPU per request at 1,024 workers), and formats the Date header once a second. A head that is not plain,
    a request not held in memory and a handler that keeps connections open get ``http.server``'s parse."""

    _date: Tuple[int, str] = (-1, "")

    def parse_request(self) -> bool:
        data = getattr(self.request, "data", None)  # type: ignore[attr-defined]
        head = None if data is None or self.protocol_version >= "HTTP/1.1" else plain_head(data)  # type: ignore
        if head is None:
            return super().parse_request()  # type: ignore[misc]
        words, fields, body = head
        self.requestline = str(self.raw_requestline, "latin-1").rstrip("\r\n")  # type: ignore[attr-defined]
        self.command, self.path, self.request_version = words
        self.close_connection = True  # an HTTP/1.0 handler closes after each answer, whatever the client asks
        headers = self.MessageClass()  # type: ignore[attr-defined]
        for name, value in fields:
            headers[name] = value
        self.headers = headers
        self.rfile.seek(body)  # type: ignore[attr-defined]
        return True

    def date_time_string(self, timestamp: Optional[float] = None) -> str:
        if timestamp is not None:
            return super().date_time_string(timestamp)  # type: ignore[misc]
        now = int(time.time())
        second, text = PlainHead._date
        if second != now:
            text = super().date_time_string(now)  # type: ignore[misc]
            PlainHead._date = (now, text)
        return text


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


__all__ = ["InMemory", "PlainHead", "body_length", "plain_head", "response"]
