"""Scale-up without idle survivors: newcomers start while the survivors train.

Horovod's driver starts a new host's workers only once every current worker
has asked its rendezvous server for a rank, which ``hvd.init()`` does after
a reset. So without an early start the survivors stop at a host addition, re-initialise,
and then wait while the newcomers start Python, import the framework,
initialise Horovod and build their model (6 to 7 s on the test machine).

Under ``elastic-horovodrun`` a pure host addition does not reset at once
(and a failed worker's slot comes back the same way: the launcher's driver
forms the round after a failure from the survivors, then offers the slot as
added, :mod:`elastic_ext.launch.driver`):

1. At the commit that agrees the addition, every rank sends the rank request
   of the next world from a background thread (:class:`Prestart`), the same
   HTTP request ``hvd.init()`` sends, and goes on training on the current
   Horovod context. In a round the driver formed without a failed slot,
   every rank does so right after its sync instead
   (:func:`elastic_ext.worker.round_watch.capacity_left_out`, the same
   answer on every rank), so the slot's new worker does not wait for a
   commit. Once every rank has asked, the driver starts the newcomers.
2. Horovod starts a newcomer with its rank in the environment; its first
   ``hvd.init()`` would go straight to Gloo's rendezvous, which the
   survivors, still training, would not join, and its script would build
   its model only after that. So the launcher's entry module wraps
   ``hvd.init()`` before the script runs (:func:`elastic_ext.worker.newcomer.init`,
   :mod:`elastic_ext.worker.horovod_changes`): when the survivors' marker is in the
   rendezvous server's key-value store, a newcomer starts Horovod as a world
   of one (:func:`~elastic_ext.worker.newcomer.start_solo`; ``hvd.rank()``, ``hvd.size()`` and
   ``hvd.local_rank()`` still answer what it was launched with) and builds
   its model. At ``@elastic_ext.run`` (:func:`~elastic_ext.worker.newcomer.join`) it writes its rank
   under :data:`SCOPE` (it is ready) and re-initialises Horovod: Horovod's
   reset asks for its rank in the round the survivors' reset joins, so
   newcomers and survivors form the world of one driver round, whatever
   changed meanwhile.
3. Rank 0 polls the store; the first commit whose allreduce carries "every
   rank of the next world is there" resets the job, and the survivors'
   reset meets newcomers whose model is built.

A failure, a removal or a leave while this is under way resets the job at
once, as without the option (the driver already counts the newcomers in).
A newcomer that never announces itself (its script called ``hvd.init()``
before importing ``elastic_ext``, or never reaches ``@elastic_ext.run``) is
waited for at most ``timeout_s``; then the survivors reset without it, it
fails its first rendezvous, and Horovod's driver blacklists its host. Until
a newcomer joins, a collective it runs happens in its world of one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Optional, Tuple

from elastic_ext.control import store
from elastic_ext.worker import round_watch
from elastic_ext.worker.round_watch import store_url

logger = logging.getLogger(__name__)

# The keys of an early start (elastic_ext.control.store names each, its writer and its readers).
SCOPE = store.READY_SCOPE            # the store's scope of the announcements; the key is the rank
MARKER = store.MARKER                # a key of SCOPE: the survivors started the newcomers early
ASKED = store.ASKED                  # a key of SCOPE, put before the rank requests: the driver starts newcomers
RANK_SCOPE = store.RANK_SCOPE        # Horovod's own scope: a GET records the worker as ready
POLL_S = 0.1
REQUEST_TIMEOUT_S = store.REQUEST_TIMEOUT_S


def put(url: str, value: bytes = store.PRESENT) -> None:
    """Writes a key of the store, with the job's secret (:func:`elastic_ext.control.store.put`)."""
    store.put(url, value, REQUEST_TIMEOUT_S)


def get(url: str, timeout_s: Optional[float] = REQUEST_TIMEOUT_S) -> Optional[bytes]:
    """The value, or None when the key is not there (404) or is malformed."""
    return store.get(url, timeout_s)


def parse_slot(text: bytes) -> Tuple[int, int]:
    """(rank, size) from the rendezvous server's answer ``rank,size,local_rank,...``; rank -1: removed."""
    fields = text.decode("ascii").split(",")
    if len(fields) < 2:
        raise ValueError(f"unexpected rank_and_size answer {text!r}; expected 'rank,size,...'")
    return int(fields[0]), int(fields[1])


