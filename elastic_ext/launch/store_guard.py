"""The driver's rendezvous server under the launcher: who may connect, and what each request may read or write.

Horovod's rendezvous server listens on every interface with no
authentication, unpickles every PUT to ``worker_addresses`` and answers a
GET of it with the worker's notification-service key. :func:`changes`
(made in ``elastic-horovodrun``'s driver by :mod:`elastic_ext.launch.horovod_changes`)
change that, in this process:

1. **Clients** (of an elastic job's server; a static job has no
   discovery to list its hosts, and its store loads no pickle): a
   connection is served only from a loopback address, an
   address of this machine, or a resolved address of a host the job's
   discovery has listed (:data:`elastic_ext.launch.job_hosts.hosts`,
   resolved when it first appears in a listing, and again when it
   reappears). Others are closed unanswered.
   A host that left discovery stays allowed: its workers still read the
   store while they leave, and a worker that cannot reach it fences itself
   (:mod:`elastic_ext.runtime.driver_watch`).
2. **No pickle from the network**: a PUT to ``worker_addresses`` is
   decoded by an unpickler that refuses every global (Horovod's legitimate
   value is a tuple of a dict, lists, tuples, str, int and bytes, which
   needs none), checked for that shape, and registered with the driver;
   anything else is answered 400. Only the addresses at the client's own
   are registered (:func:`own_addresses`), and the driver loads its
   service's answers, signed with the key the registering client chose,
   with Horovod's three answer classes allowed and no other global
   (:mod:`elastic_ext.launch.worker_clients`, the clients of the launcher's
   driver, :mod:`elastic_ext.launch.driver`). The value is not kept, and
   a GET of that scope is answered 404: the workers' keys are never
   readable.
3. **The launcher's keys**: an HTTP PUT or DELETE of
   :data:`~elastic_ext.control.store.ROUND_SCOPE` is refused (403; only the
   driver writes it, in process); one of
   :data:`~elastic_ext.control.store.READY_SCOPE` needs the job's secret
   (:data:`~elastic_ext.control.store.SECRET_HEADER`), one of
   :data:`~elastic_ext.control.store.NOTICE_SCOPE` the secret or to come
   from an address of the host it names.
4. **Bodies** are at most :data:`MAX_BODY_BYTES` (413 above; Gloo's largest
   value, every pair address of a rank, is about 140 bytes per rank, 2 in
   the exchange's compact form, which may expand to no more than that limit
   and to no more ranks than the open round's:
   :func:`~elastic_ext.launch.gloo_exchange.parse`).

Everything else (Gloo's scopes, ``rank_and_size``) is Horovod's, for the
clients of rule 1; a PUT of a Gloo scope's ``_mesh_`` key is Gloo's
rendezvous of one rank in one request (:mod:`elastic_ext.launch.gloo_exchange`).
``docs/launching.md`` ("Trust boundary") says what this leaves to a firewall.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import pickle
import urllib.parse
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from elastic_ext.control import store
from elastic_ext.launch import gloo_exchange, held_ranks
from elastic_ext.launch.job_hosts import hosts, normal
from elastic_ext.launch.store_requests import PlainHead
from elastic_ext.control.horovod_seam import Change

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
LOGGED_REFUSALS = 256  # distinct refusals logged; an attacker's flood is not copied into the log

_refusals_logged: Set[Tuple[str, str, int]] = set()


class Refused(Exception):
    """A request the store does not serve: the status to answer and why."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class _NoGlobals(pickle.Unpickler):
    """An unpickler that builds only what needs no global: containers, str, bytes and numbers."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def _addresses_shape(addresses: Any) -> bool:
    return isinstance(addresses, dict) and all(
        isinstance(nic, str) and isinstance(pairs, (list, tuple)) and all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and type(pair[1]) is int
            for pair in pairs) for nic, pairs in addresses.items())


def own_addresses(addresses: Dict[str, Any], client: str) -> Dict[str, Any]:
    """The pairs of ``addresses`` at the client's own address (any of this machine's for a client on it).

    The driver connects to a registered worker's service and reads its
    pickled answers, authenticated with the key that came with the
    addresses: an address of another machine would make the driver load
    whatever that machine answers.
    """
    local = hosts.on_this_machine(client)
    kept = {nic: [pair for pair in pairs if normal(pair[0]) == normal(client) or
                  (local and hosts.on_this_machine(pair[0]))] for nic, pairs in addresses.items()}
    return {nic: pairs for nic, pairs in kept.items() if pairs}


def worker_addresses(key: str, value: bytes, client: str) -> Tuple[str, int, Dict[str, Any], bytes]:
    """(host, local rank, addresses, secret key) of a worker's ``worker_addresses`` PUT from ``client``, never
    unpickling a global; only the addresses at the client's own (:func:`own_addresses`).

    Raises:
        Refused: (400) the key is not ``host:local_rank``, the value is not base64 of a pickled
            ``(addresses, key)`` made of builtins only, or it names no address of the client's.
    """
    host, _, local_rank = key.partition(":")
    if not host or not local_rank.isdigit() or len(local_rank) > 9:
        raise Refused(400, f"worker_addresses key {key[:80]!r} is not host:local_rank")
    try:
        decoded = _NoGlobals(io.BytesIO(base64.b64decode(value, validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, OverflowError, RecursionError, MemoryError) as exc:
        raise Refused(400, f"worker_addresses value refused: {type(exc).__name__}: {str(exc)[:120]}") from None
    if not (isinstance(decoded, tuple) and len(decoded) == 2 and _addresses_shape(decoded[0])
            and isinstance(decoded[1], bytes)):
        raise Refused(400, "worker_addresses value is not (addresses, key)")
    addresses = own_addresses(decoded[0], client)
    if not addresses:
        raise Refused(400, f"worker_addresses value names no address of its client {client}")
    return host, int(local_rank), addresses, decoded[1]


def _parts(path: str) -> Optional[Tuple[str, str]]:
    parts = path.split("/")
    return (parts[1], parts[2]) if len(parts) == 3 else None  # else Horovod answers 400


def refusal(method: str, scope: str, key: str, client: str, secret: Optional[str]) -> Optional[Refused]:
    """Why a PUT or DELETE of ``scope/key`` from ``client`` with ``secret`` is refused (rule 3), or None."""
    if scope == store.ROUND_SCOPE:
        return Refused(403, f"{method} of {scope} refused: only the driver writes it")
    if scope not in (store.READY_SCOPE, store.NOTICE_SCOPE) or store.secret_matches(secret):
        return None
    if scope == store.NOTICE_SCOPE and normal(client) in hosts.addresses_of(urllib.parse.unquote(key)):
        return None
    return Refused(403, f"{method} of {scope}/{key[:80]} refused: no job secret"
                        f"{'' if scope == store.READY_SCOPE else ' and not from that host'}")


def _body_refusal(length: Optional[str]) -> Optional[Refused]:
    if length is None or not length.strip().isdigit():
        return Refused(400, f"Content-Length {length!r} is not a byte count")
    if int(length) > MAX_BODY_BYTES:
        return Refused(413, f"Content-Length {length.strip()[:20]} exceeds {MAX_BODY_BYTES}")
    return None


_guarded: Dict[type, type] = {}


def guarded(handler_cls: type) -> type:
    """``handler_cls`` (Horovod's rendezvous handler) with rules 2 to 4 of the module docstring."""
    if handler_cls in _guarded:
        return _guarded[handler_cls]

    class Guarded(PlainHead, handler_cls):  # type: ignore[misc, valid-type]
        def _refuse(self, refused: Refused) -> None:
            entry = (self.client_address[0], str(refused)[:40], refused.status)
            if len(_refusals_logged) < LOGGED_REFUSALS and entry not in _refusals_logged:
                _refusals_logged.add(entry)
                logger.warning("elastic_ext: the driver's store answers %d to %s %s from %s: %s", refused.status,
                               self.command, self.path[:120], self.client_address[0], refused)
            self.close_connection = True  # the body, if any, is left unread
            self.send_status_code(refused.status)

        def _checked(self, method: str) -> bool:
            parts = _parts(self.path)
            refused = None if parts is None else refusal(method, *parts, self.client_address[0],
                                                         self.headers.get(store.SECRET_HEADER))
            if refused is None and method == "PUT":
                refused = _body_refusal(self.headers.get("Content-Length"))
            if refused is not None:
                self._refuse(refused)
            return refused is None

        def do_GET(self) -> None:
            scope, key = _parts(self.path) or ("", "")
            if scope == store.RANK_SCOPE and getattr(self.request, "defer", None) is not None:
                held_ranks.serve(self, key)  # held on the store's loop, not on a thread
                return
            if scope == store.WORKER_ADDRESSES:
                self.send_status_code(404)  # a worker's key is the driver's only
                return
            value = gloo_exchange.whole(self.server, scope, key)  # a rank's addresses, kept compact
            if value is None:
                super().do_GET()
            else:
                self._send_value(value)

        HELD_SCOPES = held_ranks.HELD_SCOPES  # the store's loop gives them no thread (store_loop)

        def _send_value(self, value: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(value)))
            self.end_headers()
            self.wfile.write(value)

        def do_PUT(self) -> None:
            if not self._checked("PUT"):
                return
            scope, key = _parts(self.path) or ("", "")
            if gloo_exchange.is_exchange(key):
                self._exchange(scope, key)
                return
            try:
                super().do_PUT()
            except Refused as refused:  # from _put_value, before any answer was sent
                self._refuse(refused)

        def _exchange(self, scope: str, key: str) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))  # (checked: at most MAX_BODY_BYTES)
            try:
                request = gloo_exchange.parse(key, body, gloo_exchange.round_ranks(self.server))
            except ValueError as exc:
                self._refuse(Refused(400, str(exc)))
                return
            defer = getattr(self.request, "defer", None)  # the store's loop holds it without a thread
            if defer is not None:  # answered 404 if not every rank has published by the hold's end: asked again
                answer = defer(gloo_exchange.HOLD_S, lambda: (404, b""))
                gloo_exchange.exchange(self.server, scope, request, lambda value: answer(200, value))
                return
            value = gloo_exchange.exchange_waiting(self.server, scope, request)
            if value is None:
                self.send_status_code(404)
                return
            self._send_value(value)

        def do_DELETE(self) -> None:
            if self._checked("DELETE"):
                super().do_DELETE()

        def _put_value(self, scope: str, key: str, value: bytes) -> None:
            if scope == store.WORKER_ADDRESSES and hasattr(self, "_put_worker_addresses"):
                registration = worker_addresses(key, value, self.client_address[0])
                try:
                    self._put_worker_addresses(*registration)
                except Exception as exc:  # noqa: BLE001 - Horovod's client: no service answered as one (logged)
                    raise Refused(400, f"no worker service answered at {registration[2]}: {exc}"[:300]) from None
                return  # not kept: nothing reads it back
            super()._put_value(scope, key, value)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{handler_cls.__name__}"
    _guarded[handler_cls] = Guarded
    return Guarded


