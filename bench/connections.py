"""Listing a worker's established TCP connections: its own sockets against psutil's /proc/net/tcp.

Run from the repository root: ``.venv/bin/python -m bench.connections``.

A recovery lists the worker's established connections four times on its
critical path (the abort, before and after ``hvd.init``, the peers'
exchange; elastic_ext/runtime/connections.py). psutil reads the machine's
whole ``/proc/net/tcp``, whose length is every connection of the network
namespace, closed ones in TIME_WAIT included; the launcher's rendezvous
store alone leaves one per HTTP request of every worker. This process holds
what a worker of a 4-worker job holds (``--pairs`` established pairs, a
listening socket), then makes ``--closed`` connections to itself and closes
them, so that many sit in TIME_WAIT, as on a host that just re-formed a job
(``0`` adds none). Each way lists ``--rounds`` times, alternating, and the
listings are checked equal.

Writes bench/results/connections.json and prints a table, own sockets over psutil.
"""

from __future__ import annotations

import argparse
import socket
import time
from typing import Dict, List

from bench import harness
from elastic_ext.runtime import connections


def tcp_lines() -> int:
    count = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path, encoding="ascii") as handle:
            count += sum(1 for _ in handle) - 1
    return count


def leave_closed(count: int) -> None:
    """``count`` connections to this process, closed by the connecting side: each sits in TIME_WAIT."""
    server = socket.create_server(("127.0.0.1", 0), backlog=128)
    for _ in range(count):
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        client.close()
        accepted.close()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=6, help="established pairs this process holds")
    parser.add_argument("--closed", type=int, default=2000, help="connections left in TIME_WAIT first")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--name", default="connections")
    args = parser.parse_args()
    server = socket.create_server(("127.0.0.1", 0))
    held = []
    for _ in range(args.pairs):
        held.append(socket.create_connection(server.getsockname()))
        held.append(server.accept()[0])
    leave_closed(args.closed)
    lines = tcp_lines()
    ways = {"own sockets": lambda: connections.established(skip_ports=set()),
            "psutil": lambda: connections._established_by_psutil(set())}
    times: Dict[str, List[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        listed = []
        for way, listing in ways.items():
            started = time.perf_counter()
            listed.append(sorted(listing()))
            times[way].append(time.perf_counter() - started)
        if listed[0] != listed[1]:
            raise SystemExit(f"the two listings differ: {listed[0]} against {listed[1]}")
    medians = {way: harness.median(values) for way, values in times.items()}
    ratio = medians["own sockets"] / medians["psutil"]
    print(f"/proc/net/tcp{{,6}}: {lines} connections; this process holds {2 * args.pairs} established")
    print(harness.table(["way", "median ms", "worst ms"],
                        [[way, medians[way] * 1e3, max(times[way]) * 1e3] for way in ways]))
    print(f"own sockets / psutil: {ratio:.3f}")
    harness.write_json(args.name, {
        "command": "python -m bench.connections" + ("" if args.closed == 2000 else f" --closed {args.closed}"),
        "machine_tcp_connections": lines, "established_held": 2 * args.pairs, "rounds": args.rounds,
        "median_s": medians, "worst_s": {way: max(values) for way, values in times.items()},
        "ratio_own_over_psutil": ratio})


if __name__ == "__main__":
    main()
