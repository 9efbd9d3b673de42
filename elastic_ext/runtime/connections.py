"""Which TCP connections belong to the collective library, and cutting only those.

When a collective fails on one rank, shutting down that rank's collective
connections makes every peer's pending collective fail at once (see
:mod:`elastic_ext.runtime.watchdog`). Only the collective library's (Gloo's)
connections may be cut: a checkpoint upload, a metrics logger or a data
reader of the same process must survive. They are recognised two ways:

- **by their peers** (:meth:`CollectiveConnections.learn_from_peers`): every
  rank allgathers its established connections as (local, remote) endpoint
  pairs; a connection whose mirror image (remote, local) is held by *another
  rank* of the job joins two ranks, so it is the collective library's. A
  connection to a server outside the job (or to this process itself) never
  has a mirror in another rank. This runs once per (re)start, just before
  the state sync, as one small allgather.
- **by their birth** (:meth:`before_init` / :meth:`after_init`): around
  ``hvd.shutdown(); hvd.init()`` in a reset, the connections that appeared
  are the new collective ones. This covers the window between a reset and
  the next peer exchange (a failure during the sync itself).

Connections are keyed by (fd, local address, remote address), so a
descriptor number reused by another socket after a reset is not mistaken for
an old collective connection. Under an MPI controller nothing is ever cut
(MPI's connections are its own business; ``run`` never calls :meth:`abort`).
"""

from __future__ import annotations

import logging
import os
import socket
import zlib
from typing import Any, Iterable, List, Optional, Set, Tuple

import numpy as np

from elastic_ext.config import horovod_rendezvous

logger = logging.getLogger(__name__)

Endpoint = Tuple[str, int]
Key = Tuple[int, Endpoint, Endpoint]  # fd, local, remote


def _normal_ip(ip: str) -> str:
    return ip[7:] if ip.startswith("::ffff:") else ip


_TCP_ESTABLISHED = 1  # tcp_info's first byte, tcpi_state (the kernel's TCP_ESTABLISHED)


def established(skip_ports: Optional[Set[int]] = None) -> List[Key]:
    """This process's established TCP connections, minus those to ``skip_ports``.

    Asks each of this process's sockets (``/proc/self/fd``), so the cost is
    this process's descriptors, not the machine's connections: psutil reads
    the whole ``/proc/net/tcp``, which on a host that has run many jobs
    holds thousands of closed connections, and this runs on a recovery's
    critical path. Where ``/proc/self/fd`` is missing, or a default socket
    timeout is set, psutil answers.
    """
    if skip_ports is None:
        rendezvous = horovod_rendezvous()
        skip_ports = {rendezvous[1]} if rendezvous else set()
    if socket.getdefaulttimeout() is not None:
        # Wrapping a descriptor in a socket object would then make it non-blocking, and that flag is
        # shared with the descriptor the process uses.
        return _established_by_psutil(skip_ports)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return _established_by_psutil(skip_ports)
    found = []
    for name in names:
        key = _tcp_established(int(name))
        if key is not None and key[2][1] not in skip_ports:
            found.append(key)
    return found


