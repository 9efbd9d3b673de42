"""How ``elastic-horovodrun``'s driver forms a round and names its workers (changes 1, 4 and 5).

Horovod's ``ElasticDriver`` methods as :mod:`elastic_ext.launch.driver`
replaces them: a round of survivors only, survivors moved down to free
local ranks (and every name the driver holds translated), each worker's
start and first rank request timed, and a worker's exit charged to the
slot its process holds now.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict

from elastic_ext.launch.driver_dismissal import dismiss_starting
from elastic_ext.launch.driver_state import DriverState, Slot, early_start_asked, moves, state_of, store_write
from elastic_ext.exit_codes import DISMISSED, PEERS_FAILED
from elastic_ext.control.store import failed_key

logger = logging.getLogger(__name__)

Method = Callable[..., Any]


def driver_methods(original: Dict[str, Method]) -> Dict[str, Method]:
    """The ``ElasticDriver`` methods the launcher replaces, by name, each calling its ``original``."""

    def get_host_assignments(self: Any, current_hosts: Any) -> Any:
        only = state_of(self).only
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
        ext = state_of(self)
        ext.early_round = early_start_asked(self)  # before the new round's assignments clear the store
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
            move_survivors(self, ext, moves(survivors))
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
        return original["get_slot_info"](self, host, state_of(self).moved.get((host, local_rank), local_rank))

    def start_worker_process(self: Any, slot_info: Any) -> None:
        ext = state_of(self)
        slot = (slot_info.hostname, slot_info.local_rank)
        ext.holders[slot] = slot_info
        with ext.lock:
            ext.starting[slot] = time.monotonic()
            (ext.newcomers.add if ext.early_round else ext.newcomers.discard)(slot)
        original["_start_worker_process"](self, slot_info)

    def record_ready(self: Any, host: str, local_rank: int) -> None:
        note_ready(self, host, local_rank)
        original["record_ready"](self, host, local_rank)

    def handle_worker_exit(self: Any, slot_info: Any, exit_code: int, timestamp: Any) -> None:
        held = [slot for slot, holder in state_of(self).holders.items() if holder is slot_info]
        if not held:
            logger.warning("elastic_ext: ignoring exit code %d of a replaced worker of %s[%d]: a newer worker "
                           "holds its slot", exit_code, slot_info.hostname, slot_info.local_rank)
            return
        host, local_rank = held[0]
        if local_rank != slot_info.local_rank:  # a survivor that moved: Horovod knows it by its new slot
            slot_info = dataclasses.replace(slot_info, local_rank=local_rank)
        with state_of(self).lock:
            state_of(self).starting.pop((host, local_rank), None)
            state_of(self).newcomers.discard((host, local_rank))
        if exit_code != 0 and not self.finished() and self.has_rank_assignment(host, local_rank):
            publish_failed(self, host, local_rank)
            if exit_code == PEERS_FAILED:
                state_of(self).peers_failed.add(host)
            if exit_code != DISMISSED:
                dismiss_starting(self)
        original["_handle_worker_exit"](self, slot_info, exit_code, timestamp)  # waits for the round

    return {"_get_host_assignments": get_host_assignments, "_update_host_assignments": update_host_assignments,
            "get_slot_info": get_slot_info, "_start_worker_process": start_worker_process,
            "record_ready": record_ready, "_handle_worker_exit": handle_worker_exit}


def note_ready(driver: Any, host: str, local_rank: int) -> None:
    """What the launcher keeps of a worker's rank request before Horovod records it ready: its start's
    duration, and that it is a member now (it asked before it read its dismissal)."""
    ext = state_of(driver)
    with ext.lock:
        started = ext.starting.pop((host, local_rank), None)
        if started is not None:
            (ext.starts if (host, local_rank) in ext.newcomers else ext.other_starts).append(
                time.monotonic() - started)
        ext.newcomers.discard((host, local_rank))
        ext.dismissed.discard((host, local_rank))


def publish_failed(driver: Any, host: str, local_rank: int) -> None:
    """The failed member's slot under the current round's failed key, and under the previous round's when it
    was a member of that one too: during an early start the survivors still train in the previous round, and
    their driver watch reads only their own round's key (one request per poll)."""
    current, who = driver._worker_registry.last_rendezvous(), f"{host}[{local_rank}]".encode()
    with state_of(driver).lock:
        earlier = [r for r, members in state_of(driver).rounds.items()
                   if r != current and f"{host}:{local_rank}" in members]
    for round_id in [current, *earlier]:
        store_write(driver, failed_key(round_id), who)


def move_survivors(driver: Any, ext: DriverState, moved: Dict[Slot, int]) -> None:
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

