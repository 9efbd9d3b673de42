"""Gloo's full-mesh rendezvous in one request per rank: the driver's side of build patch 08.

Gloo's ``Context::connectFullMesh`` through Horovod's ``HTTPStore`` (Horovod
0.28.1 as released) costs each of N ranks one GET per lower rank for its host
name, a PUT of its N-1 pair addresses, then per peer a wait (GETs every
10 ms) and a GET of the peer's whole value: about N^2 requests a context
through the driver's one Python server, and every rank reads every value
(N^3 bytes in all). A reset runs six such contexts (three with build patch 09): at 1,024 workers hours
(``bench/README.md``, "The control plane at scale").

With ``tools/horovod_patches/08-gloo-full-mesh-in-one-compact-request.patch`` and
``HOROVOD_GLOO_FULL_MESH_EXCHANGE=1`` in its environment (set by
``elastic-horovodrun`` where the build carries the patch: Horovod's own
server does not answer it), a rank sends one request a context:
``PUT <scope>/_mesh_<rank>_<size>_<item>`` with its host name, a newline and
its pair addresses (``item`` bytes each, one per other rank in rank order)
in compact form (:func:`compact`: the first whole, then of each the bytes
where any differs from it; a rank's TCP pair addresses differ only in their
port). :func:`exchange` keeps its host name under Gloo's own key
(``rank_<rank>``) and its addresses compact under ``_mesh_<rank>`` (a
reader of Gloo's own protocol reading ``<rank>`` gets them whole,
:func:`whole`), and, once every rank of ``size`` has
published, answers with the rank's local rank (lower ranks with the same
host name), a newline, and of every other rank's addresses the one made for
this rank, compact too (the offsets where any of the context's addresses
differ from the first: port and host address). N requests a context, about
``2 N`` bytes each way per rank for Gloo's TCP transport, ``6 N`` back where
every host has its own address, instead of ``136 N``. The store's loop holds the request meanwhile,
without a thread (:mod:`elastic_ext.launch.store_loop`), at most
:data:`HOLD_S`; the rank asks again on a 404. The rank then sends no ``DELETE`` at the
context's finalize (Gloo's own path sends one per rank, which lets the
server drop the scope's values once every rank has connected): the values
stay in the cache until the driver's next round clears it, about
``K N^2`` bytes for a round's global context (2.2 MB at 1,024 ranks for
Gloo's TCP addresses, K = 2; whole, they were 142 MB), and a rank whose
answer was lost can still ask again. While a context lasts, its answers
are cut from an array of the few bytes where addresses may differ (6 MB at
1,024 ranks for K = 6).
"""

from __future__ import annotations

import queue
import re
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

from elastic_ext.launch.gloo_compact import Packed, compact, expand, head, unpack

PATCH = "08-gloo-full-mesh-in-one-compact-request"
ENV = "HOROVOD_GLOO_FULL_MESH_EXCHANGE"
PREFIX = "_mesh_"
HOLD_S = 5.0        # a request waits this long for the last ranks, then is answered 404 and asked again
MAX_SIZE = 1 << 16  # ranks of one context
MAX_ITEM = 4096     # bytes of one pair address (Gloo's TCP transport: 136)
MAX_ADDRESS_BYTES = 1 << 20  # a rank's addresses expanded: no more than the store takes in one body (1 MiB)

_KEY = re.compile(r"_mesh_(\d{1,6})_(\d{1,6})_(\d{1,5})")
_RANK = re.compile(r"[0-9]{1,6}")  # Gloo's key of a rank's addresses
_state_lock = threading.Lock()


