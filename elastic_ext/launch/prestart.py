"""Scale-up without idle survivors: newcomers start while the survivors train.

Horovod's driver starts a new host's workers only once every current worker
has asked its rendezvous server for a rank, which ``hvd.init()`` does after
a reset. So by default the survivors stop at a host addition, re-initialise,
and then wait while the newcomers start Python, import the framework,
initialise Horovod and build their model (6 to 7 s on the test machine).

With ``ElasticConfig.prestart_newcomers`` a pure host addition does not
reset at once:

1. At the commit that agrees the addition, every rank sends the rank request
   of the next world from a background thread (:class:`Prestart`), the same
   HTTP request ``hvd.init()`` sends, and goes on training on the current
   Horovod context. Once every rank has asked, the driver starts the
   newcomers.
2. Horovod starts a newcomer with its rank in the environment; its first
   ``hvd.init()`` would go straight to Gloo's rendezvous, which the
   survivors, still training, would not join, and its script would build
   its model only after that. So :func:`install` (done at ``import
   elastic_ext``) wraps ``hvd.init()``: when the survivors' marker is in the
   rendezvous server's key-value store, a newcomer starts Horovod as a world
   of one (:func:`start_solo`; ``hvd.rank()``, ``hvd.size()`` and
   ``hvd.local_rank()`` still answer what it was launched with) and builds
   its model. At ``@elastic_ext.run`` (:func:`join`) it writes its rank
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

import functools
import logging
import os
import sys
import threading
import time
import types
import urllib.request
from typing import Any, Callable, Dict, Mapping, MutableMapping, Optional, Tuple

from elastic_ext.launch import keeper, round_watch
from elastic_ext.config import ENV_HOROVOD_RENDEZVOUS_ADDR, ENV_HOROVOD_RENDEZVOUS_PORT
from elastic_ext.launch.round_watch import store_url

logger = logging.getLogger(__name__)

SCOPE = "elastic_ext_ready"          # the store's scope of the announcements; the key is the rank
MARKER = "early_start"               # a key of SCOPE: the survivors started the newcomers early
RANK_SCOPE = "rank_and_size"         # Horovod's own scope: a GET records the worker as ready
POLL_S = 0.1
REQUEST_TIMEOUT_S = 10.0


def _put(url: str, value: bytes = b"1") -> None:
    request = urllib.request.Request(url, data=value, method="PUT")
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S):
        pass


def _get(url: str, timeout_s: Optional[float] = REQUEST_TIMEOUT_S) -> Optional[bytes]:
    """The value, or None when the key is not there (404)."""
    return round_watch.get(url, timeout_s)


# ------------------------------------------------------------ newcomer side

_first_init_done = False
_launch: Optional[Dict[str, str]] = None  # while a newcomer runs solo: the environment it was launched with
SLOT_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
RENDEZVOUS_VARIABLES = (ENV_HOROVOD_RENDEZVOUS_ADDR, ENV_HOROVOD_RENDEZVOUS_PORT)
QUERIES = dict(zip(("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"), SLOT_VARIABLES))
SOLO = dict(zip(SLOT_VARIABLES, ("0", "1", "0", "1", "0", "1")))


def early_start_under_way(environ: Optional[Mapping[str, str]] = None) -> bool:
    """At this process's first ``hvd.init()``: True if the survivors started the newcomers early.

    False at a later ``init()`` (a reset), at the job's first start, for a
    newcomer of a plain reset and outside an elastic ``horovodrun``.
    """
    global _first_init_done
    env = os.environ if environ is None else environ
    url = store_url(env)
    if _first_init_done or url is None or not env.get("HOROVOD_HOSTNAME") or "HOROVOD_RANK" not in env:
        return False
    _first_init_done = True
    try:
        return _get(f"{url}/{SCOPE}/{MARKER}") is not None
    except OSError as exc:
        logger.warning("could not reach the rendezvous server (%s); starting as launched", exc)
        return False


def start_solo(init: Callable[[], Any], environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Runs Horovod's ``init`` as a world of one, so that the script builds its model before it joins.

    Horovod's rank, size and local rank still answer what the newcomer was
    launched with (:func:`install` wraps them), and the global process set
    holds every launched rank, so ``DistributedOptimizer`` registers its
    hooks. :func:`join` later makes it a member of the real world.
    """
    global _launch
    env = os.environ if environ is None else environ
    launch = {k: env[k] for k in SLOT_VARIABLES + RENDEZVOUS_VARIABLES if k in env}
    env.update(SOLO)
    for name in RENDEZVOUS_VARIABLES:  # no rendezvous server: Gloo's in-memory store
        env.pop(name, None)
    try:
        init()
    finally:
        for name in SLOT_VARIABLES + RENDEZVOUS_VARIABLES:
            env.pop(name, None)
        env.update(launch)
    _launch = launch
    from horovod.common.process_sets import global_process_set
    global_process_set.ranks = list(range(int(launch["HOROVOD_SIZE"])))


