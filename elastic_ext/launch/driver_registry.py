"""How ``elastic-horovodrun``'s driver records a round (changes 1 to 3 of :mod:`elastic_ext.launch.driver`).

Horovod's ``WorkerStateRegistry`` as the launcher changes it: a new round
publishes its number and slots in the store (and, when it left capacity
out, :data:`~elastic_ext.control.store.CAPACITY_LEFT_OUT` with the
coordinator told until a round takes it back); a recorded round keeps its
workers that asked as the next round's survivors and blacklists only a
host that lost the whole machine.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Tuple

from elastic_ext.launch.driver_state import early_start_asked, state_of, store_write, survivors_by_host
from elastic_ext.exit_codes import PEERS_FAILED
from elastic_ext.control.store import ASSIGNED, CAPACITY_LEFT_OUT, CURRENT

logger = logging.getLogger(__name__)

REGROW_POLL_S = 0.1  # how often the coordinator is told that capacity is back, until a round takes it

Method = Callable[..., Any]


def registry_methods(original_reset: Method, original_recorded: Method) -> Tuple[Method, Method]:
    """``WorkerStateRegistry.reset`` and ``._on_workers_recorded`` as the launcher replaces them."""
    from horovod.runner.elastic.registration import FAILURE, READY, SUCCESS

    def reset(self: Any, size: int) -> None:
        original_reset(self, size)  # after the new round's assignments, which cleared the store
        driver = self._driver
        slots = [f"{host}:{slot.local_rank}" for host, host_slots in driver.host_assignments.items()
                 for slot in host_slots]
        round_id, ext = self.last_rendezvous(), state_of(driver)
        with ext.lock:  # this round and the one before it: during an early start members still train in that one
            ext.rounds = {r: members for r, members in ext.rounds.items() if r == round_id - 1}
            ext.rounds[round_id] = set(slots)
        store_write(driver, ASSIGNED, ",".join(slots).encode("utf-8"))
        store_write(driver, CURRENT, str(round_id).encode("ascii"))
        if state_of(driver).regrow:
            # Before any member's rank answer (this runs in the round's barrier): every member reads it at its sync.
            store_write(driver, CAPACITY_LEFT_OUT, b"1")
            start_regrow(driver)

    def on_workers_recorded(self: Any) -> None:
        manager, ext = self._host_manager, state_of(self._driver)
        ready = set(self.get(READY))
        ready_hosts = {host for host, _ in ready}
        if ready and not self.get(SUCCESS) and (self.get(FAILURE) or not early_start_asked(self._driver)):
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
                               "because its peers failed, not the host", host, PEERS_FAILED)
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

    return reset, on_workers_recorded


def start_regrow(driver: Any) -> None:
    """Tells the coordinator, every :data:`REGROW_POLL_S`, that hosts were added, until a round takes them.

    A notification that reaches a worker while it resets is dropped with the
    rest of its pending updates, so one is not enough; the coordinator acts
    on the first that arrives after its reset, at its next commit. The
    members start the early start at their sync already
    (:data:`~elastic_ext.control.store.CAPACITY_LEFT_OUT`): this is
    the way back for a round whose members could not read the store then.

    Whether the hosts would change the round's assignments is Horovod's
    check (``_notify_workers_host_changes``): the assignments of every slot,
    about 20 ms at 1,024 slots, a fifth of the driver's CPU in a reset at
    that size when it ran at every tell. Here it runs once per change of
    the hosts (:class:`_Told`); each tell is then one notification.
    """
    ext = state_of(driver)
    if ext.regrow_thread is not None and ext.regrow_thread.is_alive():
        return
    told = _Told(driver)

    def tell() -> None:
        # Not under the driver's host lock, which its discovery and round formation take: the send to a
        # coordinator that died may block (60 s), and a notification a round makes stale costs nothing.
        while ext.regrow and not driver.finished():
            told.tell()
            driver._shutdown.wait(REGROW_POLL_S)

    ext.regrow_thread = threading.Thread(target=tell, name="elastic_ext-regrow", daemon=True)
    ext.regrow_thread.start()


class _Told:
    """The regrow's tells. Whether the hosts would give the round more slots is Horovod's check in
    ``_notify_workers_host_changes`` (its assignments of every slot against the round's; hosts below
    ``--min-np`` add none here, where Horovod would still tell), made once per hosts and round: a
    discovery change makes a new hosts object, a blacklisting shortens its order in place, a round makes
    new assignments."""

    def __init__(self, driver: Any) -> None:
        self.driver, self.seen, self.differs = driver, (None, [], None), False

    def tell(self) -> None:
        from horovod.runner.elastic.driver import _epoch_time_s
        from horovod.runner.elastic.worker import HostUpdateResult

        driver = self.driver
        hosts, assignments = driver._host_manager.current_hosts, driver.host_assignments
        seen_hosts, seen_order, seen_assignments = self.seen
        changed = hosts is not seen_hosts or assignments is not seen_assignments
        if changed or hosts.host_assignment_order != seen_order:
            self.seen = (hosts, list(hosts.host_assignment_order), assignments)
            self.differs = (hosts.count_available_slots() >= driver._min_num_proc
                            and driver._get_host_assignments(hosts)[0] != assignments)
        coordinator = driver.get_coordinator_info() if self.differs else None
        client = driver.get_worker_client(coordinator) if coordinator else None
        if client is None:
            return
        try:
            client.notify_hosts_updated(_epoch_time_s(), HostUpdateResult.added)
        except Exception:  # noqa: BLE001 - as Horovod's own tell: the next one may reach it
            logger.debug("elastic_ext: could not tell %s[%d] that capacity is back", coordinator.hostname,
                         coordinator.local_rank, exc_info=True)