class Prestart:
    """One rank's part in starting the newcomers early (see the module docstring).

    :meth:`start` sends the next world's rank request in a background
    thread; :meth:`ready` is True once every rank of the next world is
    there (polled on ``poll`` ranks only: rank 0), once this rank was
    removed, once a newcomer died (the launcher's driver publishes its
    round's failures), once the request failed, or after ``timeout_s``. Any
    of these makes the next commit reset the job.
    """

    def __init__(self, url: str, host: str, local_rank: int, poll: bool, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url, self.host, self.local_rank, self.poll = url, host, local_rank, poll
        self.timeout_s, self._clock = timeout_s, clock
        self.started = clock()
        self.next_rank: Optional[int] = None
        self.next_size: Optional[int] = None
        self.why = ""                   # why it is ready: "all_there", "removed", "newcomer_failed", "error: ...", "timeout"
        self._ready = threading.Event()
        self._cancelled = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def from_env(cls, local_rank: int, poll: bool, timeout_s: float,
                 environ: Optional[Mapping[str, str]] = None) -> Optional["Prestart"]:
        """A Prestart for this worker of an elastic ``horovodrun``; None elsewhere.

        ``local_rank`` comes from Horovod: a reset can change it, and
        Horovod's C++ then updates only the C environment, not ``os.environ``.
        """
        env = os.environ if environ is None else environ
        url, host = store_url(env), env.get("HOROVOD_HOSTNAME")
        if url is None or not host:
            return None
        return cls(url, host, local_rank, poll, timeout_s)

    def start(self) -> "Prestart":
        self._thread = threading.Thread(target=self._run, name="elastic_ext-prestart", daemon=True)
        self._thread.start()
        return self

    def waited_s(self) -> float:
        return self._clock() - self.started

    def cancel(self) -> None:
        self._cancelled.set()

    def ready(self) -> bool:
        if not self._ready.is_set() and self._clock() - self.started > self.timeout_s:
            self.finish("timeout")
        return self._ready.is_set()

    def finish(self, why: str) -> None:
        """Marks it ready for ``why`` (a no-op once ready)."""
        if not self._ready.is_set():
            self.why = why
            self._ready.set()

    def _run(self) -> None:
        try:
            # The launcher's driver starts new workers only in a round an early start completes.
            put(f"{self.url}/{SCOPE}/{ASKED}")
            # Blocks until every current rank asked (they all start at the same commit).
            answer = get(f"{self.url}/{RANK_SCOPE}/{self.host}:{self.local_rank}", timeout_s=None)
            if answer is None:
                raise ValueError("no rank_and_size answer")
            self.next_rank, self.next_size = parse_slot(answer)
            if self.next_rank < 0:
                self.finish("removed")
                return
            put(f"{self.url}/{SCOPE}/{MARKER}")  # before any newcomer's init: Python starts in seconds
            put(f"{self.url}/{SCOPE}/{self.next_rank}")
            if not self.poll:
                return
            # The round our requests formed, whose members the newcomers are (the launcher's driver says).
            round_id = store.parse_round(get(f"{self.url}/{round_watch.SCOPE}/{round_watch.CURRENT}"))
            failed = None if round_id is None else f"{self.url}/{round_watch.SCOPE}/{round_watch.failed_key(round_id)}"
            missing = set(range(self.next_size))
            while missing and not self._cancelled.is_set() and not self._ready.is_set():
                missing = {rank for rank in missing if get(f"{self.url}/{SCOPE}/{rank}") is None}
                if missing and failed is not None and get(failed) is not None:
                    self.finish("newcomer_failed")  # it will never announce itself: reset now, not at the timeout
                    return
                if missing:
                    time.sleep(POLL_S)
            if not missing:
                self.finish("all_there")
        except (OSError, ValueError) as exc:
            logger.warning("starting the newcomers early failed (%s); the next commit resets the job", exc)
            self.finish(f"error: {exc}")


def early_start_factory(binding: Any, timeout_s: float) -> Optional[Callable[[], Optional[Prestart]]]:
    """What ``run`` hands the State under an elastic ``horovodrun``: a new :class:`Prestart` per host addition.

    None when the binding has no local rank (a test binding). Rank 0 polls
    the store for the newcomers; ``timeout_s`` bounds the wait for them.
    """
    local_rank = getattr(binding, "local_rank", None)
    if local_rank is None:
        return None
    return lambda: Prestart.from_env(local_rank(), poll=binding.rank() == 0, timeout_s=timeout_s)
