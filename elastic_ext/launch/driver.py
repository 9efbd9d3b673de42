"""Horovod's elastic driver as ``elastic-horovodrun`` changes it (Horovod 0.28.1's ``ElasticDriver``).

Horovod names a worker by its slot, ``(host, local rank)``: in its registry
of each round, in the rank it answers, in the exits it records and in the
worker it notifies of host changes. The changes, each for a failure Horovod
turns into a longer or larger one:

1. **A round after a reset holds only the workers that asked for a rank
   in it.** After a failure, Horovod keeps the failed worker's slot in the
   next round and starts a new worker there, and after a host change it
   starts the new hosts' workers in the round the survivors reset into;
   every survivor then waits in ``hvd.init()`` until those processes have
   started Python, imported their framework and built their model (6 s
   and more). Here such a round is exactly the workers that asked, so they
   go on at once, and capacity beyond them (the failed slot, a new host)
   joins later, while they train, the way a newcomer of an early start
   does (:mod:`elastic_ext.launch.prestart`): before it answers the
   members' rank requests the driver writes
   :data:`~elastic_ext.launch.round_watch.CAPACITY_LEFT_OUT` in the store,
   which each member reads at its sync and starts the early start there;
   and it tells the coordinator that hosts were added until a round has
   that capacity (should a member not have read the key). Only
   the round that an early start's rank requests complete
   (:data:`~elastic_ext.launch.prestart.ASKED` in the store) starts new
   workers, which start in a world of one. Survivors keep their host; on a
   host whose worker of a lower local rank failed, they move down to the
   free local ranks, and the driver translates every name it holds (the
   answer to a rank request, exits, notification clients) from the old
   local rank to the new one. Where the workers that asked are fewer than
   ``--min-np``, new workers start in the same round, as Horovod does.
   So under the launcher no ``hvd.init()`` but the job's first and that
   last case meets a worker that is still starting.
2. **A host is blacklisted only when it lost all its workers of a round
   that held all its slots.** Horovod blacklists the host of every failed
   worker, which also ends its healthy workers ("has been removed from
   elastic job") and, when two hosts each lose a worker in one round, leaves
   no host at all. A host whose every slot's worker failed in one round (a
   lost machine) is still blacklisted; one whose last worker of a round of
   survivors failed is not (two process failures in a row, not a machine:
   seen under a failure every 15 s, where the job lost a host for good),
   nor one of whose workers ended itself because its round's peers failed
   (:data:`~elastic_ext.launch.round_watch.PEERS_FAILED_EXIT_CODE`, from
   :mod:`elastic_ext.runtime.closed_links`): seen on real hosts, where one
   worker was SIGKILLed and its host mate, stuck on a send to it, ended
   itself 10 s later; the host counted as lost left the job below
   ``--min-np``.
3. **Workers learn that their round is lost** (:mod:`elastic_ext.launch.round_watch`):
   the rendezvous server's store holds the current round's number and
   slots, and a key per round in which a member failed.
4. **A failure does not wait for workers that are still starting.** When a
   member of a round fails while others of the round are still starting
   (an early start's newcomers, importing their framework or building
   their model; only they read their dismissal), the round's other members
   would wait in ``hvd.init()`` for the rest of that start (seconds) before
   they could go on without the failed one. The driver dismisses a
   starting worker instead when waiting would cost more than starting it
   again later (:func:`worth_dismissing`): the ``s`` members that go on
   would stand idle for the rest of its start, while without it its slot
   trains nothing for the time its new worker takes to get as far again.
   With one worker starting, it is dismissed while ``s`` times the rest of
   its start exceeds its time since start plus the wait for the early start
   that starts its successor. The typical start is the median of the job's
   newcomers' starts so far (start to first rank request; the job's first
   workers' until a newcomer asked), the wait the median of those seen so
   far. It writes the worker's
   :func:`~elastic_ext.launch.round_watch.dismissed_key`; the worker, which
   reads it until it announces itself (:mod:`elastic_ext.launch.newcomer`),
   exits with :data:`~elastic_ext.launch.round_watch.DISMISSED_EXIT_CODE`,
   its host is not blacklisted for it, and the round forms from the members
   that asked; its slot comes back with the failed one, while they train.
   Never when the members that go on would be fewer than ``--min-np``.
5. **The exit of a replaced worker is not charged to its successor.** A
   worker that outlives a short blacklist cooldown would have its late exit
   recorded as the failure of the new worker in its slot, which ends the
   job early ("key exists and new state SUCCESS not FAILURE"). Exits are
   charged to the slot the exiting process holds now, or ignored when it
   holds none.

Everything else is Horovod's: ``--reset-limit`` (a failure costs one round,
the failed slot's return two more, as any early start), the blacklist
cooldown, discovery.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from elastic_ext.launch import prestart, store
from elastic_ext.launch.replaced import Originals, replace, restore
from elastic_ext.launch.round_watch import (ASSIGNED, CAPACITY_LEFT_OUT, CURRENT, DISMISSED_EXIT_CODE,
                                            PEERS_FAILED_EXIT_CODE, SCOPE, dismissed_key, failed_key)

logger = logging.getLogger(__name__)

REGROW_POLL_S = 0.1  # how often the coordinator is told that capacity is back, until a round takes it
STARTS_KEPT = 16     # the workers' latest starts (start to first rank request) the typical start is taken from

Slot = Tuple[str, int]
_originals: Originals = {}  # what install() replaced


def _store(driver: Any, key: str, value: bytes) -> None:
    """Writes into the driver's rendezvous server's key-value store (the scope workers read; only here)."""
    store.write_local(driver, SCOPE, key, value)


def _early_start_asked(driver: Any) -> bool:
    """True when an early start's rank requests complete this round (they are in the store until it forms)."""
    return store.keys_local(driver, prestart.SCOPE).get(prestart.ASKED) is not None


