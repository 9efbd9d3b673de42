"""Ending a wait in ``hvd.init()`` for a peer that is already dead.

Horovod hands out a round's ranks, then its members connect through Gloo.
A member that dies in between leaves the others waiting inside the native
``hvd.init()`` until ``rendezvous_timeout_s`` (120 s by default); meanwhile
the job trains nowhere, and every further fault that lands in that window
adds a failure to the round (``bench.soak`` lost jobs that way).

``python -m elastic_ext.launch.horovodrun`` publishes in its rendezvous server's
store the current round's number and a key per round in which a member
failed (:data:`SCOPE`). While a worker whose keeper can restart it
(:mod:`elastic_ext.worker.keeper`) is inside ``hvd.init()``, a thread of
:func:`watch` reads that key for the worker's round and, once it is there,
aborts the process: the keeper restarts it and it asks for a rank in the
next round at once. Under plain ``horovodrun`` the keys never appear and
nothing happens.

Which round is the worker's: a worker's first ``hvd.init()`` is in the round
current when it starts (the driver starts it for that round); a reset's
``hvd.init()`` first records the worker as ready in the current round's
barrier, whose completion starts the next round, so it is the current one
plus one.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Mapping, Optional

from elastic_ext.config import elastic_horovodrun, horovod_rendezvous
from elastic_ext.errors import ConfigError
from elastic_ext.control import store
# The round keys (elastic_ext.control.store names every key of the store, its writer and its readers).
from elastic_ext.control.store import (ASSIGNED, CAPACITY_LEFT_OUT, CURRENT, dismissed_key,  # noqa: F401
                                      failed_key)

SCOPE = store.ROUND_SCOPE  # in the rendezvous server's store; cleared by Horovod at every new round
POLL_S = 0.25
# The whole job's round watches together read the store at most about this often: every worker of a
# reset watches at once, and at 1,024 workers reads every POLL_S would be 4,096 a second, more than the
# driver's one Python server answers while it serves the reset's own rendezvous (bench.control_plane).
JOB_READS_PER_S = 256.0
REQUEST_TIMEOUT_S = 2.0
_watching = 0  # round watches running in this process (guarded by _watching_lock)
_watching_lock = threading.Lock()


def get(url: str, timeout_s: Optional[float] = REQUEST_TIMEOUT_S) -> Optional[bytes]:
    """A value of the rendezvous server's store, or None when the key is not there (404) or is malformed
    (:func:`elastic_ext.control.store.get`, which every reader of the store goes through)."""
    return store.get(url, timeout_s)


def store_url(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The rendezvous server's URL when this process is a worker of an elastic ``horovodrun``, else None."""
    if not elastic_horovodrun(environ):
        return None
    try:
        rendezvous = horovod_rendezvous(environ)
    except ConfigError:
        return None  # not a port: no server to reach
    return None if rendezvous is None else f"http://{rendezvous[0]}:{rendezvous[1]}"


def _base_url(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    url = store_url(environ)
    return None if url is None else f"{url}/{SCOPE}"


def _read(key: str, environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The value of ``key`` in the driver's round scope; None when it is not there, when the store cannot
    be read, and outside the launcher."""
    base = _base_url(environ)
    if base is None:
        return None
    try:
        return get(f"{base}/{key}")
    except OSError:
        return None


def slot_assigned(environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """Whether this worker's slot is in the driver's current round (None: the driver does not say).

    A worker whose slot is not (its host removed or blacklisted) has nothing
    to restart for: Horovod starts a new worker if the slot comes back.
    """
    env = os.environ if environ is None else environ
    if not env.get("HOROVOD_HOSTNAME") or "HOROVOD_LOCAL_RANK" not in env:
        return None
    assigned = _read(ASSIGNED, env)
    if assigned is None:
        return None
    slot = f"{env['HOROVOD_HOSTNAME']}:{env['HOROVOD_LOCAL_RANK']}"
    return slot in assigned.decode("utf-8", "replace").split(",")


def capacity_left_out(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when the driver formed the current round without capacity it has (a failed worker's slot).

    The driver writes it before it answers any member's rank request, so
    every member of the round reads the same answer; False outside the
    launcher and when the store cannot be read.
    """
    return _read(CAPACITY_LEFT_OUT, environ) is not None


def poll_interval(size: Optional[int]) -> float:
    """How often a round watch reads in a job of about ``size`` workers (None: not known): every
    :data:`POLL_S`, or less often where the job's watches together would read more than
    :data:`JOB_READS_PER_S` (1 s at 256 workers, 4 s at 1,024: a dead member still ends the wait long
    before Gloo's timeout)."""
    return max(POLL_S, (size or 0) / JOB_READS_PER_S)


def watching() -> bool:
    """True while a :func:`watch` runs in this process (the worker waits in ``hvd.init()`` and its round
    watch reads the store)."""
    return _watching > 0


def watch(reset: bool, on_lost: Optional[Callable[[int], None]] = None, size: Optional[int] = None
          ) -> Callable[[], None]:
    """Starts watching this worker's round during an ``hvd.init()``; returns the function that stops it.

    ``reset``: this ``hvd.init()`` re-initialises (its round is the next
    one). ``on_lost(round_id)`` runs in the watching thread when a member of
    the round failed; by default :func:`abort` (SIGABRT, which the keeper
    restarts). ``size``: about how many workers the round has (it paces the
    reads: :func:`poll_interval`). Does nothing when the driver publishes no
    rounds.
    """
    global _watching
    current = store.parse_round(_read(CURRENT))
    if current is None:  # no launcher, or a value that is not a round (logged once): nothing to watch
        return lambda: None
    mine = current + (1 if reset else 0)
    lost = on_lost or abort
    stop = watch_key(f"{_base_url()}/{failed_key(mine)}", poll_interval(size), lambda: lost(mine),
                     "elastic_ext-round-watch")
    with _watching_lock:
        _watching += 1
    stopped = threading.Event()

    def stop_watch() -> None:
        global _watching
        stop()
        with _watching_lock:
            if not stopped.is_set():
                stopped.set()
                _watching -= 1

    return stop_watch


def watch_key(url: str, poll_s: float, on_present: Callable[[], None], name: str) -> Callable[[], None]:
    """Reads the store's key ``url`` every ``poll_s`` from a thread and calls ``on_present()`` there, once,
    when the key exists. Returns the function that stops the watch: once it has returned, ``on_present``
    does not run (it must not call that function itself). A read that fails is tried again."""
    stop, lock = threading.Event(), threading.Lock()

    def read() -> None:
        while not stop.wait(poll_s):
            try:
                present = get(url) is not None
            except OSError:
                continue
            if present:
                with lock:
                    if not stop.is_set():
                        on_present()
                return

    def stop_watch() -> None:
        with lock:
            stop.set()

    threading.Thread(target=read, name=name, daemon=True).start()
    return stop_watch


def abort(round_id: int) -> None:
    """Says why, and aborts the process."""
    print(f"elastic_ext: a member of round {round_id} died before the round formed; ending this worker's "
          f"hvd.init() now rather than at the rendezvous timeout (its keeper restarts it)", file=sys.stderr,
          flush=True)
    os.abort()
