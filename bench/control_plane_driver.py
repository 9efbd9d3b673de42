"""The driver process of :mod:`bench.control_plane`: ``elastic-horovodrun``'s real driver and store, alone.

Two uses, both in a process of their own so that the driver's CPU seconds
are read from ``/proc`` for it alone:

- ``--hosts-file F --np N --min-np M --max-np X``: Horovod's ``ElasticDriver``
  and rendezvous server as ``elastic-horovodrun`` sets them up (the job's
  secret, :mod:`elastic_ext.launch.store_guard`,
  :mod:`elastic_ext.launch.driver`'s subclass of Horovod's driver; on a
  version before it, the changes it installed and ``rendezvous_wait``),
  its discovery reading the JSON ``{host: slots}`` of ``F`` (the simulation
  adds a host by rewriting it). Its workers are simulated by the parent: the
  driver's worker function prints ``start ID HOST LR RANK SIZE LOCAL_RANK
  LOCAL_SIZE CROSS_RANK CROSS_SIZE`` and returns when the parent writes
  ``exit ID CODE`` on stdin, as a real worker's end reaches the driver
  (:mod:`elastic_ext.launch.worker_runs`: the exit status of its child).
  ``counts`` on stdin prints ``counts {json}``: the requests the store
  answered so far, by method, scope, key and status (:func:`install_counter`).
- ``--wrap EVENTS_FILE -- ARGS``: runs ``elastic-horovodrun ARGS`` itself
  with the counter, writing each answered request as a JSON line to
  ``EVENTS_FILE`` (``bench.control_plane --validate``).

Bench-only: nothing in ``elastic_ext`` imports it.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import re
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

_out_lock = threading.Lock()
_counts: Dict[Tuple[str, str, int], int] = collections.Counter()  # (method, path, status) as asked
_counts_lock = threading.Lock()
_timeline: Optional[List[Tuple[float, str, str, int]]] = None


def kind_of(scope: str, key: str) -> Tuple[str, str]:
    """A request's scope and key with ranks, hosts and rounds folded (``global``, ``rank_*``, ``<rank>``...)."""
    suffix = "_ps" if "_process_set_hash_" in scope else ""
    base = scope.split("_process_set_hash_")[0]
    if base.startswith("local_"):
        base = "local_*"
    elif base.startswith("cross_"):
        base = "cross_*"
    key = re.sub(r"^rank_\d+$", "rank_*", key)
    key = re.sub(r"^\d+$", "<rank>", key)
    key = re.sub(r"^_mesh_\d+_(\d+)_(\d+)$", r"_mesh_*_\1_\2", key)  # Gloo's exchange: one rank's request
    key = re.sub(r"^(failed|dismissed)_.*$", r"\1_*", key)
    if scope in ("rank_and_size", "worker_addresses", "elastic_ext_notice"):
        key = "<slot>"
    return base + suffix, key


def install_counter(timeline: bool = False) -> None:
    """Counts every answered request of this process's rendezvous servers (and keeps a timeline if asked)."""
    global _timeline
    from http.server import BaseHTTPRequestHandler

    if timeline:
        _timeline = []
    original = BaseHTTPRequestHandler.send_response

    def count(command: str, path: str, code: int) -> None:
        # Kept as asked and folded when reported (folded): the count is the bench's, not the driver's,
        # and at 1,024 workers folding each request here took several per cent of the driver's CPU.
        entry = (command, path, int(code))
        with _counts_lock:
            _counts[entry] += 1
            if _timeline is not None:
                _timeline.append((time.time(), *entry))

    def send_response(self: Any, code: int, message: Optional[str] = None) -> None:
        count(self.command, self.path, code)
        original(self, code, message)

    BaseHTTPRequestHandler.send_response = send_response  # type: ignore[method-assign]
    try:  # the store's loop answers a held request (Gloo's exchange) after its handler has returned
        from elastic_ext.launch.store_requests import InMemory
    except ImportError:  # a version before the loop: every answer went through send_response
        return
    original_reply = InMemory.reply

    def reply(self: Any, status: int, body: bytes = b"") -> bool:
        sent = original_reply(self, status, body)
        if sent:
            request_line = self.data[:self.data.find(b"\r\n")].decode("latin-1").split(" ")
            count(request_line[0], request_line[1] if len(request_line) > 1 else "", status)
        return sent

    InMemory.reply = reply  # type: ignore[method-assign]


def folded(command: str, path: str, code: int) -> Tuple[str, str, str, int]:
    """A request as counted: its method, scope and key folded (:func:`kind_of`), its status."""
    parts = path.split("/")
    scope, key = (parts[1], parts[2]) if len(parts) == 3 else ("?", "?")
    return (command, *kind_of(scope, key), code)


def counts() -> Dict[str, int]:
    with _counts_lock:
        raw = list(_counts.items())
    total: Dict[Tuple[str, str, str, int], int] = collections.Counter()
    for entry, n in raw:
        total[folded(*entry)] += n
    return {" ".join(map(str, entry)): n for entry, n in total.items()}