def changes(resolver: Optional[Callable[[str], FrozenSet[str]]] = None) -> List[Change]:
    """What guards this (the driver's) process's rendezvous servers as the module docstring says, for
    :func:`elastic_ext.launch.horovod_changes.install_launcher` to make.

    Makes the job's secret (:func:`elastic_ext.control.store.new_job_secret`) if this process has none,
    and starts following the job's hosts.
    ``resolver``: host name -> addresses (tests; default :func:`elastic_ext.launch.job_hosts.resolve`).
    """
    from horovod.runner.http.http_server import RendezvousHTTPServer, RendezvousServer

    if store.job_secret() is None:
        store.new_job_secret()
    hosts.start(resolver)
    original_start = RendezvousServer.start

    def start(self: Any, handler_cls: Any = None) -> Any:
        from horovod.runner.http.http_server import RendezvousHandler
        return original_start(self, guarded(handler_cls or RendezvousHandler))

    def verify_request(self: Any, request: Any, client_address: Any) -> bool:
        if not hasattr(self.RequestHandlerClass, "_put_worker_addresses") or hosts.allowed(str(client_address[0])):
            return True  # (a static job's store: no discovery lists its hosts, and it loads no pickle)
        entry = (str(client_address[0]), "connection", 0)
        if len(_refusals_logged) < LOGGED_REFUSALS and entry not in _refusals_logged:
            _refusals_logged.add(entry)
            logger.warning("elastic_ext: the driver's store closes a connection from %s: not an address of the "
                           "job's hosts", client_address[0])
        return False

    return [(RendezvousServer, "start", start), (RendezvousHTTPServer, "verify_request", verify_request)]


__all__ = ["MAX_BODY_BYTES", "Refused", "changes", "guarded", "own_addresses", "refusal",
           "worker_addresses"]