class _Context:
    """One context's exchange in one scope of the cache (``values``, the dict Horovod's store keeps for it).

    Each rank's addresses are kept as published, in compact form (:class:`Packed`), and the offsets where
    any may differ from the first address published are noted (its own offsets, and where its first address
    differs). When the last rank publishes, only those bytes (a port and a host address: a few of the 136)
    of every rank's addresses are gathered into ``columns``: ``columns[c, p]`` is rank p's address at its
    index c, cut to those offsets, and rank r's answer is ``columns[r - 1, :r]`` (its lower peers, who hold
    r's address at index r - 1) followed by ``columns[r, r + 1:]`` (its higher peers, at index r), two
    contiguous runs cut in one copy each. No address is ever made whole here. Dropped once every rank is
    answered; a rank asking again after that (its answer lost) finds its peers' values still in ``values``,
    from which a new context is made.
    """

    def __init__(self, values: Dict[str, bytes], size: int, item: int) -> None:
        import numpy  # (a dependency of the package; imported by the first exchange only)

        self.values, self.size, self.item = values, size, item
        self._numpy = numpy
        self.packed: Dict[int, Packed] = {}  # each published rank's addresses
        self.columns: Any = None  # (size - 1, size, offsets) bytes, once every rank has published
        self.first: Any = None  # the first published address
        self.differs = numpy.zeros(item, dtype=bool)  # where any published address may differ from it
        self.offsets: Any = None  # those offsets, once every rank has published
        self.head = b""  # every answer's count of offsets, offsets and first address, once all have published
        self.published: Set[int] = set()
        self.local_ranks: Optional[List[int]] = None  # set when every rank has published
        self.waiting: Dict[int, Callable[[bytes], None]] = {}  # the requests not answered yet, by rank
        self.answered: Set[int] = set()
        for peer in range(size):
            kept = _kept(values, peer)
            if kept is not None and kept[:2] == (size, item):
                self.publish(peer, unpack(kept[2], size - 1, item, f"rank {peer}") if size > 1 else None)

    def publish(self, rank: int, packed: Optional[Packed]) -> bool:
        """Takes ``rank``'s addresses (None for a context of one rank); True when this made the context complete
        (its answers are ready)."""
        numpy = self._numpy
        if self.local_ranks is not None:  # complete already: a rank asking again gets the answer it had
            return False
        if packed is not None:
            self.packed[rank] = packed
            if self.first is None:
                self.first = packed.first.copy()
            self.differs |= packed.first != self.first
            self.differs[packed.offsets] = True
        self.published.add(rank)
        if len(self.published) < self.size:
            return False
        seen: Dict[bytes, int] = {}
        local_ranks = []
        for peer in range(self.size):  # the lower ranks with the same host name
            host = self.values.get(f"rank_{peer}", b"")
            local_ranks.append(seen.get(host, 0))
            seen[host] = local_ranks[-1] + 1
        self.local_ranks = local_ranks
        if self.size > 1:
            self.offsets = numpy.flatnonzero(self.differs)
            self.head = head(self.offsets, self.first)
            self.columns = numpy.empty((self.size - 1, self.size, len(self.offsets)), dtype=numpy.uint8)
            for peer, packed in self.packed.items():
                rows = self.columns[:, peer]
                rows[:] = packed.first[self.offsets]
                rows[:, numpy.searchsorted(self.offsets, packed.offsets)] = packed.rows
            self.packed = {}
        return True

    def answer(self, rank: int) -> bytes:
        """Rank ``rank``'s answer: its local rank, a newline, and the address each other rank made for it, in
        compact form against the context's first address (:func:`compact`)."""
        assert self.local_ranks is not None
        parts = [b"%d\n" % self.local_ranks[rank], self.head]
        if rank > 0:  # its lower peers hold its address at their index rank - 1
            parts.append(self.columns[rank - 1, :rank].tobytes())
        if rank < self.size - 1:  # its higher peers at their index rank
            parts.append(self.columns[rank, rank + 1:].tobytes())
        return b"".join(parts)


def _kept(values: Dict[str, bytes], rank: int) -> Optional[Tuple[int, int, bytes]]:
    """(size, item, compact addresses) of ``rank``'s exchange as :func:`exchange` keeps it in ``values``."""
    kept = values.get(f"{PREFIX}{rank}")
    if kept is None:
        return None
    shape, _, data = kept.partition(b"\n")
    size, item = (int(part) for part in shape.split(b"_"))
    return size, item, data


def whole(server: Any, scope: str, key: str) -> Optional[bytes]:
    """Gloo's own value at ``scope/key`` for a reader of its protocol: a rank's addresses whole, made from its
    exchange (the cache keeps them compact), or None where ``key`` is not an exchanged rank's."""
    if not _RANK.fullmatch(key):  # (not str.isdigit: it takes other scripts' digits, which int() refuses)
        return None
    with server.cache_lock:
        kept = _kept(server.cache.get(scope, {}), int(key))
    return None if kept is None else expand(kept[2], kept[0] - 1, kept[1], f"{scope}/{key}")


def is_exchange(key: str) -> bool:
    return key.startswith(PREFIX)


class Request(NamedTuple):
    """One rank's exchange, checked: what :func:`exchange` stores and answers."""
    rank: int
    size: int
    item: int
    host: bytes
    addresses: bytes  # in compact form, as sent
    packed: Optional[Packed]  # the same, checked (None for a context of one rank)


