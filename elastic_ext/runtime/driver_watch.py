"""What the driver knows and the network does not say: a member lost without a reset, or the driver gone.

Under an elastic ``horovodrun`` every worker trains in a round of Horovod's
driver. Two failures leave a worker's collectives without an error for a
long time, because no TCP reset ever arrives:

1. **A member of the round went silent** (its host lost power or was cut off
   by a partition). Its peers wait in their collective until Gloo's timeout
   (``HOROVOD_GLOO_TIMEOUT_SECONDS``, minutes). The launcher's driver knows
   sooner: the ssh running the member ends once its keepalives go
   unanswered (:mod:`elastic_ext.launch.ssh_keepalive`), and the driver
   publishes a failed member for the round
   (:func:`elastic_ext.worker.round_watch.failed_key`). While this worker
   trains in a round, a thread of :class:`DriverWatch` reads that key every
   :data:`POLL_S`; when it appears, it cuts this worker's collective links
   (:meth:`~elastic_ext.runtime.connections.CollectiveConnections.abort`).
   The pending collective then fails on every survivor at once, as after a
   SIGKILL, and the job rolls back and re-forms without the member.
2. **This worker cannot reach its driver** for :data:`FENCE_S` (every GET of
   the rendezvous server fails): it is on the far side of a partition, or
   its driver died. The driver (after its keepalives) counts it failed and
   goes on without it, or, when the driver's own host was cut off, ends the
   job, which ``supervise`` restarts from its newest checkpoint. Training on
   would leave a second job that nobody coordinates, committing and
   writing checkpoints beside the one that replaced it (with its host
   mates; with every worker when the driver's host is the one cut off). So
   the worker fences itself: a ``fenced`` event, then exit
   :data:`~elastic_ext.exit_codes.FENCED` (its keeper, if it has one, ends the same way).
   It cannot rejoin silently with stale state either way: any next
   ``hvd.init()`` goes through the driver, which by then gave its slot to a
   newer worker or to nobody.

**A partition, not a busy driver.** The fence counts only attempts that
could not *reach* the driver's host: the TCP connection was refused, found
no route, or was not accepted within :data:`CONNECT_TIMEOUT_S`, or the
driver's name did not resolve. A connection the driver's host accepted
proves it reachable and clears the count, whatever happens next: an answer
slower than :data:`REQUEST_TIMEOUT_S`, a reset, an HTTP error. The kernel
completes the handshake while the driver process is busy, or stopped, as
long as its listen queue has room (the launcher sizes it for the job:
:mod:`elastic_ext.launch.store_serving`), so a driver slow under a burst of
a thousand workers, or stalled for seconds, fences nobody; behind a
partition every packet vanishes and no handshake completes. A driver
process that hangs for good while its host answers fences nobody either:
it is the process that would start any replacement, so no second job can
form while it hangs.

**Not while the round watch reads.** A worker waiting in ``hvd.init()``
for its next round, with the keeper's round watch reading the store
(:func:`elastic_ext.worker.round_watch.watching`), is polled by that watch
alone: it trains nothing meanwhile, so there is nothing to fence, and a
thousand workers of a reset reading ``current`` every second would take
the driver's server from the reset's own rendezvous. A cut-off worker's
``hvd.init()`` fails at Gloo's timeout; its polls, and their count, go on
from there.

The fence counts failed attempts, not time since the last answer: a job
suspended as a whole (every process stopped, then continued) finds its
driver at the first attempt after it wakes. The cost is one small HTTP GET
per worker per :data:`POLL_S` at the driver. Under plain ``horovodrun``
the failed keys never appear; the fence works the same.
"""

from __future__ import annotations

import http.client
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
from typing import Any, Callable, Optional

import elastic_ext.exit_codes as exit_codes
from elastic_ext.events import FENCED, MEMBER_FAILED
from elastic_ext.control import store
from elastic_ext.worker import round_watch
from elastic_ext.worker.round_watch import CURRENT, SCOPE, failed_key