def emit(line: str) -> None:
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class FileDiscovery:
    """Horovod's HostDiscovery contract over a JSON file the simulation rewrites."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        with open(self.path) as handle:
            return {str(host): int(slots) for host, slots in json.load(handle).items()}


def serve(args: argparse.Namespace) -> None:
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.rendezvous import create_rendezvous_handler
    from horovod.runner.http.http_server import RendezvousServer

    from elastic_ext.control import store
    from elastic_ext.launch import driver

    store.set_job_secret(args.secret)
    # As elastic-horovodrun's main() (the parts that shape the store and the rounds); every simulated
    # host resolves to this machine, where the simulated workers run.
    resolver = lambda host: frozenset({"127.0.0.1"})  # noqa: E731
    try:  # this branch's code: every change made in one place, the driver one subclass of Horovod's
        from elastic_ext.launch import horovod_changes
    except ImportError:  # main before it (bench.control_plane --before): each module installed its changes
        from elastic_ext.launch import rendezvous_wait, store_guard  # (rendezvous_wait removed since: no gain)
        store_guard.install(resolver=resolver)
        driver.install()
        rendezvous_wait.install()
    else:
        horovod_changes.install_launcher(parts=("store_guard", "store_serving"), resolver=resolver)
        ElasticDriver = driver.driver_class()  # noqa: N806
    install_counter()
    # A real driver imported numpy at its job's start, in the first Gloo exchange (gloo_exchange); the
    # simulation's start runs no exchange above --gloo-start-max workers, so it would be imported in the reset.
    import numpy  # noqa: F401

    exits: Dict[int, Tuple[threading.Event, List[int]]] = {}
    ids = iter(range(1 << 30))
    ids_lock = threading.Lock()

    # Horovod's execute waits on a worker's events (the job's shutdown, its host's removal) on threads that
    # block; here one thread per distinct event ends the workers waiting on it, so that a thousand
    # simulated workers cost the driver's process no polling a real driver does not do.
    watched: Dict[int, Tuple[threading.Event, List[int]]] = {}
    terminated = -1

    def ended_by(event: threading.Event, wids: List[int]) -> None:
        event.wait()
        with ids_lock:
            ended = list(wids)
        for wid in ended:
            if not exits[wid][0].is_set():
                exits[wid][1].append(terminated)
                exits[wid][0].set()

    def create_worker(slot: Any, events: List[threading.Event]) -> Tuple[int, float]:
        with ids_lock:
            wid = next(ids)
            done: Tuple[threading.Event, List[int]] = (threading.Event(), [])
            exits[wid] = done
            for event in events:
                if id(event) not in watched:
                    watched[id(event)] = (event, [])
                    threading.Thread(target=ended_by, args=watched[id(event)], daemon=True).start()
                watched[id(event)][1].append(wid)
            if any(event.is_set() for event in events):  # set before this worker was watched
                done[1].append(terminated)
                done[0].set()
        emit(f"start {wid} {slot.hostname} {slot.local_rank} {slot.rank} {slot.size} {slot.local_rank} "
             f"{slot.local_size} {slot.cross_rank} {slot.cross_size}")
        done[0].wait()
        if done[1][0] == terminated:  # Horovod's execute terminates the worker
            emit(f"terminated {wid}")
            return 143, time.time()
        return done[1][0], time.time()

    if args.backlog is not None:  # a diagnosis (--driver-backlog), not elastic-horovodrun's store
        from horovod.runner.http.http_server import RendezvousHTTPServer
        RendezvousHTTPServer.request_queue_size = args.backlog
    if args.exchange_hold_s is not None:  # a comparison (--exchange-hold-s): how long an exchange is held
        from elastic_ext.launch import gloo_exchange
        gloo_exchange.HOLD_S = args.exchange_hold_s
    server = RendezvousServer(verbose=0)
    elastic = ElasticDriver(server, FileDiscovery(args.hosts_file), args.min_np, args.max_np, timeout=600)
    port = server.start(create_rendezvous_handler(elastic))
    import elastic_ext
    emit(f"port {port} {elastic_ext.__file__}")  # which version's code this driver runs
    elastic.wait_for_available_slots(args.np)
    elastic.start(args.np, create_worker)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "exit":
            done = exits.get(int(words[1]))
            if done is not None:
                done[1].append(int(words[2]))
                done[0].set()
        elif words[0] == "counts":
            emit("counts " + json.dumps(counts()))
        elif words[0] == "quit":
            break
    emit("done")
    elastic.stop()


def wrap(events_file: str, argv: List[str]) -> None:
    """``elastic-horovodrun argv`` with the counter, its timeline written to ``events_file`` at exit."""
    install_counter(timeline=True)

    def write() -> None:
        with _counts_lock:
            rows = list(_timeline or [])
        with open(events_file, "w") as handle:
            for when, *entry in rows:
                handle.write(json.dumps((when, *folded(*entry))) + "\n")

    atexit.register(write)
    from elastic_ext.launch import horovodrun
    try:
        horovodrun.main(argv)
    finally:
        write()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts-file")
    parser.add_argument("--np", type=int)
    parser.add_argument("--min-np", type=int)
    parser.add_argument("--max-np", type=int)
    parser.add_argument("--secret")
    parser.add_argument("--backlog", type=int)
    parser.add_argument("--exchange-hold-s", type=float)
    parser.add_argument("--wrap", metavar="EVENTS_FILE")
    args, rest = parser.parse_known_args(argv)
    if args.wrap:
        wrap(args.wrap, rest[1:] if rest[:1] == ["--"] else rest)
    else:
        serve(args)


if __name__ == "__main__":
    main()

