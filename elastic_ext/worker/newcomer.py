"""The newcomer's side of an early start: a world of one until ``@elastic_ext.run``, then the real one.

:func:`init` runs around Horovod's ``hvd.init()``, :func:`query` around its
rank and size queries (:mod:`elastic_ext.worker.horovod_changes` wraps
them). At this process's first ``init()``, when the survivors' marker is
in the rendezvous server's store (:mod:`elastic_ext.worker.prestart`), the
newcomer starts Horovod as a world of one (:func:`start_solo`) and builds
its model; at ``@elastic_ext.run`` it announces itself and joins the
survivors' next round (:func:`join`). A worker its keeper restarted starts
solo the same way (:mod:`elastic_ext.worker.keeper`).

Until it announces itself, a newcomer of an early start reads its slot's
dismissal in the store (:func:`watch_dismissal`): when a member of its
round fails while it starts, the driver may form the next round without
it (:mod:`elastic_ext.launch.driver`, change 4), and the newcomer then
exits at once with :data:`~elastic_ext.exit_codes.DISMISSED`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable, Dict, Mapping, MutableMapping, Optional

from elastic_ext.config import ENV_HOROVOD_RENDEZVOUS_ADDR, ENV_HOROVOD_RENDEZVOUS_PORT
from elastic_ext.exit_codes import DISMISSED
from elastic_ext.worker import keeper, round_watch
from elastic_ext.worker import prestart
from elastic_ext.worker.prestart import MARKER, SCOPE
from elastic_ext.worker.round_watch import store_url

logger = logging.getLogger(__name__)

_first_init_done = False
_round_size: Optional[int] = None  # the size the last hvd.init() gave (a reset's round watch paces itself by it)
_launch: Optional[Dict[str, str]] = None  # while a newcomer runs solo: the environment it was launched with
SLOT_VARIABLES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
RENDEZVOUS_VARIABLES = (ENV_HOROVOD_RENDEZVOUS_ADDR, ENV_HOROVOD_RENDEZVOUS_PORT)
QUERIES = dict(zip(("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"), SLOT_VARIABLES))
SOLO = dict(zip(SLOT_VARIABLES, ("0", "1", "0", "1", "0", "1")))
DISMISSAL_POLL_S = 0.1
_stop_dismissal_watch: Optional[Callable[[], None]] = None


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
        return prestart.get(f"{url}/{SCOPE}/{MARKER}") is not None
    except OSError as exc:
        logger.warning("could not reach the rendezvous server (%s); starting as launched", exc)
        return False


def start_solo(init: Callable[[], Any], environ: Optional[MutableMapping[str, str]] = None,
               hold_ranks: Optional[Callable[[int], None]] = None) -> None:
    """Runs Horovod's ``init`` as a world of one, so that the script builds its model before it joins.

    Horovod's rank, size and local rank still answer what the newcomer was
    launched with (:func:`query`), and the global process set
    holds every launched rank (``hold_ranks``, given the launched size), so
    ``DistributedOptimizer`` registers its hooks. :func:`join` later makes it a member of the real world.
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
    if hold_ranks is not None:
        hold_ranks(int(launch["HOROVOD_SIZE"]))


def watch_dismissal(environ: Optional[Mapping[str, str]] = None) -> bool:
    """In a newcomer of an early start: exits when the driver dismisses its slot, until :func:`stop_watching`.

    Reads the slot's :func:`~elastic_ext.worker.round_watch.dismissed_key`
    every :data:`DISMISSAL_POLL_S` from a thread. Only where the survivors'
    early-start marker is in the store (elsewhere the driver dismisses
    nobody). Returns True if watching.
    """
    global _stop_dismissal_watch
    env = os.environ if environ is None else environ
    url, host, local_rank = store_url(env), env.get("HOROVOD_HOSTNAME"), env.get("HOROVOD_LOCAL_RANK", "")
    if url is None or not host or not local_rank.isdigit() or _stop_dismissal_watch is not None:
        return False
    try:
        if prestart.get(f"{url}/{SCOPE}/{MARKER}") is None:
            return False
    except OSError:
        return False
    key = f"{url}/{round_watch.SCOPE}/{round_watch.dismissed_key(host, int(local_rank))}"

    def dismissed() -> None:  # not once stop_watching() returned: the newcomer is announcing itself
        print(f"elastic_ext: the driver dismissed this worker of {host}[{local_rank}] while it started: "
              f"a member of its round failed, and the others go on without waiting for this start; "
              f"the slot gets a new worker while they train", file=sys.stderr, flush=True)
        os._exit(DISMISSED)

    _stop_dismissal_watch = round_watch.watch_key(key, DISMISSAL_POLL_S, dismissed, "elastic_ext-dismissal")
    return True


