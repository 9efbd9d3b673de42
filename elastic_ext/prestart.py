"""Scale-up without idle survivors: newcomers start while the survivors train.

Horovod's driver starts a new host's workers only once every current worker
has asked its rendezvous server for a rank, which ``hvd.init()`` does after
a reset. So by default the survivors stop at a host addition, re-initialise,
and then wait while the newcomers start Python, import the framework and
reach ``hvd.init()`` (6 to 7 s on the test machine).

With ``ElasticConfig.prestart_newcomers`` a pure host addition does not
reset at once:

1. At the commit that agrees the addition, every rank sends the rank request
   of the next world from a background thread (:class:`Prestart`), the same
   HTTP request ``hvd.init()`` sends, and goes on training on the current
   Horovod context. Once every rank has asked, the driver starts the
   newcomers.
2. Horovod starts a newcomer with its rank in the environment, and its
   first ``hvd.init()`` would go straight to Gloo's rendezvous, which the
   survivors, still training, would not join. So :func:`install` (done at
   ``import elastic_ext``) wraps ``hvd.init()``: when the survivors' marker
   is in the rendezvous server's key-value store, a newcomer writes its rank
   under :data:`SCOPE` (it is there), then sends the rank request a reset
   sends, which waits for the survivors, and takes its rank from the answer
   before Horovod's own ``init`` runs. Newcomers and survivors then join
   the same round of the driver, whatever changed meanwhile.
3. Rank 0 polls the store; the first commit whose allreduce carries "every
   rank of the next world is there" resets the job, and the survivors'
   ``hvd.init()`` meets newcomers that are already waiting.

A failure, a removal or a leave while this is under way resets the job at
once, as without the option (the driver already counts the newcomers in).
A newcomer that never announces itself (its script imported ``init`` from
Horovod before ``elastic_ext`` was imported) is waited for at most
``timeout_s``; then the survivors reset and meet it in Gloo's rendezvous.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Mapping, MutableMapping, Optional, Tuple

logger = logging.getLogger(__name__)

SCOPE = "elastic_ext_ready"          # the store's scope of the announcements; the key is the rank
MARKER = "early_start"               # a key of SCOPE: the survivors started the newcomers early
RANK_SCOPE = "rank_and_size"         # Horovod's own scope: a GET records the worker as ready
POLL_S = 0.1
REQUEST_TIMEOUT_S = 10.0


def store_url(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The rendezvous server's URL when this process is a worker of an elastic ``horovodrun``, else None."""
    env = os.environ if environ is None else environ
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if env.get("HOROVOD_ELASTIC") != "1" or not addr or not port:
        return None
    return f"http://{addr}:{port}"


def _put(url: str, value: bytes = b"1") -> None:
    request = urllib.request.Request(url, data=value, method="PUT")
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S):
        pass


def _get(url: str, timeout_s: Optional[float] = REQUEST_TIMEOUT_S) -> Optional[bytes]:
    """The value, or None when the key is not there (404)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


# ------------------------------------------------------------ newcomer side

_first_init_done = False
SLOT_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def join_early(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Before this process's first ``hvd.init()``: joins the survivors' early start if one is under way.

    Writes this worker's rank under :data:`SCOPE`, waits for the survivors'
    reset in Horovod's rank request, and puts the answer in the environment
    that ``hvd.init()`` reads. Returns True if it joined; False when no early
    start is under way (the job's first start, a newcomer of a plain reset),
    outside an elastic ``horovodrun``, or at a later ``init()`` (a reset).

    Raises:
        RuntimeError: the driver left this slot out of the job meanwhile.
    """
    global _first_init_done
    env = os.environ if environ is None else environ
    url, host, local_rank = store_url(env), env.get("HOROVOD_HOSTNAME"), env.get("HOROVOD_LOCAL_RANK")
    if _first_init_done or url is None or not host or local_rank is None:
        return False
    _first_init_done = True
    try:
        if _get(f"{url}/{SCOPE}/{MARKER}") is None:
            return False
        _put(f"{url}/{SCOPE}/{int(env.get('HOROVOD_RANK', '-1'))}")
        answer = _get(f"{url}/{RANK_SCOPE}/{host}:{int(local_rank)}", timeout_s=None)
        fields = answer.decode("ascii").split(",") if answer is not None else []
        slot = [int(x) for x in fields]
    except (OSError, ValueError) as exc:
        logger.warning("could not join the survivors' early start (%s); starting as launched", exc)
        return False
    if len(slot) != len(SLOT_VARIABLES):
        logger.warning("unexpected rank_and_size answer %r; starting as launched", answer)
        return False
    if slot[0] < 0:
        raise RuntimeError(f"{host}[{local_rank}] was removed from the elastic job before it joined")
    env.update({name: str(value) for name, value in zip(SLOT_VARIABLES, slot)})
    return True


def install(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Makes Horovod's ``init`` call :func:`join_early` first (see the module docstring).

    Wraps ``HorovodBasics.init``, which ``hvd.init()`` of every framework
    looks up when called. Only in workers of an elastic ``horovodrun``;
    returns True if installed.
    """
    if store_url(environ) is None:
        return False
    try:
        from horovod.common import basics
    except ImportError:
        return False
    original = basics.HorovodBasics.init
    if getattr(original, "elastic_ext_announces", False):
        return True

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        join_early()
        return original(self, *args, **kwargs)

    init.elastic_ext_announces = True  # type: ignore[attr-defined]
    basics.HorovodBasics.init = init
    return True


# ------------------------------------------------------------ survivor side


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
    removed, once the request failed, or after ``timeout_s``. Any of these
    makes the next commit reset the job.
    """

    def __init__(self, url: str, host: str, local_rank: int, poll: bool, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url, self.host, self.local_rank, self.poll = url, host, local_rank, poll
        self.timeout_s, self._clock = timeout_s, clock
        self.started = clock()
        self.next_rank: Optional[int] = None
        self.next_size: Optional[int] = None
        self.why = ""                   # why it is ready: "all_there", "removed", "error: ...", "timeout"
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
            # Blocks until every current rank asked (they all start at the same commit).
            answer = _get(f"{self.url}/{RANK_SCOPE}/{self.host}:{self.local_rank}", timeout_s=None)
            if answer is None:
                raise ValueError("no rank_and_size answer")
            self.next_rank, self.next_size = parse_slot(answer)
            if self.next_rank < 0:
                self.finish("removed")
                return
            _put(f"{self.url}/{SCOPE}/{MARKER}")  # before any newcomer's init: Python starts in seconds
            _put(f"{self.url}/{SCOPE}/{self.next_rank}")
            if not self.poll:
                return
            missing = set(range(self.next_size))
            while missing and not self._cancelled.is_set() and not self._ready.is_set():
                missing = {rank for rank in missing if _get(f"{self.url}/{SCOPE}/{rank}") is None}
                if missing:
                    time.sleep(POLL_S)
            if not missing:
                self.finish("all_there")
        except (OSError, ValueError) as exc:
            logger.warning("starting the newcomers early failed (%s); the next commit resets the job", exc)
            self.finish(f"error: {exc}")
