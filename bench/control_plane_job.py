"""The simulated job of :mod:`bench.control_plane`: its workers (:class:`~bench.control_plane_sim.Worker`),
started when the driver says, reset together when a real job's collective would make them.

Job-level moments of a real job, here in one place: a SIGKILL (the driver
sees the exit status, every survivor's collective fails at once), a
commit's agreement (an early start's Prestart on every trained rank; "every
newcomer is there", then every rank resets), the coordinator's host notice
(Horovod's notification service, in its thread).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import time
from typing import Callable, Dict, List, Set, Tuple

from bench.control_plane_http import Stats, Store
from bench.control_plane_sim import Worker


class Job:
    """The simulated workers of one driver: started when the driver says, reset when the job would."""

    def __init__(self, port: int, secret: str, send: Callable[[str], None], gloo: bool, build_s: float,
                 registration: bytes, process_start_s: float, after: bool) -> None:
        self.process_start_s = process_start_s
        self.after = after  # the workers speak the protocol after issue 55's changes (bench.control_plane_sim)
        self.stats = Stats()
        self.store = Store(port, secret, self.stats)
        self.send, self.gloo, self.build_s, self.registration = send, gloo, build_s, registration
        self.workers: Dict[int, Worker] = {}
        self.barriers: Dict[Tuple[str, int], asyncio.Barrier] = {}
        self.generation = 0                 # bumped at each reset: Gloo's barriers of one init
        self.early: Set[int] = set()        # the workers whose Prestart of the current early start began
        self.reset_started = 0.0            # time.time() of the last reset (older host notices are dropped)
        self.times: Dict[str, Dict[int, float]] = collections.defaultdict(dict)  # event -> wid -> monotonic
        self.changed = asyncio.Event()

    def alive(self) -> List[Worker]:
        return [w for w in self.workers.values() if not w.dead]

    def start_worker(self, wid: int, host: str, local_rank: int, ranks: List[int]) -> None:
        worker = Worker(self, wid, host, local_rank, ranks)
        self.workers[wid] = worker
        worker.spawn(worker.first_start())

    def _mark(self, event: str, worker: Worker) -> None:
        self.times[event][worker.wid] = time.monotonic()
        self.changed.set()

    def asked(self, worker: Worker) -> None:
        self._mark("asked", worker)

    def ranked(self, worker: Worker) -> None:
        self._mark("ranked", worker)

    def released(self, worker: Worker) -> None:
        self._mark("released", worker)

    def trained(self, worker: Worker) -> None:
        self._mark("trained", worker)

    async def barrier(self, scope: str, generation: int, size: int) -> None:
        key = (scope, generation)
        if key not in self.barriers:
            self.barriers[key] = asyncio.Barrier(size)
        await self.barriers[key].wait()

    def kill(self, victim: Worker, exit_code: int = 137) -> None:
        """SIGKILL: its requests stop, the driver sees its exit status, its peers' collective fails at once."""
        victim.dead = True
        for task in list(victim.tasks):
            task.cancel()
        self.send(f"exit {victim.wid} {exit_code}")
        self.reset_all("member_failed")

    def reset_all(self, why: str) -> None:
        self.stats.requests[(self.stats.phase, f"reset_{why}")] += 1
        self.generation += 1
        self.reset_started = time.time()
        self.times.clear()
        for worker in self.alive():
            if worker.registered and not worker.in_reset:
                worker.round = None  # DriverWatch.left()
                worker.in_reset = True
                worker.spawn(self._reset(worker))

    async def _reset(self, worker: Worker) -> None:
        try:
            await worker.hvd_init(reset=True)
        finally:
            worker.in_reset = False
        if not worker.dead:
            await worker.trained()

    def prestart(self, worker: Worker, why: str) -> None:
        if worker.wid not in self.early:
            self.early.add(worker.wid)
            self.stats.requests[(self.stats.phase, f"early_start_{why}")] += 1
            worker.spawn(worker.early_start())

    def all_there(self, why: str = "all_there") -> None:
        """Rank 0's commit carries "every newcomer is there" (or an early start ended): every rank resets."""
        self.early.clear()
        self.reset_all(why)

    def hosts_updated(self, timestamp: float, result: int) -> None:
        """The coordinator's notification service was told of a host change (in its thread)."""
        if timestamp > self.reset_started and result & 2 and not self.early:  # added; a reset drops older ones
            for worker in self.alive():  # the commit's allreduce: every trained rank starts its Prestart
                if worker.registered and worker.round is not None:
                    self.prestart(worker, "hosts_added")


def registration_value(port: int, key: bytes) -> bytes:
    """Horovod's ``worker_addresses`` value for a notification service at ``127.0.0.1:port``."""
    import cloudpickle
    return base64.b64encode(cloudpickle.dumps(({"lo": [("127.0.0.1", port)]}, key)))
