"""Simulated workers of :mod:`bench.control_plane`: the requests real workers send the driver's store, as tasks.

One asyncio task per worker activity, each request a fresh TCP connection
with one HTTP request (as ``urllib`` and Horovod's C++ ``HTTPRequest`` send
them; the store answers HTTP/1.0 and closes), at the real intervals:

- the driver watch (:mod:`elastic_ext.runtime.driver_watch`): every
  ``POLL_S`` after the last poll, its fence rule applied as written
  (``FENCE_MIN_ATTEMPTS`` failed polls in a row over at least ``FENCE_S``),
  in the version the job runs: main's before issue 55 (``current`` and
  ``failed_<round>``, 2 s for the whole request, any failure counts) or
  after it (``Job.after``: only ``failed_<round>``, 2 s for the
  handshake, 2 s for the answer, only a handshake not completed counts); a
  worker that would fence is counted and polls on, so the load stays the
  same;
- ``hvd.init()`` as the launcher wraps it (:mod:`elastic_ext.worker.newcomer`):
  the early-start marker at a first init, the keeper's round watch
  (:mod:`elastic_ext.worker.round_watch`: ``current``, then ``failed_<r>``
  every 0.25 s while init runs), a reset's ``rank_and_size`` (answered when
  the driver's round forms), then Horovod 0.28.1's Gloo rendezvous
  (``gloo_context.cc``: global, local, cross, then, before issue 55's
  changes, the same for the global process set; after them the global
  process set shares the first three, build patch 09), each Gloo's
  ``connectFullMesh`` through ``HTTPStore`` (:meth:`Worker.gloo_context`):
  before a read of every lower rank's host name and two of every peer's
  value, then the store's ``DELETE`` of its key; after one request and no
  ``DELETE`` (Horovod built with patch 08,
  :mod:`elastic_ext.launch.gloo_exchange`);
- the sync after it: ``current``, ``assigned``, ``capacity_left_out``,
  and an early start when the round left capacity out or hosts were added
  (:mod:`elastic_ext.worker.prestart`; rank 0 polls the newcomers), the
  newcomers' side (the marker, the dismissal watch every 0.1 s, the
  announcement), Horovod's ``worker_addresses`` registration at a worker's
  first ``run`` (one real Horovod notification service in this process
  answers for every worker, so the driver's host-change notice to the
  coordinator arrives as in a job).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, List, Optional, Set, Tuple

from bench.control_plane_http import HTTPError, Unanswered, Unreachable
from elastic_ext.control import store
from elastic_ext.launch import gloo_exchange
from elastic_ext.worker import prestart, round_watch
from elastic_ext.runtime import driver_watch

ADDRESS_BYTES = 136   # gloo::transport::tcp::Address::bytes(): sockaddr_storage + sequence number
GLOO_WAIT_POLL_S = 0.01  # HTTPStore::wait sleeps 10 ms between reads of a missing key
GLOO_RETRIES, GLOO_RETRY_S = 3, 0.5  # HTTPStore::PerformHTTP: a failed request is tried 3 times, 500 ms apart
PROCESS_SET_HASH = "5d1e6b1f0a3c2e47"  # std::hash of "0,1,...," in hex: 16 digits (its value does not matter)


@functools.lru_cache(maxsize=4096)
def compact_addresses(host: str, count: int) -> bytes:
    """A rank's ``count`` pair addresses as build patch 08's ``HTTPStore`` sends them
    (:func:`elastic_ext.launch.gloo_exchange.compact`): one listening socket per pair, so they differ only in
    the sockaddr's port."""
    first = bytes([2, 0, 0, 0]) + host.encode()[-4:].rjust(4, b"\0") + bytes(ADDRESS_BYTES - 8)
    addresses = b"".join(first[:2] + (20000 + i).to_bytes(2, "big") + first[4:] for i in range(count))
    return gloo_exchange.compact(addresses, count, ADDRESS_BYTES)