def _ext(driver: Any) -> "DriverState":
    return driver.__dict__.setdefault("elastic_ext", DriverState())


@dataclasses.dataclass
class DriverState:
    """What the changed driver keeps beside Horovod's own fields."""

    # Which process holds each slot now: the SlotInfo Horovod started it with, compared by identity.
    holders: Dict[Slot, Any] = dataclasses.field(default_factory=dict)
    # For the round being answered: a survivor's old local rank -> its new one, by host.
    moved: Dict[Slot, int] = dataclasses.field(default_factory=dict)
    # Set by a round's barrier: the slots of the workers that asked, by host (old local ranks, sorted).
    survivors: Optional[Dict[str, List[int]]] = None
    # While building a survivors' round: the slot count per host that _get_host_assignments uses.
    only: Optional[Dict[str, int]] = None
    # Hosts with a worker that ended itself because its round's peers failed, until the round is recorded.
    peers_failed: Set[str] = dataclasses.field(default_factory=set)
    regrow: bool = False                 # the current round left capacity out: tell the coordinator
    regrow_thread: Optional[threading.Thread] = None
    # Workers started and not yet asked for a rank: when each started (time.monotonic()), by slot.
    starting: Dict[Slot, float] = dataclasses.field(default_factory=dict)
    # Those of them an early start's round started: they read their dismissal while they start.
    newcomers: Set[Slot] = dataclasses.field(default_factory=set)
    early_round: bool = False            # the round being formed was completed by an early start's requests
    # The latest newcomers' starts, start to first rank request (s); other workers' until a newcomer's.
    starts: Deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STARTS_KEPT))
    other_starts: Deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STARTS_KEPT))
    # The latest waits from a round that left capacity out to the early start that took it back (s).
    regrow_waits: Deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STARTS_KEPT))
    regrow_since: Optional[float] = None  # when the current round left capacity out
    # Starting workers dismissed in the current round (until it is recorded).
    dismissed: Set[Slot] = dataclasses.field(default_factory=set)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def survivors_by_host(ready: Any) -> Dict[str, List[int]]:
    """The READY slots of a round as {host: sorted local ranks}."""
    by_host: Dict[str, List[int]] = {}
    for host, local_rank in ready:
        by_host.setdefault(host, []).append(local_rank)
    return {host: sorted(ranks) for host, ranks in by_host.items()}


def moves(survivors: Dict[str, List[int]]) -> Dict[Slot, int]:
    """Each survivor's new local rank: a host's survivors take its local ranks 0, 1, ... in their order."""
    return {(host, old): new for host, ranks in survivors.items() for new, old in enumerate(ranks) if old != new}


