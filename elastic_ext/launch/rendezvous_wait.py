"""The driver's rendezvous server answers a Gloo peer's read of a key not yet written when it is written.

Every ``hvd.init()`` builds six Gloo contexts (global, local and cross,
then the same three for the global process set), each a rendezvous
through the driver's HTTP store: a rank writes its address under its own
key and reads each peer's key until it is there. Horovod's store answers
the read of a missing key "404" at once, and the rank's C++ client then
sleeps 10 ms before it asks again; so at each of the six rendezvous a
rank that asked just before its peer wrote waits up to 10 ms more, and
the ranks' polling adds a few hundred requests a second to a Python
server on the machine that trains. A recovery's ``hvd.init()`` was 0.16 s
on this machine, most of it in those rendezvous (``docs/benchmarks.md``,
"Recovery time").

Here a read of a missing key in a Gloo scope (``global``, ``local_*``,
``cross_*`` and their process sets' ``*_process_set_hash_*``) waits in the
server until a write lands, at most :data:`HOLD_S`, then answers as
Horovod would: the value, or 404 after the hold (the client's own timeout
then works as before, later by at most the hold). Other scopes (the
elastic rank requests, which already wait for the driver's round, the
launcher's round keys, notices) are answered at once, as before.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from elastic_ext.launch.replaced import Originals, replace, restore

HOLD_S = 1.0  # longest a read of a missing key waits in the server
GLOO_SCOPES = ("global", "local_", "cross_")  # prefixes of the scopes Horovod's Gloo contexts use

_originals: Originals = {}
_writes = threading.Condition()
_written = 0   # writes answered since the server started, under _writes
_waiting = 0   # reads waiting now, under _writes


def gloo_scope(scope: str) -> bool:
    """True for the scopes of Horovod's Gloo rendezvous (whose reads may wait for a write)."""
    return scope.startswith(GLOO_SCOPES)


def wait_for_readers(count: int, timeout_s: float) -> bool:
    """Blocks until ``count`` reads wait (for tests: a read held before its write); False on timeout."""
    with _writes:
        return _writes.wait_for(lambda: _waiting >= count, timeout_s)


def install() -> None:
    """Makes this (the driver's) process's rendezvous server hold Gloo reads of missing keys; idempotent."""
    if _originals:
        return
    from horovod.runner.http.http_server import KVStoreHandler

    original_get = KVStoreHandler._get_value
    original_put = KVStoreHandler.do_PUT

    def get_value(self: Any, scope: str, key: str) -> Optional[bytes]:
        global _waiting
        if not gloo_scope(scope):
            return original_get(self, scope, key)
        deadline = time.monotonic() + HOLD_S
        with _writes:
            while True:
                seen = _written
                value = original_get(self, scope, key)
                left = deadline - time.monotonic()
                if value is not None or left <= 0:
                    return value
                _waiting += 1
                _writes.notify_all()  # wait_for_readers
                try:
                    _writes.wait_for(lambda: _written != seen, left)
                finally:
                    _waiting -= 1

    def do_put(self: Any) -> None:
        global _written
        try:
            original_put(self)
        finally:
            with _writes:
                _written += 1
                _writes.notify_all()

    replace(_originals, ((KVStoreHandler, "_get_value", get_value), (KVStoreHandler, "do_PUT", do_put)))


def uninstall() -> None:
    """Gives Horovod's store its own answers back (tests run both in one process)."""
    restore(_originals)


__all__ = ["HOLD_S", "GLOO_SCOPES", "gloo_scope", "wait_for_readers", "install", "uninstall"]
