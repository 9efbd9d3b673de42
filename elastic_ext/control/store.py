"""The driver's rendezvous store as the launcher uses it: every scope and key, who writes and reads it, the requests.

Under ``elastic-horovodrun`` the driver's HTTP store (Horovod's rendezvous
server, ``/<scope>/<key>``) is also the launcher's message bus. Its scopes:

===================== ============================== ============================ ==========================
scope / key           meaning                        writer                       readers
===================== ============================== ============================ ==========================
``elastic_ext_round`` (:data:`ROUND_SCOPE`; cleared by Horovod at every round; HTTP writes refused)
``current``           the current round's number     driver (in process)          round_watch, driver_watch,
                                                                                  prestart (rank 0)
``assigned``          the round's ``host:lr`` slots  driver (in process)          keeper, driver_watch
``capacity_left_out`` ``1``: the round left a slot   driver (in process)          survivors at sync
                      out (early start at sync)
``failed_<r>``        ``host[lr]``: a member of      driver (in process)          round_watch (in init),
                      round r failed                                              driver_watch, prestart
``dismissed_<h>:<l>`` ``1``: a starting newcomer     driver (in process)          that newcomer
                      is dismissed
``elastic_ext_ready`` (:data:`READY_SCOPE`; writes carry the job's secret)
``early_start_asked`` ``1``: an early start's rank   survivors (prestart)         driver
                      requests complete this round
``early_start``       ``1``: survivors started the   survivors (prestart)         newcomers (first init)
                      newcomers early
``<rank>``            ``1``: that newcomer is ready  survivors, newcomers         rank 0 (prestart), driver
``elastic_ext_notice`` (:data:`NOTICE_SCOPE`; writes carry the secret or come from the named host)
``<host>``            the host has a preemption      a worker of that host        driver (noticed_hosts)
                      notice                         (notices)
``rank_and_size``     Horovod's: a GET asks for a    --                           workers (hvd.init,
                      rank in the next round                                      prestart)
``worker_addresses``  Horovod's: a worker's          workers (Horovod)            driver only; GETs 404
                      notification service and key
Gloo's scopes         ``global``, ``local_*``,       workers (Gloo)               workers (Gloo)
                      ``cross_*``: rendezvous
===================== ============================== ============================ ==========================

Writes that carry the job's secret send it in :data:`SECRET_HEADER`. The
launcher makes the secret (:func:`new_job_secret`) and hands it to each
worker on the stdin of its command (:mod:`elastic_ext.launch.worker_runs`,
:func:`receive_secret`), never on a command line (``ps`` shows those to
every user) nor in the environment (Horovod puts the workers' environment
on their command line). The server side is :mod:`elastic_ext.launch.store_guard`.

Every value read here is checked (:func:`checked`): a malformed one is
logged once and read as absent, so no watcher, ``hvd.init()`` or ``sync()``
fails on what another process wrote.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, IO, Optional, Set

logger = logging.getLogger(__name__)

ROUND_SCOPE = "elastic_ext_round"
CURRENT = "current"
ASSIGNED = "assigned"
CAPACITY_LEFT_OUT = "capacity_left_out"
READY_SCOPE = "elastic_ext_ready"
MARKER = "early_start"
ASKED = "early_start_asked"
NOTICE_SCOPE = "elastic_ext_notice"
RANK_SCOPE = "rank_and_size"
WORKER_ADDRESSES = "worker_addresses"
SECRET_HEADER = "X-Elastic-Ext-Secret"
SECRET_BYTES = 32
REQUEST_TIMEOUT_S = 10.0
PRESENT = b"1"  # the value of every key whose presence is its meaning

_SECRET_RE = re.compile(r"^[0-9a-f]{%d}$" % (2 * SECRET_BYTES))
_ROUND_RE = re.compile(rb"^[0-9]{1,18}$")
_SLOT_RE = re.compile(rb"^[^\s,:\[\]]{1,253}:[0-9]{1,9}$")
_FAILED_RE = re.compile(rb"^[^\s,:\[\]]{1,253}\[[0-9]{1,9}\]$")

# Direct, never through an http_proxy of the environment (no ProxyHandler): Gloo's own clients reach the
# store directly, and a proxy would see the job's secret. Plain HTTP only, no redirects: the store is the
# driver's rendezvous server. (build_opener would also make an HTTPS handler, whose SSL context loads the
# system's CA certificates: 20 ms of CPU in every process that imports this module.)
_opener = urllib.request.OpenerDirector()
for _handler in (urllib.request.UnknownHandler(), urllib.request.HTTPHandler(),
                 urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
    _opener.add_handler(_handler)
_secret: Optional[str] = None
_warned: Set[str] = set()
_warned_lock = threading.Lock()


def failed_key(round_id: int) -> str:
    """The key that exists once a member of round ``round_id`` failed."""
    return f"failed_{round_id}"


def dismissed_key(host: str, local_rank: int) -> str:
    """The key that exists once the driver dismissed the worker of slot ``host[local_rank]`` that is still starting."""
    return f"dismissed_{host}:{local_rank}"


# ------------------------------------------------------------------ the job's secret

def new_job_secret() -> str:
    """Makes this (the launcher's) process's secret for the job and returns it."""
    global _secret
    _secret = secrets.token_hex(SECRET_BYTES)
    return _secret


def job_secret() -> Optional[str]:
    """The job's secret in this process (the driver's, or the one its worker received); None without one."""
    return _secret


def set_job_secret(value: Optional[str]) -> None:
    """Sets (or, with None, forgets) this process's secret (the driver's tests)."""
    global _secret
    if value is not None and not _SECRET_RE.match(value):
        raise ValueError(f"a job secret must be {2 * SECRET_BYTES} lowercase hex digits, not {len(value)} characters")
    _secret = value


def secret_matches(sent: Optional[str]) -> bool:
    """True when ``sent`` (a request's :data:`SECRET_HEADER`) is this process's secret; compared in constant time."""
    own = _secret
    return own is not None and sent is not None and hmac.compare_digest(sent.encode("utf-8", "replace"),
                                                                         own.encode("ascii"))


def send_secret(stream: IO[bytes]) -> None:
    """Writes the job's secret as one line on ``stream`` (a worker command's stdin); nothing without one."""
    if _secret is not None:
        stream.write(_secret.encode("ascii") + b"\n")


def receive_secret(stream: Optional[IO[bytes]], expected: bool = True) -> bool:
    """In a worker: reads the line :func:`send_secret` wrote (stdin); False when there is none (a warning when
    one was ``expected``: the launcher's driver writes it)."""
    global _secret
    try:
        line = b"" if stream is None else stream.readline(4 * SECRET_BYTES)
    except (OSError, ValueError) as exc:
        line = b""
        logger.debug("no job secret on stdin: %s", exc)
    text = line.decode("ascii", "replace").strip()
    if not _SECRET_RE.match(text):
        (logger.warning if expected else logger.debug)("elastic_ext: this worker received no job secret from the launcher (%s): the driver refuses "
                       "its early-start and notice writes", "nothing on stdin" if not text else "a malformed line")
        return False
    _secret = text
    return True


# ------------------------------------------------------------------ reading and writing over HTTP

def _present(value: bytes) -> bool:
    return value == PRESENT


def _assigned(value: bytes) -> bool:
    return not value or all(_SLOT_RE.match(slot) for slot in value.split(b","))


def _validator(scope: str, key: str) -> Optional[Callable[[bytes], bool]]:
    """How a value of ``scope/key`` must look (None: not the launcher's to check)."""
    if scope == ROUND_SCOPE:
        if key == CURRENT:
            return lambda value: bool(_ROUND_RE.match(value))
        if key == ASSIGNED:
            return _assigned
        if key.startswith("failed_"):
            return lambda value: bool(_FAILED_RE.match(value))
        return _present  # capacity_left_out, dismissed_*
    if scope == READY_SCOPE:
        return _present
    return None


def _warn_once(kind: str, value: bytes) -> None:
    with _warned_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    logger.warning("elastic_ext: ignoring a malformed value %r of the driver's store key %s (read as absent; "
                   "further ones are not logged)", value[:80], kind)


def checked(scope: str, key: str, value: Optional[bytes]) -> Optional[bytes]:
    """``value`` of ``scope/key`` when it has the form its writer gives it; None (logged once) otherwise."""
    validate = _validator(scope, key)
    if value is None or validate is None or validate(value):
        return value
    kind = f"{key.split('_')[0]}_*" if key.startswith(("failed_", "dismissed_")) else "<rank>" if key.isdigit() else key
    _warn_once(f"{scope}/{kind}", value)
    return None


def parse_round(value: Optional[bytes]) -> Optional[int]:
    """A round number read from the store (``current``), or None for an absent or malformed one (logged once)."""
    value = checked(ROUND_SCOPE, CURRENT, value)
    return None if value is None else int(value)


def get(url: str, timeout_s: Optional[float] = REQUEST_TIMEOUT_S) -> Optional[bytes]:
    """A value of the store at ``url`` (``.../scope/key``), or None when the key is not there (404) or its value
    is malformed (:func:`checked`).

    Raises:
        OSError: the store could not be reached, or answered another error (``urllib.error.HTTPError``).
    """
    try:
        with _opener.open(url, timeout=timeout_s) as response:
            value = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    scope, key = (urllib.parse.urlsplit(url).path.split("/")[-2:] + ["", ""])[:2]
    return checked(scope, key, value)


def put(url: str, value: bytes = PRESENT, timeout_s: float = REQUEST_TIMEOUT_S) -> int:
    """Writes ``value`` at ``url`` with the job's secret (when this process has one); returns the HTTP status.

    Raises:
        OSError: the store could not be reached, or refused the write (``urllib.error.HTTPError``, e.g. 403).
    """
    request = urllib.request.Request(url, data=value, method="PUT")
    if _secret is not None:
        request.add_header(SECRET_HEADER, _secret)
    with _opener.open(request, timeout=timeout_s) as response:
        return response.status


# ------------------------------------------------------------------ the driver's side, in its own process

def server_of(driver: Any) -> Any:
    """The rendezvous HTTP server of Horovod's ``driver``, or None before it started."""
    return getattr(getattr(driver, "_rendezvous", None), "_httpd", None)


def write_local(driver: Any, scope: str, key: str, value: bytes) -> None:
    """Writes into ``driver``'s store in process (the only writer of :data:`ROUND_SCOPE`)."""
    server = server_of(driver)
    if server is None:
        return
    with server.cache_lock:
        server.cache.setdefault(scope, {})[key] = value


def keys_local(driver: Any, scope: str) -> Dict[str, bytes]:
    """The keys of ``scope`` in ``driver``'s store and their values, read in process ({} before it started)."""
    server = server_of(driver)
    if server is None:
        return {}
    with server.cache_lock:
        return dict(server.cache.get(scope, {}))


__all__ = ["ROUND_SCOPE", "CURRENT", "ASSIGNED", "CAPACITY_LEFT_OUT", "READY_SCOPE", "MARKER", "ASKED",
           "NOTICE_SCOPE", "RANK_SCOPE", "WORKER_ADDRESSES", "SECRET_HEADER", "PRESENT", "failed_key",
           "dismissed_key", "new_job_secret", "job_secret", "set_job_secret", "secret_matches", "send_secret",
           "receive_secret", "checked", "parse_round", "get", "put", "server_of", "write_local", "keys_local"]