def worth_dismissing(elapsed_s: List[float], typical_s: float, going_on: int, regrow_wait_s: float = 0.0) -> bool:
    """True when the workers ``elapsed_s`` into starts that typically take ``typical_s`` are better started again.

    All or none: the round waits for the last of them. Waiting idles the
    ``going_on`` members until the least advanced start ends; not waiting
    leaves each slot without a worker for what its new one will take to get
    as far again: its own ``elapsed_s``, plus ``regrow_wait_s`` before the
    early start that starts it (module docstring, change 4).
    """
    if going_on <= 0 or not elapsed_s:
        return False
    return going_on * (typical_s - min(elapsed_s)) > sum(e + regrow_wait_s for e in elapsed_s)


def install() -> None:
    """Changes Horovod's elastic driver as the module docstring says; idempotent."""
    if _originals:
        return
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.registration import FAILURE, READY, SUCCESS, WorkerStateRegistry

    original = {name: getattr(ElasticDriver, name) for name in (
        "_update_host_assignments", "_get_host_assignments", "_start_worker_process", "_handle_worker_exit",
        "get_slot_info", "record_ready")}
    original_reset = WorkerStateRegistry.reset
    original_recorded = WorkerStateRegistry._on_workers_recorded

    def reset(self: Any, size: int) -> None:
        original_reset(self, size)  # after the new round's assignments, which cleared the store
        driver = self._driver
        slots = [f"{host}:{slot.local_rank}" for host, host_slots in driver.host_assignments.items()
                 for slot in host_slots]
        _store(driver, ASSIGNED, ",".join(slots).encode("utf-8"))
        _store(driver, CURRENT, str(self.last_rendezvous()).encode("ascii"))
        if _ext(driver).regrow:
            # Before any member's rank answer (this runs in the round's barrier): every member reads it at its sync.
            _store(driver, CAPACITY_LEFT_OUT, b"1")
            _start_regrow(driver)

    def on_workers_recorded(self: Any) -> None:
        manager, ext = self._host_manager, _ext(self._driver)
        ready = set(self.get(READY))
        ready_hosts = {host for host, _ in ready}
        if ready and not self.get(SUCCESS) and (self.get(FAILURE) or not _early_start_asked(self._driver)):
            ext.survivors = survivors_by_host(ready)
        blacklist = manager.blacklist

        def blacklist_lost_hosts(host: str) -> None:
            if host in ready_hosts:
                logger.warning("elastic_ext: not blacklisting %s: another of its workers is ready (a worker "
                               "failed, not the host)", host)
                return
            if host in {dismissed_host for dismissed_host, _ in ext.dismissed}:
                logger.warning("elastic_ext: not blacklisting %s: the driver dismissed its starting worker", host)
                return
            if host in ext.peers_failed:
                logger.warning("elastic_ext: not blacklisting %s: one of its workers ended itself (exit status %d) "
                               "because its peers failed, not the host", host, PEERS_FAILED_EXIT_CODE)
                return
            held = len(self._driver.host_assignments.get(host, ()))
            if held < manager.current_hosts.get_slots(host):
                # A round of survivors held only part of the host: its last worker failed, not the whole
                # machine at once. Its slots come back through the regrow; a lost machine then fails them
                # all in one round and is blacklisted then.
                logger.warning("elastic_ext: not blacklisting %s: the round held %d of its %d slots", host, held,
                               manager.current_hosts.get_slots(host))
                return
            blacklist(host)

        manager.blacklist = blacklist_lost_hosts
        try:
            original_recorded(self)
        finally:
            del manager.blacklist  # the class's method again
            ext.survivors = None   # consumed by the round it formed, if it formed one
            ext.peers_failed.clear()
            with ext.lock:
                ext.dismissed.clear()

    def get_host_assignments(self: Any, current_hosts: Any) -> Any:
        only = _ext(self).only
        if only is None:
            return original["_get_host_assignments"](self, current_hosts)
        from collections import defaultdict
        from horovod.runner.common.util import hosts
        host_list = [hosts.HostInfo(host, only[host]) for host in current_hosts.host_assignment_order
                     if only.get(host)]
        assignments_list = hosts.get_host_assignments(host_list, self._min_num_proc, self._max_num_proc)
        assignments = defaultdict(list)
        for slot_info in assignments_list:
            assignments[slot_info.hostname].append(slot_info)
        return assignments, assignments_list

    def update_host_assignments(self: Any, current_hosts: Any) -> Any:
        ext = _ext(self)
        ext.early_round = _early_start_asked(self)  # before the new round's assignments clear the store
        if ext.early_round and ext.regrow_since is not None:
            ext.regrow_waits.append(time.monotonic() - ext.regrow_since)
            ext.regrow_since = None
        survivors = {host: ranks for host, ranks in (ext.survivors or {}).items()
                     if host in current_hosts.available_hosts}
        ext.survivors = None
        if survivors and sum(len(r) for r in survivors.values()) >= self._min_num_proc:
            ext.only = {host: len(ranks) for host, ranks in survivors.items()}
            try:
                pending = original["_update_host_assignments"](self, current_hosts)
            finally:
                ext.only = None
            _move(self, ext, moves(survivors))
            full, _ = original["_get_host_assignments"](self, current_hosts)
            ext.regrow = full != self._host_assignments
            ext.regrow_since = time.monotonic() if ext.regrow else None
            logger.info("elastic_ext: the round holds the %d workers that asked for a rank%s", self.world_size(),
                        "; the rest of the capacity joins while they train" if ext.regrow else "")
            return pending  # none: every slot is a survivor's
        ext.moved, ext.regrow = {}, False
        if survivors:  # too few to go on alone: start new workers now, in the failed slots too, as Horovod does
            self._host_assignments = {host: [slot for slot in slots if slot.local_rank in survivors.get(host, ())]
                                      for host, slots in self._host_assignments.items()}
        return original["_update_host_assignments"](self, current_hosts)

    def get_slot_info(self: Any, host: str, local_rank: int) -> Any:
        return original["get_slot_info"](self, host, _ext(self).moved.get((host, local_rank), local_rank))

    def start_worker_process(self: Any, slot_info: Any) -> None:
        ext = _ext(self)
        slot = (slot_info.hostname, slot_info.local_rank)
        ext.holders[slot] = slot_info
        with ext.lock:
            ext.starting[slot] = time.monotonic()
            (ext.newcomers.add if ext.early_round else ext.newcomers.discard)(slot)
        original["_start_worker_process"](self, slot_info)

    def record_ready(self: Any, host: str, local_rank: int) -> None:
        ext = _ext(self)
        with ext.lock:
            started = ext.starting.pop((host, local_rank), None)
            if started is not None:
                (ext.starts if (host, local_rank) in ext.newcomers else ext.other_starts).append(
                    time.monotonic() - started)
            ext.newcomers.discard((host, local_rank))
            ext.dismissed.discard((host, local_rank))  # it asked before it read its dismissal: it is a member
        original["record_ready"](self, host, local_rank)

    def handle_worker_exit(self: Any, slot_info: Any, exit_code: int, timestamp: Any) -> None:
        held = [slot for slot, holder in _ext(self).holders.items() if holder is slot_info]
        if not held:
            logger.warning("elastic_ext: ignoring exit code %d of a replaced worker of %s[%d]: a newer worker "
                           "holds its slot", exit_code, slot_info.hostname, slot_info.local_rank)
            return
        host, local_rank = held[0]
        if local_rank != slot_info.local_rank:  # a survivor that moved: Horovod knows it by its new slot
            slot_info = dataclasses.replace(slot_info, local_rank=local_rank)
        with _ext(self).lock:
            _ext(self).starting.pop((host, local_rank), None)
            _ext(self).newcomers.discard((host, local_rank))
        if exit_code != 0 and not self.finished() and self.has_rank_assignment(host, local_rank):
            _store(self, failed_key(self._worker_registry.last_rendezvous()), f"{host}[{local_rank}]".encode())
            if exit_code == PEERS_FAILED_EXIT_CODE:
                _ext(self).peers_failed.add(host)
            if exit_code != DISMISSED_EXIT_CODE:
                _dismiss_starting(self)
        original["_handle_worker_exit"](self, slot_info, exit_code, timestamp)  # waits for the round

    replace(_originals, ((WorkerStateRegistry, "reset", reset),
                         (WorkerStateRegistry, "_on_workers_recorded", on_workers_recorded),
                         (ElasticDriver, "_get_host_assignments", get_host_assignments),
                         (ElasticDriver, "_update_host_assignments", update_host_assignments),
                         (ElasticDriver, "get_slot_info", get_slot_info),
                         (ElasticDriver, "_start_worker_process", start_worker_process),
                         (ElasticDriver, "record_ready", record_ready),
                         (ElasticDriver, "_handle_worker_exit", handle_worker_exit)))


