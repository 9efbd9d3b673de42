"""The driver's store over raw HTTP for :mod:`bench.control_plane_sim`: one connection per request, timed.

As ``urllib`` (the launcher's reads and writes) and Horovod's C++
``HTTPRequest`` (Gloo's and the rank request) send them: a fresh TCP
connection per request, which the store (HTTP/1.0) closes after its answer.
Every request's latency, kind and failure is counted by phase (:class:`Stats`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Dict, List, Optional, Set, Tuple

from elastic_ext.control import store


class Unreachable(Exception):
    """A request that failed as ``urllib`` fails (no connection, timeout, no answer): an OSError there."""


class Unanswered(Unreachable):
    """A request whose connection the store accepted but which got no answer (timed out, closed, reset)."""


class HTTPError(Exception):
    """The store answered, with another status than 200 or 404."""


class Stats:
    """Latencies, counts and failures of the simulated requests, by phase and kind."""

    def __init__(self) -> None:
        self.phase = "start"
        self.latency: Dict[str, List[float]] = collections.defaultdict(list)
        self.requests: Dict[Tuple[str, str], int] = collections.Counter()
        self.failures: Dict[Tuple[str, str, str], int] = collections.Counter()
        self.fenced: Dict[str, Set[int]] = collections.defaultdict(set)
        self.watch_failed: Dict[str, int] = collections.Counter()
        self.watch_unanswered: Dict[str, int] = collections.Counter()  # polls connected, not answered (after)
        # (phase, context) -> (seconds to its full mesh, seconds to its barrier's end) of each rank
        self.contexts: Dict[Tuple[str, str], List[Tuple[float, float]]] = collections.defaultdict(list)


class Store:
    """The driver's store over raw HTTP, one connection per request."""

    def __init__(self, port: int, secret: str, stats: Stats) -> None:
        self.port, self.secret, self.stats = port, secret, stats

    async def request(self, method: str, scope: str, key: str, body: Optional[bytes] = None,
                      timeout_s: Optional[float] = store.REQUEST_TIMEOUT_S, secret: bool = False,
                      kind: str = "other", connect_timeout_s: Optional[float] = None) -> Tuple[int, bytes]:
        """(status, body). ``timeout_s`` bounds the whole request; with ``connect_timeout_s`` the handshake has
        that bound and the answer ``timeout_s`` more (the driver watch of ``elastic_ext`` after issue 55).

        Raises:
            Unanswered: connected, no answer (a subclass of Unreachable: the rule before issue 55 counts both).
            Unreachable: no connection.
        """
        lines = [f"{method} /{scope}/{key} HTTP/1.1", f"Host: 127.0.0.1:{self.port}", "Connection: close"]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        if secret:
            lines.append(f"{store.SECRET_HEADER}: {self.secret}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")
        phase, start = self.stats.phase, time.monotonic()
        connected = False
        try:
            async with asyncio.timeout(timeout_s if connect_timeout_s is None else None) as whole:
                async with asyncio.timeout(connect_timeout_s):
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                connected = True
                if connect_timeout_s is not None:
                    whole.reschedule(None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s)
                try:
                    writer.write(data)
                    raw = await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            self.stats.failures[(phase, kind, ("unanswered " if connected else "") + type(exc).__name__)] += 1
            raise (Unanswered if connected else Unreachable)(str(exc) or type(exc).__name__) from None
        if not raw.startswith(b"HTTP/") or len(raw) < 12:
            self.stats.failures[(phase, kind, "no answer")] += 1
            raise Unanswered("closed without an answer")
        self.stats.latency[phase].append(time.monotonic() - start)
        self.stats.requests[(phase, kind)] += 1
        return int(raw[9:12]), raw.split(b"\r\n\r\n", 1)[-1]

    async def value(self, scope: str, key: str, timeout_s: Optional[float] = store.REQUEST_TIMEOUT_S,
                    kind: str = "other", connect_timeout_s: Optional[float] = None) -> Optional[bytes]:
        """As :func:`elastic_ext.control.store.get`: the value, None on 404, Unreachable or HTTPError."""
        status, body = await self.request("GET", scope, key, timeout_s=timeout_s, kind=kind,
                                          connect_timeout_s=connect_timeout_s)
        if status == 404:
            return None
        if status != 200:
            raise HTTPError(status)
        return store.checked(scope, key, body)


    async def quiet(self, scope: str, key: str, timeout_s: Optional[float] = store.REQUEST_TIMEOUT_S,
                    kind: str = "other") -> Optional[bytes]:
        """A read whose failure the real code takes as "absent" (``round_watch._read``, the marker's read)."""
        try:
            return await self.value(scope, key, timeout_s, kind)
        except (Unreachable, HTTPError):
            return None