def parse(key: str, body: bytes, ranks: Optional[int]) -> Request:
    """The exchange a ``_mesh_`` key and its body ask for, in a round of ``ranks`` ranks (None: no round is
    open): no context of the round has more ranks than the round, so none may make the store hold more.

    Raises:
        ValueError: the key is not ``_mesh_<rank>_<size>_<item>`` with 0 <= rank < size <= MAX_SIZE,
            0 < item <= MAX_ITEM, size <= ranks and (size - 1) * item <= MAX_ADDRESS_BYTES (what one body
            could carry whole before the compact form), or the body is not a host name, a newline and
            size - 1 addresses of item bytes in :func:`compact` form.
    """
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"key {key[:80]!r} is not _mesh_<rank>_<size>_<item bytes>")
    rank, size, item = (int(group) for group in match.groups())
    if not (0 <= rank < size <= MAX_SIZE and 0 < item <= MAX_ITEM):
        raise ValueError(f"key {key!r}: expected 0 <= rank < size <= {MAX_SIZE} and 0 < item bytes <= {MAX_ITEM}")
    if ranks is None or size > ranks:
        raise ValueError(f"key {key!r}: {size} ranks, but " + (
            "no round is open" if ranks is None else f"the round has {ranks}"))
    if (size - 1) * item > MAX_ADDRESS_BYTES:  # a few compact bytes must not make the store hold more
        raise ValueError(f"key {key!r}: {size - 1} addresses of {item} bytes exceed the {MAX_ADDRESS_BYTES} bytes "
                         "a rank's addresses may take")
    host, newline, addresses = body.partition(b"\n")
    if not newline:
        raise ValueError(f"{key}: expected a host name, a newline and compact addresses, got {len(body)} bytes "
                         "without a newline")
    if size == 1:
        expand(addresses, 0, item, key)  # (checks that it holds no address)
        return Request(rank, size, item, host, addresses, None)
    return Request(rank, size, item, host, addresses, unpack(addresses, size - 1, item, key))


def round_ranks(server: Any) -> Optional[int]:
    """The ranks of the round Horovod's rendezvous server has open (its ``init``), None before one."""
    return getattr(server, "scope_size", {}).get("global")


def _contexts(server: Any) -> Dict[str, _Context]:
    """The server's contexts by scope (changed only under its cache lock)."""
    with _state_lock:
        return server.__dict__.setdefault("_elastic_ext_mesh", {})


def exchange(server: Any, scope: str, request: Request, answer: Callable[[bytes], None]) -> None:
    """Stores a rank's host name and addresses in ``scope`` of ``server``'s cache, and calls ``answer`` with
    its answer (``b"<local rank>\\n"`` and the addresses meant for it) once every rank has published: at
    once if they have, else from the call of the last rank to publish. A request that is answered no other
    way (its hold ends, its context is dropped by a new round) is the caller's to answer 404.
    """
    rank, size, item = request.rank, request.size, request.item
    contexts = _contexts(server)
    with server.cache_lock:
        values = server.cache.setdefault(scope, {})
        values[f"rank_{rank}"] = request.host
        values[f"{PREFIX}{rank}"] = b"%d_%d\n" % (size, item) + request.addresses  # (not Gloo's key: see whole)
        context = contexts.get(scope)
        if context is None or context.values is not values or (context.size, context.item) != (size, item):
            context = contexts[scope] = _Context(values, size, item)  # the round's first (init cleared the cache)
        context.waiting[rank] = answer  # (a rank asking again replaces its earlier request, answered 404)
        if not context.publish(rank, request.packed) and context.local_ranks is None:
            return
        waiting, context.waiting = context.waiting, {}
        context.answered.update(waiting)
        if len(context.answered) == size and contexts.get(scope) is context:
            del contexts[scope]  # every rank has its answer: the values stay in the cache until the next round
    for peer_rank, reply in waiting.items():
        reply(context.answer(peer_rank))


def exchange_waiting(server: Any, scope: str, request: Request) -> Optional[bytes]:
    """:func:`exchange` for a caller on a thread of its own: its answer, or None after :data:`HOLD_S`."""
    answers: "queue.SimpleQueue[bytes]" = queue.SimpleQueue()
    exchange(server, scope, request, answers.put)
    try:
        return answers.get(timeout=HOLD_S)
    except queue.Empty:
        return None


__all__ = ["ENV", "HOLD_S", "MAX_ADDRESS_BYTES", "PATCH", "PREFIX", "Request", "compact", "exchange", "exchange_waiting",
           "expand", "is_exchange", "parse", "round_ranks", "whole"]