def stop_watching() -> None:
    """Stops :func:`watch_dismissal`'s thread; once this returns, the process is not dismissed."""
    global _stop_dismissal_watch
    stop, _stop_dismissal_watch = _stop_dismissal_watch, None
    if stop is not None:
        stop()


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
    stop_watching()  # before it announces itself: the driver dismisses no newcomer that did
    url = store_url(os.environ if environ is None else environ)
    try:
        if not keeper.restarts():  # only the newcomers of an early start are waited for
            prestart.put(f"{url}/{SCOPE}/{int(launch['HOROVOD_RANK'])}")
    except (OSError, ValueError) as exc:
        logger.warning("could not announce this newcomer (%s); the survivors reset after their timeout", exc)
    binding.reset()
    return True


def wraps_init(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True in a worker of an elastic ``horovodrun``, where :func:`init` runs around Horovod's ``init``."""
    return store_url(environ) is not None


def query(name: str, original: Callable[[Any], int]) -> Callable[[Any], int]:
    """Horovod's rank or size query ``name`` (a key of :data:`QUERIES`) as a newcomer running solo answers it:
    with what it was launched with (:func:`start_solo`), Horovod's own answer otherwise."""
    @functools.wraps(original)
    def answer(self: Any) -> int:
        if _launch is not None:
            return int(_launch[QUERIES[name]])
        return original(self)

    return answer


def init(horovod_init: Callable[[], Any], local_rank: Callable[[], int], size: Callable[[], int],
         hold_ranks: Callable[[int], None]) -> Any:
    """Runs ``horovod_init`` (Horovod's ``init`` with its arguments) as this worker's ``hvd.init()`` must run.

    At the first ``init`` of a newcomer of an early start, or of a worker
    its keeper restarted, as a world of one (:func:`start_solo`): it asks
    for its rank at ``@elastic_ext.run``. Otherwise the dismissal watch
    stops first (it asks for its rank now), and a restartable worker stops
    waiting for a peer that died (the keeper's round watch). The keeper
    learns the init's end (``local_rank``: the local rank Horovod gave;
    ``size``: the size it gave, which paces the next reset's round watch;
    ``hold_ranks``: see :func:`start_solo`).
    :mod:`elastic_ext.worker.horovod_changes` wraps Horovod's ``init`` with it.
    """
    global _first_init_done, _round_size
    reset = _first_init_done
    restarted = keeper.restarts() > 0 and not reset
    solo = early_start_under_way() or restarted
    _first_init_done = True
    if not solo:
        stop_watching()  # it asks for its rank now
    keeper.enter_init()
    stop_watch = round_watch.watch(reset, keeper.lost_round, _round_size or launched_size()) \
        if keeper.active() and not solo else None
    try:
        result = start_solo(horovod_init, hold_ranks=hold_ranks) if solo else horovod_init()
    except BaseException:
        keeper.leave_init(joined=False)
        raise
    finally:
        if stop_watch is not None:
            stop_watch()
    keeper.leave_init(joined=not solo, local_rank=None if solo else local_rank())
    if not solo:
        _round_size = size()
    return result


def launched_size(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The job's size when the driver launched this worker (``HOROVOD_SIZE``); None when not given."""
    value = (os.environ if environ is None else environ).get("HOROVOD_SIZE", "")
    return int(value) if value.isdigit() else None