def _tcp_established(fd: int) -> Optional[Key]:
    """(fd, local, remote) if ``fd`` is an established TCP connection, else None."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return None
        copy = os.dup(fd)  # a second descriptor: closing it leaves the connection alone
    except OSError:  # closed meanwhile
        return None
    try:
        sock = socket.socket(fileno=copy)
    except OSError:  # a socket Python cannot wrap
        os.close(copy)
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != _TCP_ESTABLISHED:
            return None
        local, remote = sock.getsockname(), sock.getpeername()
    except OSError:  # not TCP, or no longer connected
        return None
    finally:
        sock.close()
    return fd, (_normal_ip(local[0]), local[1]), (_normal_ip(remote[0]), remote[1])


def _established_by_psutil(skip_ports: Set[int]) -> List[Key]:
    import psutil
    process = psutil.Process()
    # psutil >= 6 calls it net_connections; older releases only have connections.
    list_connections = getattr(process, "net_connections", None) or process.connections
    found = []
    for conn in list_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.fd < 0 or not conn.raddr or not conn.laddr:
            continue
        if conn.raddr.port in skip_ports:
            continue
        found.append((conn.fd, (_normal_ip(conn.laddr.ip), conn.laddr.port),
                      (_normal_ip(conn.raddr.ip), conn.raddr.port)))
    return found


def endpoint_id(endpoint: Endpoint) -> int:
    """A 48-bit number for an (ip, port) pair, for exchange in an int64 array."""
    return (zlib.crc32(endpoint[0].encode()) << 16) | (endpoint[1] & 0xFFFF)


def mirrored(mine: Iterable[Key], rank: int, table: np.ndarray) -> Set[Key]:
    """The connections in ``mine`` whose mirror (remote, local) another rank holds.

    ``table`` has rows ``[rank, local_id, remote_id]`` from every rank (rows
    with rank -1 are padding).
    """
    others = {(int(r[1]), int(r[2])) for r in table if int(r[0]) >= 0 and int(r[0]) != rank}
    return {key for key in mine if (endpoint_id(key[2]), endpoint_id(key[1])) in others}


class CollectiveConnections:
    """The collective library's connections of this process (see the module docstring)."""

    def __init__(self) -> None:
        self.known: Set[Key] = set()
        self._before: Optional[Set[Key]] = None
        self.in_round = False  # the known connections are those of the round this worker trains in

    def all_closed(self) -> bool:
        """True when this worker trains in a round whose every collective connection is closed.

        A collective of more than one rank cannot complete then: its peers
        failed and the collective library dropped the connections. False
        before the round's connections are learned (a reset ends the round),
        and in a world of one. An :meth:`abort` does not end the round: the
        driver watch cuts the links from its thread while the main thread may
        still wait in the collective.
        """
        if not self.in_round or not self.known:
            return False
        try:
            return not (set(established()) & self.known)
        except Exception:  # noqa: BLE001 - a check that cannot look says nothing
            logger.exception("cannot list TCP connections")
            return False

    def before_init(self) -> None:
        """Call right before Horovod (re)initialises."""
        self.in_round = False
        try:
            self._before = set(established())
        except Exception:  # noqa: BLE001 - bookkeeping must not fail a recovery
            logger.exception("cannot list TCP connections before the reset")
            self._before = None

    def after_init(self) -> None:
        """Call right after Horovod (re)initialised: what appeared is the collective library's."""
        if self._before is None:
            self.known = set()
            return
        try:
            self.known = set(established()) - self._before
        except Exception:  # noqa: BLE001
            logger.exception("cannot list TCP connections after the reset")
            self.known = set()
        self._before = None

    def learn_from_peers(self, binding: Any) -> int:
        """Collective (every rank at once): finds the connections that join this rank to another.

        Returns how many connections of this rank are the collective library's.
        Raises what the binding's allgather raises (a failed collective).
        """
        rank = binding.rank()
        mine = established()
        rows = [[rank, endpoint_id(k[1]), endpoint_id(k[2])] for k in mine] + [[-1, rank, 0]]
        table = binding.allgather(np.asarray(rows, dtype=np.int64), "elastic_ext.runtime.connections")
        self.known = mirrored(mine, rank, np.asarray(table).reshape(-1, 3))
        self.in_round = True
        logger.debug("[rank %d] %d of %d TCP connections are the collective library's",
                     rank, len(self.known), len(mine))
        return len(self.known)

    def abort(self, reason: str) -> int:
        """Shuts down (``shutdown(2)``, not close) the known collective connections still open.

        Returns how many were shut down. Never raises: detection must not
        turn into a second failure. The library still owns and closes the
        descriptors.
        """
        count = 0
        try:
            current = set(established())
            for fd, _, _ in current & self.known:
                try:
                    dup = socket.socket(fileno=os.dup(fd))
                except OSError:
                    continue
                try:
                    dup.shutdown(socket.SHUT_RDWR)
                    count += 1
                except OSError:
                    pass
                finally:
                    dup.close()
            left = sorted(f"{local[0]}:{local[1]}->{remote[0]}:{remote[1]}"
                          for _, local, remote in current - self.known)
            logger.warning("collective failed (%s): shut down %d collective connection(s) (of %d open) so that "
                           "every peer fails now%s", reason[:200], count, len(current),
                           f"; left open: {', '.join(left[:8])}" if left else "")
        except Exception:  # noqa: BLE001 - best effort; the failure is being handled already
            logger.exception("could not abort collective connections")
        return count