def join(binding: Any, environ: Optional[Mapping[str, str]] = None) -> bool:
    """At ``@elastic_ext.run``, the model built: a newcomer running solo announces itself and joins.

    It writes its rank under :data:`SCOPE` and re-initialises Horovod
    (``binding.reset()``): Horovod's reset asks for this slot's rank, which
    waits until the survivors reset too. Returns False if not running solo.
    """
    global _launch
    if _launch is None:
        return False
    launch, _launch = _launch, None  # from here on, Horovod's own answers
    url = store_url(os.environ if environ is None else environ)
    try:
        if not keeper.restarts():  # only the newcomers of an early start are waited for
            _put(f"{url}/{SCOPE}/{int(launch['HOROVOD_RANK'])}")
    except (OSError, ValueError) as exc:
        logger.warning("could not announce this newcomer (%s); the survivors reset after their timeout", exc)
    binding.reset()
    return True


def _wrap_query(name: str, original: Callable[[Any], int]) -> Callable[[Any], int]:
    @functools.wraps(original)
    def query(self: Any) -> int:
        if _launch is not None:
            return int(_launch[QUERIES[name]])
        return original(self)

    return query


def install(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Wraps Horovod's ``init`` (see the module docstring) and its rank and size queries (:func:`start_solo`).

    Patches ``HorovodBasics``, which Horovod's own code calls through, and
    what the already imported ``horovod`` modules bound from it (``hvd.rank``
    is one). Only in workers of an elastic ``horovodrun``; returns True if
    installed.
    """
    if store_url(environ) is None:
        return False
    try:
        from horovod.common import basics
    except ImportError:
        return False
    cls = basics.HorovodBasics
    original = cls.init
    if getattr(original, "elastic_ext_wraps", None) is not None:
        return True

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        # A worker its keeper restarted starts solo too, and asks for a rank at @elastic_ext.runtime.run.
        global _first_init_done
        reset = _first_init_done
        restarted = keeper.restarts() > 0 and not reset
        solo = early_start_under_way() or restarted
        _first_init_done = True
        keeper.enter_init()
        # A restartable worker stops waiting for a peer that died (under python -m elastic_ext.launch.horovodrun).
        stop_watch = round_watch.watch(reset, keeper.lost_round) if keeper.active() and not solo else None
        try:
            result = start_solo(lambda: original(self, *args, **kwargs)) if solo else original(self, *args, **kwargs)
        except BaseException:
            keeper.leave_init(joined=False)
            raise
        finally:
            if stop_watch is not None:
                stop_watch()
        keeper.leave_init(joined=not solo)
        return result

    init.elastic_ext_wraps = original  # type: ignore[attr-defined]
    replaced = {original: init}
    cls.init = init
    for name in QUERIES:
        query = getattr(cls, name)
        replaced[query] = _wrap_query(name, query)
        setattr(cls, name, replaced[query])
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[0] != "horovod":
            continue
        for name in ("init", *QUERIES):
            bound = getattr(module, name, None)
            if isinstance(bound, types.MethodType) and bound.__func__ in replaced:
                setattr(module, name, types.MethodType(replaced[bound.__func__], bound.__self__))
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