logger = logging.getLogger(__name__)

POLL_S = 1.0
FENCE_S = 10.0           # below the driver's ssh keepalive bound: fenced before the job can go on without it
FENCE_MIN_ATTEMPTS = 3   # and at least this many unreachable attempts in a row
CONNECT_TIMEOUT_S = 2.0  # a handshake not completed by then: unreachable (a SYN lost once is retried at 1 s)
REQUEST_TIMEOUT_S = 2.0  # an answer not read by then: no verdict on this poll, the next one asks again
REPORT_S = 1.0           # the fence waits at most this long for its event and message, then exits anyway


class Unreachable(OSError):
    """No TCP connection to the driver's host could be made (the only failure the fence counts)."""


def _slot(failed: bytes) -> str:
    """``host[local_rank]`` (the failed key's value) as ``host:local_rank`` (the assigned list's form)."""
    text = failed.decode("utf-8", "replace")
    return text[:-1].replace("[", ":", 1) if text.endswith("]") else text


class DriverWatch:
    """The thread of the module docstring, for one worker.

    Args:
        base_url: the rendezvous server's scope of rounds (``http://ADDR:PORT/elastic_ext_round``).
        cut: cuts this worker's collective links, given a reason (``CollectiveConnections.abort``).
        events: the State's event log.
        exit_fn: ends the process (``os._exit``; replaced in tests).
        clock: monotonic seconds.
    """

    def __init__(self, base_url: str, cut: Callable[[str], Any], events: Any,
                 exit_fn: Callable[[int], Any] = os._exit, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url, self._cut, self._events, self._exit, self._clock = base_url, cut, events, exit_fn, clock
        self._lock = threading.Lock()
        self._round: Optional[int] = None  # the round this worker trains in; None between rounds
        self._failing_since: Optional[float] = None
        self._failures = 0
        self._slow = False  # the last poll connected but got no answer (logged once per streak)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_this_worker(cls, cut: Callable[[str], Any], events: Any) -> Optional["DriverWatch"]:
        """A started watch in a worker of an elastic ``horovodrun``; None elsewhere."""
        url = round_watch.store_url()
        if url is None:
            return None
        watch = cls(f"{url}/{SCOPE}", cut, events)
        watch._thread = threading.Thread(target=watch._run, name="elastic_ext-driver-watch", daemon=True)
        watch._thread.start()
        return watch

    def _get(self, key: str) -> Optional[bytes]:
        """The value at ``key`` (None: absent or malformed).

        Raises:
            Unreachable: no TCP connection to the driver's host (the fence counts these only).
            OSError: connected, but no answer within :data:`REQUEST_TIMEOUT_S`, or an error status
                (``urllib.error.HTTPError``): the driver's host is there.
        """
        url = f"{self.base_url}/{key}"
        parts = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=CONNECT_TIMEOUT_S)
        try:
            try:
                connection.connect()
            except OSError as exc:  # refused, no route, handshake timed out, name not resolved
                raise Unreachable(f"{type(exc).__name__}: {exc}") from exc
            self._reached()
            connection.sock.settimeout(REQUEST_TIMEOUT_S)
            connection.request("GET", parts.path)
            response = connection.getresponse()
            value = response.read()
        finally:
            connection.close()
        if response.status == 404:
            return None
        if response.status != 200:
            raise urllib.error.HTTPError(url, response.status, response.reason, response.headers, None)
        scope, name = parts.path.split("/")[-2:]
        return store.checked(scope, name, value)

    def _reached(self) -> None:
        """The driver's host accepted a connection: it is reachable, however slowly its driver answers."""
        self._failing_since, self._failures = None, 0

    def joined(self) -> None:
        """This worker now trains in the driver's current round (call after each ``hvd.init()``, once its
        collective links are known)."""
        try:
            current = self._get(CURRENT)
        except OSError as exc:
            logger.warning("cannot read the driver's round (%s): a member lost without a reset is noticed only "
                           "at Gloo's timeout in this round", exc)
            current = None
        with self._lock:
            self._round = int(current) if current is not None else None

    def left(self) -> None:
        """This worker stopped training in its round (a failure or resize is being handled): nothing to cut."""
        with self._lock:
            self._round = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=(CONNECT_TIMEOUT_S + REQUEST_TIMEOUT_S) * 2 + POLL_S)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the fence must outlive any one bad poll
                logger.error("driver watch: one poll failed (%s: %s); polling on", type(exc).__name__, exc)

    def check(self) -> None:
        """One poll: cut the links if a member of this worker's round failed; fence if the driver is gone."""
        with self._lock:
            mine = self._round
        if mine is None and round_watch.watching():
            return  # waiting in hvd.init(): the round watch reads the store meanwhile (module docstring)
        try:
            # One request: this worker's round's failed key. During an early start of newcomers the driver is
            # a round ahead of this worker's collectives; it publishes a failed member under every round the
            # member belongs to (elastic_ext.launch.driver_slots.publish_failed). Between rounds only whether
            # the driver is reachable matters.
            who = self._get(CURRENT) if mine is None else self._get(failed_key(mine))
        except Unreachable as exc:
            self._unreachable(exc)
            return
        except OSError as exc:  # connected (the count is cleared): a late answer, a reset or an HTTP error
            if not self._slow:   # (a busy or stopped driver, not a partition); logged once per streak
                logger.warning("the driver's rendezvous server accepted the connection but gave no usable answer "
                               "(%s: %s); a busy driver is not a lost one: reading the round again next time",
                               type(exc).__name__, exc)
            self._slow = True
            return
        self._slow = False
        if mine is not None and who is not None:
            self._member_failed(mine, _slot(who))

    def _member_failed(self, round_id: int, member: str) -> None:
        with self._lock:
            if self._round != round_id:  # the main thread left the round meanwhile: its links are not these
                return
            self._round = None  # once per round
            cut = self._cut(f"the driver reports member {member} of round {round_id} failed")
        self._events.emit(MEMBER_FAILED, round=round_id, member=member, links_cut=cut)

    def _unreachable(self, exc: BaseException) -> None:
        now = self._clock()
        if self._failing_since is None:
            self._failing_since = now
        self._failures += 1
        unreachable_s = now - self._failing_since
        if self._failures < FENCE_MIN_ATTEMPTS or unreachable_s < FENCE_S:
            logger.warning("cannot reach the driver's rendezvous server (%s); fencing this worker if that lasts "
                           "%.0fs", exc, FENCE_S)
            return
        fields = {"unreachable_s": round(unreachable_s, 3), "attempts": self._failures, "error": str(exc)[:200]}
        try:
            # Reporting comes second: an event write that raises or blocks (a full disk, a hard-mounted
            # filesystem on the far side of the partition) must never keep a cut-off worker training.
            reporter = threading.Thread(target=self._report_fence, args=(fields,), name="elastic_ext-fenced",
                                        daemon=True)
            reporter.start()
            reporter.join(REPORT_S)
        finally:
            self._exit(exit_codes.FENCED)

    def _report_fence(self, fields: dict) -> None:
        try:
            self._events.emit(FENCED, **fields)
            print(f"elastic_ext: this worker has not reached its driver for {fields['unreachable_s']:.1f}s "
                  f"({fields['error']}): it is cut off from its job, which goes on without it; exiting "
                  f"({exit_codes.FENCED}) rather than train alone", file=sys.stderr, flush=True)
            logging.shutdown()
        except Exception as exc:  # noqa: BLE001 - the exit follows whatever happens here
            logger.error("fenced, but could not report it (%s: %s); exiting anyway", type(exc).__name__, exc)