def uninstall() -> None:
    """Gives Horovod's driver its own behaviour back (for tests that run both in one process)."""
    restore(_originals)


def _move(driver: Any, ext: DriverState, moved: Dict[Slot, int]) -> None:
    """Renames survivors that moved to a lower local rank, in every map the driver keys by slot."""
    ext.moved = moved
    if not moved:
        return
    for table in (ext.holders, driver._worker_clients):
        renamed = {(host, new): table[(host, old)] for (host, old), new in moved.items() if (host, old) in table}
        for slot in moved:
            table.pop(slot, None)
        for slot in renamed:
            table.pop(slot, None)  # the failed worker's entry, whose slot a survivor takes
        table.update(renamed)
    logger.info("elastic_ext: survivors moved to free local ranks: %s",
                ", ".join(f"{h}[{old}]->[{new}]" for (h, old), new in sorted(moved.items())))


def _dismiss_starting(driver: Any) -> None:
    """After a member's failure: dismisses the round's workers still starting if it is worth it (change 4)."""
    from horovod.runner.elastic.registration import FAILURE

    ext = _ext(driver)
    if store.server_of(driver) is None:
        return
    registry = driver._worker_registry
    with registry._lock:
        recorded = set(registry._states)
        failures = len(registry._workers[FAILURE])
    announced = set(store.keys_local(driver, prestart.SCOPE))
    now = time.monotonic()
    with ext.lock:
        if not (ext.starts or ext.other_starts):
            return
        typical = statistics.median(ext.starts or ext.other_starts)
        regrow_wait = statistics.median(ext.regrow_waits) if ext.regrow_waits else 0.0
        starting = {}
        for slot, started in ext.starting.items():
            if slot in recorded or slot in ext.dismissed or not driver.has_rank_assignment(*slot):
                continue
            if slot not in ext.newcomers:
                return  # the round waits for it anyway: it does not read a dismissal
            if str(driver.get_slot_info(*slot).rank) in announced:
                continue  # it built its model and is about to ask: it stopped reading its dismissal
            starting[slot] = now - started
        going_on = driver.world_size() - len(ext.dismissed) - len(starting) - failures - 1
        if going_on < driver._min_num_proc or not worth_dismissing(list(starting.values()), typical, going_on,
                                                                   regrow_wait):
            return  # also when none is starting: worth_dismissing is False for no worker
        dismissed = sorted(starting)
        ext.dismissed.update(dismissed)
    for host, local_rank in dismissed:
        _store(driver, dismissed_key(host, local_rank), b"1")
    logger.warning("elastic_ext: a member of round %d failed; dismissing %s, still starting (%s s of a typical "
                   "%.1f s start): the %d members going on start now, and the slots come back while they train",
                   registry.last_rendezvous(), ", ".join(f"{h}[{r}]" for h, r in dismissed),
                   ", ".join(f"{starting[slot]:.1f}" for slot in dismissed), typical, going_on)


def _start_regrow(driver: Any) -> None:
    """Tells the coordinator, every :data:`REGROW_POLL_S`, that hosts were added, until a round takes them.

    A notification that reaches a worker while it resets is dropped with the
    rest of its pending updates, so one is not enough; the coordinator acts
    on the first that arrives after its reset, at its next commit. The
    members start the early start at their sync already
    (:data:`~elastic_ext.launch.round_watch.CAPACITY_LEFT_OUT`): this is
    the way back for a round whose members could not read the store then.
    """
    ext = _ext(driver)
    if ext.regrow_thread is not None and ext.regrow_thread.is_alive():
        return
    from horovod.runner.elastic.worker import HostUpdateResult

    def tell() -> None:
        # Not under the driver's host lock, which its discovery and round formation take: the send to a
        # coordinator that died may block (60 s), and a notification a round makes stale costs nothing.
        while ext.regrow and not driver.finished():
            driver._notify_workers_host_changes(driver._host_manager.current_hosts, HostUpdateResult.added)
            driver._shutdown.wait(REGROW_POLL_S)

    ext.regrow_thread = threading.Thread(target=tell, name="elastic_ext-regrow", daemon=True)
    ext.regrow_thread.start()
