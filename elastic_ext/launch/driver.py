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
   does (:mod:`elastic_ext.worker.prestart`): before it answers the
   members' rank requests the driver writes
   :data:`~elastic_ext.control.store.CAPACITY_LEFT_OUT` in the store,
   which each member reads at its sync and starts the early start there;
   and it tells the coordinator that hosts were added until a round has
   that capacity (should a member not have read the key). Only
   the round that an early start's rank requests complete
   (:data:`~elastic_ext.control.store.ASKED` in the store) starts new
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
   (:data:`~elastic_ext.exit_codes.PEERS_FAILED`, from
   :mod:`elastic_ext.runtime.closed_links`): seen on real hosts, where one
   worker was SIGKILLed and its host mate, stuck on a send to it, ended
   itself 10 s later; the host counted as lost left the job below
   ``--min-np``.
3. **Workers learn that their round is lost** (:mod:`elastic_ext.worker.round_watch`):
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
   :func:`~elastic_ext.control.store.dismissed_key`; the worker, which
   reads it until it announces itself (:mod:`elastic_ext.worker.newcomer`),
   exits with :data:`~elastic_ext.exit_codes.DISMISSED`,
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

import functools
import threading
from typing import Any

from elastic_ext.launch import discovery_runs, held_ranks, noticed_hosts, worker_clients
from elastic_ext.launch.driver_dismissal import worth_dismissing
from elastic_ext.launch.driver_registry import REGROW_POLL_S, registry_methods
from elastic_ext.launch.driver_slots import driver_methods
from elastic_ext.launch.driver_state import STARTS_KEPT, DriverState, Slot, moves, survivors_by_host

__all__ = ["driver_class", "worth_dismissing", "REGROW_POLL_S", "STARTS_KEPT", "DriverState", "Slot", "moves",
           "survivors_by_host"]

#: The methods of Horovod's ``ElasticDriver`` that :mod:`~elastic_ext.launch.driver_slots` changes.
SLOT_METHODS = ("_get_host_assignments", "_update_host_assignments", "get_slot_info", "_start_worker_process",
                "record_ready", "_handle_worker_exit")


@functools.lru_cache(maxsize=None)
def driver_class() -> type:
    """Horovod's ``ElasticDriver`` with the changes of the module docstring, as one subclass.

    ``elastic-horovodrun`` binds it where Horovod builds its driver
    (:func:`elastic_ext.launch.horovod_changes.install_launcher`); a test
    builds it or Horovod's own side by side. The changes live by what they
    change: :mod:`~elastic_ext.launch.driver_registry` (a round's recording,
    in a subclass of Horovod's ``WorkerStateRegistry`` that the driver
    holds), :mod:`~elastic_ext.launch.driver_slots` (a round's forming and
    its workers' names), :mod:`~elastic_ext.launch.driver_dismissal`
    (starting workers dismissed), on the record of
    :mod:`~elastic_ext.launch.driver_state`; the discovery as the launcher
    runs it (:mod:`~elastic_ext.launch.discovery_runs`: the script outside
    the host lock; :mod:`~elastic_ext.launch.noticed_hosts`: hosts with a
    preemption notice left out), and the clients of the workers' services
    (:mod:`~elastic_ext.launch.worker_clients`). Horovod is imported here,
    once, not when this module is.
    """
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.registration import WorkerStateRegistry

    # Horovod's reset, its barrier one that counts held rank requests (held_ranks).
    reset, on_workers_recorded = registry_methods(held_ranks.held_reset, WorkerStateRegistry._on_workers_recorded)
    registry = type("Registry", (WorkerStateRegistry,), {
        "__module__": __name__, "__doc__": "Horovod's WorkerStateRegistry as elastic-horovodrun records a round.",
        "reset": reset, "_on_workers_recorded": on_workers_recorded})
    slots = driver_methods({name: getattr(ElasticDriver, name) for name in SLOT_METHODS})
    client = worker_clients.client_class()

    class Driver(ElasticDriver):  # type: ignore[misc, valid-type]
        """Horovod's elastic driver as ``elastic-horovodrun`` changes it (:mod:`elastic_ext.launch.driver`)."""

        _get_host_assignments = slots["_get_host_assignments"]
        _update_host_assignments = slots["_update_host_assignments"]
        get_slot_info = slots["get_slot_info"]
        _start_worker_process = slots["_start_worker_process"]
        record_ready = slots["record_ready"]
        _handle_worker_exit = slots["_handle_worker_exit"]

        def __init__(self, rendezvous: Any, discovery: Any, min_num_proc: int, max_num_proc: int,
                     timeout: Any = None, reset_limit: Any = None, cooldown_range: Any = None,
                     verbose: int = 0) -> None:
            # Horovod starts its discovery thread in its __init__: it waits until this one has ended.
            self._elastic_ext_built = threading.Event()
            discovery = noticed_hosts.WithoutNoticed(discovery_runs.script_discovery(discovery))
            super().__init__(rendezvous, discovery, min_num_proc, max_num_proc, timeout=timeout,
                             reset_limit=reset_limit, cooldown_range=cooldown_range, verbose=verbose)
            self._worker_registry = registry(self, self._host_manager, reset_limit=reset_limit)
            noticed_hosts.driver_built(self)
            self._elastic_ext_built.set()

        def _discover_hosts(self) -> None:
            self._elastic_ext_built.wait()
            discovery_runs.discover_hosts(self)

        def register_worker_server(self, host: str, slot: int, addresses: Any, secret_key: Any) -> None:
            self._worker_clients[(host, slot)] = client(addresses, secret_key, self._verbose)
            noticed_hosts.worker_registered(self, host, slot)

    return Driver
