"""The hosts a job's discovery has listed, and their addresses: who may reach the driver's store.

The driver's discovery (:class:`elastic_ext.launch.noticed_hosts.WithoutNoticed`,
which sees every answer) reports each listing to :data:`hosts`. The
store's guard (:mod:`elastic_ext.launch.store_guard`) serves a client
only from a loopback address, one of this machine's, or a resolved address
of a listed host; a preemption notice for a host comes from one of its
addresses or carries the job's secret; and the driver records notices only
for listed hosts. A name is resolved when it appears in a listing (again
when it reappears after leaving it); a host that left the listing stays
allowed, because its workers still read the store while they leave.
Resolution starts with the guard (:meth:`JobHosts.start`): elsewhere the
listing is only remembered.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import threading
from typing import Callable, Dict, FrozenSet, Iterable, Optional, Set

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4096)  # the store checks every connection's client: a job's few addresses
def normal(address: str) -> str:
    """``address`` without an IPv6 scope and as IPv4 when it is IPv4-mapped."""
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped or parsed)


@functools.lru_cache(maxsize=4096)
def _loopback(address: str) -> Optional[bool]:
    """True for a loopback address, False for another, None for what is no address."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return None


def resolve(host: str) -> FrozenSet[str]:
    """Every address ``host`` resolves to now (none, logged, when it does not)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        logger.warning("elastic_ext: host %r does not resolve (%s): the driver's store refuses its workers until "
                       "it does", host, exc)
        return frozenset()
    return frozenset(normal(info[4][0]) for info in infos)


def local_addresses() -> FrozenSet[str]:
    """The addresses of this machine's interfaces (workers on the driver's host connect from one of them)."""
    import psutil

    return frozenset(normal(address.address) for addresses in psutil.net_if_addrs().values()
                     for address in addresses if address.family in (socket.AF_INET, socket.AF_INET6))


class JobHosts:
    """The hosts the job's discovery has listed, and their addresses (those allowed to reach the store)."""

    def __init__(self, resolver: Callable[[str], FrozenSet[str]] = resolve) -> None:
        self.resolver = resolver
        self.resolving = False  # on in the launcher's driver (install): the tests of other modules resolve nothing
        self._lock = threading.Lock()
        self._names: Set[str] = set()
        self._last: Set[str] = set()
        self._addresses: Dict[str, FrozenSet[str]] = {}
        self._local: FrozenSet[str] = frozenset()

    def listed(self, names: Iterable[str]) -> None:
        """Discovery listed ``names`` (validated hosts): remember them, and resolve those new to the listing."""
        names = set(names)
        with self._lock:
            fresh, self._last = names - self._last, names
            self._names |= names
            resolving = self.resolving
        if resolving:
            self._resolve(fresh)

    def _resolve(self, names: Iterable[str]) -> None:
        found = {name: self.resolver(name) for name in sorted(names)}  # no lock held: a resolver may be slow
        with self._lock:
            for name, addresses in found.items():
                self._addresses[name] = self._addresses.get(name, frozenset()) | addresses

    def was_listed(self, name: str) -> bool:
        with self._lock:
            return name in self._names

    def addresses_of(self, name: str) -> FrozenSet[str]:
        with self._lock:
            return self._addresses.get(name, frozenset())

    def on_this_machine(self, address: str) -> bool:
        """True for a loopback address or one of this machine's."""
        address = normal(address)
        loopback = _loopback(address)
        if loopback is not False:
            return bool(loopback)
        with self._lock:
            return address in self._local

    def allowed(self, address: str) -> bool:
        """True for a client address that may reach the store: this machine's, or a listed host's."""
        address = normal(address)
        if self.on_this_machine(address):
            return True
        with self._lock:
            return any(address in found for found in self._addresses.values())

    def start(self, resolver: Optional[Callable[[str], FrozenSet[str]]] = None) -> None:
        """Starts resolving (the launcher's driver): this machine's addresses now, hosts as they are listed."""
        local = local_addresses()
        with self._lock:
            self.resolver = resolver or self.resolver
            self.resolving, self._local = True, local
            listed = set(self._names)
        self._resolve(listed)  # hosts listed before the guard started

    def forget(self) -> None:
        """Forgets the hosts listed so far (tests run several jobs in one process)."""
        with self._lock:
            self._names, self._last, self._addresses = set(), set(), {}

    def stop(self) -> None:
        """Stops resolving, and forgets (tests)."""
        self.forget()
        with self._lock:
            self.resolving, self._local, self.resolver = False, frozenset(), resolve


hosts = JobHosts()  # this (the driver's) process's job: its discovery feeds it (elastic_ext.launch.noticed_hosts)


__all__ = ["JobHosts", "hosts", "local_addresses", "normal", "resolve"]