class Worker:
    """One simulated worker process: its slot, its round and the activities of the module docstring."""

    def __init__(self, job: Any, wid: int, host: str, local_rank: int, ranks: List[int]) -> None:
        self.job, self.wid, self.host, self.slot_lr = job, wid, host, local_rank
        self.rank, self.size, self.local_rank, self.local_size, self.cross_rank, self.cross_size = ranks
        self.round: Optional[int] = None
        self.members: Set[str] = set()
        self.failing_since: Optional[float] = None
        self.failures = 0
        self.dead = False
        self.registered = False
        self.answers: List[Tuple[int, int]] = []   # (rank, size) of each rank_and_size answer
        self.rounds_seen: List[Tuple[Optional[int], int]] = []  # (round, its slot count) at each sync
        self.tasks: Set[asyncio.Task] = set()
        self.step = "starting"  # where it is (reported for a phase that timed out)
        self.generation = 0     # the job's reset its Gloo contexts belong to
        self.in_reset = False
        self.round_watching = False  # in hvd.init() with its round watch running

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.job.stats.failures[(self.job.stats.phase, "task", f"{type(exc).__name__}: {exc}"[:120])] += 1

    # ------------------------------------------------ the driver watch
    async def driver_watch(self) -> None:
        while not self.dead:
            await asyncio.sleep(driver_watch.POLL_S)
            if self.job.after and self.round is None and self.round_watching:
                continue  # after issue 55: the round watch alone reads the store during hvd.init()
            await self.watch_check()

    async def watch_check(self) -> None:
        s, mine, members = self.job.store, self.round, set(self.members)
        # After issue 55 the handshake has its own bound and only a failed one counts;
        # before it, one bound for the whole request and any failure counted.
        connect_s = driver_watch.CONNECT_TIMEOUT_S if self.job.after else None
        try:
            if self.job.after:  # one read, this round's failed key (the driver publishes a
                # member's failure under each round it belongs to), or ``current`` between rounds
                key = round_watch.CURRENT if mine is None else round_watch.failed_key(mine)
                who = await s.value(round_watch.SCOPE, key, driver_watch.REQUEST_TIMEOUT_S, "watch", connect_s)
                failed = [] if mine is None else [(mine, who)]
            else:  # before: ``current``, then the failed key of each round that may hold a member of this one
                current = await s.value(round_watch.SCOPE, round_watch.CURRENT, driver_watch.REQUEST_TIMEOUT_S,
                                        "watch", connect_s)
                rounds = [mine] + ([int(current)] if mine is not None and current is not None and int(current) > mine
                                   else [])
                failed = [(r, await s.value(round_watch.SCOPE, round_watch.failed_key(r),
                                            driver_watch.REQUEST_TIMEOUT_S, "watch", connect_s))
                          for r in rounds if r is not None]
        except HTTPError:
            self.failing_since, self.failures = None, 0
            return
        except Unanswered:
            if self.job.after:  # the driver's host accepted the connection: reachable, only slow
                self.job.stats.watch_unanswered[self.job.stats.phase] += 1
                self.failing_since, self.failures = None, 0
                return
            self.unreachable()
            return
        except Unreachable:
            self.unreachable()
            return
        self.failing_since, self.failures = None, 0
        for round_id, who in failed:
            if who is not None and (round_id == mine or driver_watch._slot(who) in members):
                self.round = None  # the watch cuts the links: the collective fails, as the SIGKILL made it
                return

    def unreachable(self) -> None:
        now, phase = time.monotonic(), self.job.stats.phase
        self.job.stats.watch_failed[phase] += 1
        if self.failing_since is None:
            self.failing_since = now
        self.failures += 1
        if self.failures >= driver_watch.FENCE_MIN_ATTEMPTS and now - self.failing_since >= driver_watch.FENCE_S:
            self.job.stats.fenced[phase].add(self.wid)  # would exit 75; polls on so that the load is unchanged
            self.failing_since, self.failures = None, 0

    # ------------------------------------------------ hvd.init() and what follows it
    async def first_start(self) -> None:
        s = self.job.store
        await asyncio.sleep(self.job.process_start_s)  # Python starts, imports Horovod and the framework
        marker = await s.quiet(prestart.SCOPE, prestart.MARKER, kind="init")
        if marker is not None:
            await self.newcomer()
        else:
            await self.hvd_init(reset=False)
        await self.trained()

    async def newcomer(self) -> None:
        """An early start's newcomer: solo, its dismissal watched while it builds its model, then it joins."""
        s = self.job.store
        await s.quiet(prestart.SCOPE, prestart.MARKER, kind="newcomer")  # watch_dismissal reads it again
        dismissal = self.spawn(self.poll(round_watch.SCOPE, round_watch.dismissed_key(self.host, self.slot_lr),
                                         0.1, "newcomer"))
        await asyncio.sleep(self.job.build_s)
        dismissal.cancel()
        try:
            await s.request("PUT", prestart.SCOPE, str(self.rank), store.PRESENT, secret=True, kind="newcomer")
        except Unreachable:
            pass  # newcomer.join logs it; the survivors reset at their timeout
        await self.hvd_init(reset=True)

    async def poll(self, scope: str, key: str, every_s: float, kind: str) -> None:
        """round_watch.watch_key: reads ``key`` every ``every_s`` until it exists (a failed read is retried)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                if await self.job.store.value(scope, key, kind=kind) is not None:
                    self.job.stats.requests[(self.job.stats.phase, f"{kind}_fired")] += 1
                    return
            except (Unreachable, HTTPError):
                continue

    async def hvd_init(self, reset: bool) -> None:
        s = self.job.store
        current = store.parse_round(await s.quiet(round_watch.SCOPE, round_watch.CURRENT, kind="init"))
        # After issue 55 the job's round watches together read about round_watch.JOB_READS_PER_S.
        every_s = round_watch.poll_interval(self.size) if self.job.after else round_watch.POLL_S
        watch = None if current is None else self.spawn(self.poll(
            round_watch.SCOPE, round_watch.failed_key(current + (1 if reset else 0)), every_s, "init"))
        self.round_watching = watch is not None
        try:
            if reset:
                self.step = "rank_and_size"
                self.job.asked(self)
                answer = await self.gloo("GET", prestart.RANK_SCOPE, f"{self.host}:{self.slot_lr}",
                                         kind="rank_and_size")
                fields = [int(field) for field in answer.decode().split(",")]
                self.answers.append((fields[0], fields[1]))
                if fields[0] < 0:
                    self.dead = True  # removed from the job
                    return
                self.rank, self.size, self.local_rank, self.local_size, self.cross_rank, self.cross_size = fields[:6]
                self.slot_lr = self.local_rank  # Horovod's C++ sets HOROVOD_LOCAL_RANK: the next request's key
                self.job.ranked(self)
            self.generation = self.job.generation  # the round's Gloo peers: those answered in the same reset
            if self.job.gloo:  # the global process set's own three contexts, but not with build patch 09
                for suffix in ("",) if self.job.after else ("", f"_process_set_hash_{PROCESS_SET_HASH}"):
                    await self.gloo_context("global" + suffix, self.rank, self.size)
                    await self.gloo_context(f"local_{self.host}{suffix}", self.local_rank, self.local_size)
                    await self.gloo_context(f"cross_{self.local_rank}{suffix}", self.cross_rank, self.cross_size)
        finally:
            if watch is not None:
                watch.cancel()
            self.round_watching = False
        self.step = "released"
        self.job.released(self)

    async def gloo_context(self, scope: str, rank: int, size: int) -> None:
        """Gloo's ``Context::connectFullMesh`` over Horovod's ``HTTPStore``, then its barrier and ``Finalize``."""
        started = time.monotonic()
        self.step = f"gloo {scope} rank {rank}/{size} gen {self.generation}"
        if self.job.after and size > 1:  # build patch 08: one request (asked again while held: 404)
            body = self.host.encode() + b"\n" + compact_addresses(self.host, size - 1)
            while await self.gloo("PUT", scope, f"_mesh_{rank}_{size}_{ADDRESS_BYTES}", body) != 200:
                await asyncio.sleep(GLOO_WAIT_POLL_S)
            await self.finish_gloo_context(scope, rank, size, started, delete=False)
            return
        await self.gloo("PUT", scope, f"rank_{rank}", self.host.encode())
        for peer in range(rank):  # each lower rank's host name (a plain get: no wait)
            await self.gloo("GET", scope, f"rank_{peer}")
        await self.gloo("PUT", scope, str(rank), b"\0" * (ADDRESS_BYTES * (size - 1)))
        for peer in range(size):
            if peer == rank:
                continue
            while await self.gloo("GET", scope, str(peer)) != 200:  # HTTPStore::wait
                await asyncio.sleep(GLOO_WAIT_POLL_S)
            await self.gloo("GET", scope, str(peer))  # then store.get: the same value read again
        await self.finish_gloo_context(scope, rank, size, started)

    async def finish_gloo_context(self, scope: str, rank: int, size: int, started: float,
                                  delete: bool = True) -> None:
        """Gloo's barrier over the pairs once connected, then ``Finalize`` (its ``DELETE``, but not after an
        exchange)."""
        meshed = time.monotonic()
        await self.job.barrier(scope, self.generation, size)  # gloo::barrier over the pairs, not the store
        if delete:
            await self.gloo("DELETE", scope, str(rank))
        context = scope.split("_")[0] + ("_ps" if "process_set" in scope else "")
        self.job.stats.contexts[(self.job.stats.phase, context)].append((meshed - started, time.monotonic() - started))

    async def gloo(self, method: str, scope: str, key: str, body: Optional[bytes] = None,
                   kind: str = "gloo") -> Any:
        """A request of Horovod's C++ ``HTTPStore`` (no timeout; tried 3 times): the status (the body for
        ``rank_and_size``)."""
        for _ in range(GLOO_RETRIES):
            try:
                status, answer = await self.job.store.request(method, scope, key, body, timeout_s=None, kind=kind)
                if status in (200, 404):
                    return answer if kind == "rank_and_size" else status
            except Unreachable:
                pass
            await asyncio.sleep(GLOO_RETRY_S)
        raise RuntimeError(f"HTTP request failed: {method} /{scope}/{key}")

    async def trained(self) -> None:
        """After init: Horovod's registration (once), the driver watch's join, the sync's capacity read."""
        s = self.job.store
        if not self.registered:
            self.registered = True
            try:  # Horovod's put_data_into_kvstore: a failure fails the worker (counted in the failures)
                await s.request("PUT", store.WORKER_ADDRESSES, f"{self.host}:{self.slot_lr}",
                                self.job.registration, kind="register")
            except Unreachable:
                pass
            self.spawn(self.driver_watch())
        current = await s.quiet(round_watch.SCOPE, round_watch.CURRENT, driver_watch.REQUEST_TIMEOUT_S, "sync")
        assigned = await s.quiet(round_watch.SCOPE, round_watch.ASSIGNED, driver_watch.REQUEST_TIMEOUT_S, "sync")
        self.round = None if current is None else int(current)
        self.members = set(assigned.decode().split(",")) if assigned else set()
        self.rounds_seen.append((self.round, len(self.members)))
        if await s.quiet(round_watch.SCOPE, round_watch.CAPACITY_LEFT_OUT, kind="sync") is not None:
            self.job.prestart(self, "capacity_left_out")  # each rank at its own sync
        self.job.trained(self)

    async def early_start(self) -> None:
        """:class:`elastic_ext.worker.prestart.Prestart` of this rank; rank 0 polls and tells the job.

        A failed request ends it ("error"), which resets the job at the next commit, as there."""
        try:
            await self._early_start()
        except (Unreachable, HTTPError, ValueError) as exc:
            self.job.stats.failures[(self.job.stats.phase, "prestart", f"ended: {type(exc).__name__}")] += 1
            self.job.all_there("prestart_error")

    async def _early_start(self) -> None:
        s, poll = self.job.store, self.rank == 0
        await s.request("PUT", prestart.SCOPE, prestart.ASKED, store.PRESENT, secret=True, kind="prestart")
        _, answer = await s.request("GET", prestart.RANK_SCOPE, f"{self.host}:{self.slot_lr}", timeout_s=None,
                                    kind="prestart")
        next_rank, next_size = prestart.parse_slot(answer)
        if next_rank < 0:
            return
        await s.request("PUT", prestart.SCOPE, prestart.MARKER, store.PRESENT, secret=True, kind="prestart")
        await s.request("PUT", prestart.SCOPE, str(next_rank), store.PRESENT, secret=True, kind="prestart")
        if not poll:
            return
        round_id = store.parse_round(await s.value(round_watch.SCOPE, round_watch.CURRENT, kind="prestart"))
        missing = set(range(next_size))
        while missing:
            missing = {rank for rank in sorted(missing)
                       if await s.value(prestart.SCOPE, str(rank), kind="prestart") is None}
            if missing and round_id is not None and await s.value(
                    round_watch.SCOPE, round_watch.failed_key(round_id), kind="prestart") is not None:
                return
            if missing:
                await asyncio.sleep(prestart.POLL_S)
        self.job.all_there()
