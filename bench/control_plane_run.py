"""One N of :mod:`bench.control_plane`: the driver's process, the simulated job, the phases and their figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from bench.control_plane_job import Job, registration_value
from bench.control_plane_model import driver_cpu_s, extrapolate, listen_overflows, percentile
from elastic_ext.runtime import driver_watch

SLOTS = 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(REPO, "bench", "control_plane_driver.py")


class Run:
    """One N of one code version: the driver process (``elastic_ext`` of ``tree``), the simulated job, the
    phases. ``after``: the workers speak the protocol of main after issue 55's changes
    (:mod:`bench.control_plane_sim` says what each changes), or before them.
    """

    def __init__(self, n: int, args: argparse.Namespace, tree: str = REPO, after: bool = True) -> None:
        self.n, self.args, self.tree, self.after = n, args, tree, after
        self.slots = args.slots
        self.hosts = {f"host-{i:03d}": min(self.slots, n - i * self.slots)
                      for i in range((n + self.slots - 1) // self.slots)}
        self.result: Dict[str, Any] = {"timeouts": {}}
        self.counts_future: Optional[asyncio.Future] = None

    def write_hosts(self) -> None:
        with open(self.hosts_file + ".tmp", "w") as handle:
            json.dump(self.hosts, handle)
        os.replace(self.hosts_file + ".tmp", self.hosts_file)

    async def driver_lines(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            words = raw.decode().split()
            if words[:1] == ["start"]:
                self.job.start_worker(int(words[1]), words[2], int(words[3]), [int(w) for w in words[4:10]])
            elif words[:1] == ["counts"] and self.counts_future is not None:
                self.counts_future.set_result(json.loads(raw.decode()[len("counts "):]))
            elif words[:1] == ["terminated"]:
                worker = self.job.workers.get(int(words[1]))
                if worker is not None:
                    worker.dead = True

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())

    async def counts(self) -> Dict[str, int]:
        self.counts_future = asyncio.get_running_loop().create_future()
        self.send("counts")
        return await asyncio.wait_for(self.counts_future, 30)

    async def until(self, name: str, predicate: Any, timeout_s: float) -> bool:
        """Waits for ``predicate()``; on timeout records the phase as timed out (False)."""
        end = time.monotonic() + timeout_s
        while not predicate():
            left = end - time.monotonic()
            if left <= 0:
                self.result["timeouts"][name] = timeout_s
                steps: Dict[str, int] = {}
                for worker in self.job.alive():
                    steps[worker.step] = steps.get(worker.step, 0) + 1
                    if os.environ.get("CP_DEBUG"):
                        print("STUCK", worker.wid, worker.host, worker.slot_lr, worker.rank, worker.size, worker.local_rank,
                              worker.local_size, worker.cross_rank, worker.cross_size, worker.step, file=sys.stderr)
                self.result.setdefault("stuck", {})[name] = steps
                return False
            self.job.changed.clear()
            try:
                await asyncio.wait_for(self.job.changed.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        return True

    async def phase(self, name: str) -> None:
        self.counts_before = await self.counts()
        self.job.stats.phase = name
        self.marks = (time.monotonic(), driver_cpu_s(self.proc.pid), time.process_time(), listen_overflows())

    async def close_phase(self, name: str) -> Dict[str, Any]:
        wall = time.monotonic() - self.marks[0]
        driver_cpu = driver_cpu_s(self.proc.pid) - self.marks[1]
        after = await self.counts()
        store_requests = {k: n - self.counts_before.get(k, 0) for k, n in after.items()
                          if n != self.counts_before.get(k, 0)}
        stats = self.job.stats
        lat = stats.latency.get(name, [])
        figures = {"wall_s": round(wall, 3), "requests": len(lat),
                   "requests_per_s": round(len(lat) / wall, 1) if wall else None,
                   "p50_ms": None if not lat else round(1000 * percentile(lat, 0.5), 2),
                   "p99_ms": None if not lat else round(1000 * percentile(lat, 0.99), 2),
                   "driver_cpu_cores": round(driver_cpu / wall, 3),
                   "driver_cpu_ms_per_request": round(1000 * driver_cpu / max(1, sum(store_requests.values())), 3),
                   "store_requests": store_requests,
                   "listen_overflows": listen_overflows() - self.marks[3],
                   "sim_cpu_cores": round((time.process_time() - self.marks[2]) / wall, 3),
                   "failed_requests": {f"{kind} {why}": n for (phase, kind, why), n in stats.failures.items()
                                       if phase == name},
                   "fenced": len(stats.fenced.get(name, ())),
                   "watch_failed_polls": stats.watch_failed.get(name, 0),
                   "watch_unanswered_polls": stats.watch_unanswered.get(name, 0),
                   "by_kind": {kind: n for (phase, kind), n in stats.requests.items() if phase == name},
                   "gloo_contexts_s": {context: {"mesh_max": round(max(m for m, _ in times), 3),
                                                 "done_max": round(max(d for _, d in times), 3)}
                                       for (phase, context), times in stats.contexts.items() if phase == name}}
        self.result.setdefault("phases", {})[name] = figures
        return figures

    def survivors_done(self, event: str, expected: int) -> bool:
        return len([w for w in self.job.alive() if w.wid in self.job.times.get(event, {})]) >= expected

    async def go(self) -> Dict[str, Any]:
        n, args = self.n, self.args
        loop = asyncio.get_running_loop()
        self.hosts_file = os.path.join(self.tmp, "hosts.json")
        # The driver's log (Horovod's and the launcher's warnings, the store's broken pipes of requests whose
        # client gave up): counted, not printed.
        self.driver_log = open(os.path.join(self.tmp, "driver.log"), "wb")
        self.write_hosts()
        secret = secrets.token_hex(32)
        from horovod.runner.common.util import secret as horovod_secret
        from horovod.runner.elastic.worker import WorkerNotificationService
        key = horovod_secret.make_secret_key()
        job_ref: List[Job] = []

        class Manager:  # the coordinator's notification manager: a host notice starts an early start
            def handle_hosts_updated(self, timestamp: float, result: int) -> None:
                loop.call_soon_threadsafe(job_ref[0].hosts_updated, timestamp, int(result))

        service = WorkerNotificationService(key, "lo", Manager())
        # The driver's script copied out of bench/ and run with the version's tree first on the path: its
        # elastic_ext is that version's (it reports which), whatever this process imported.
        script = shutil.copy(DRIVER, os.path.join(self.tmp, "control_plane_driver.py"))
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, script, "--hosts-file", self.hosts_file, "--np", str(n),
            "--min-np", str(max(1, n // 2)), "--max-np", str(n + self.slots), "--secret", secret,
            *(["--backlog", str(args.driver_backlog)] if args.driver_backlog else []),
            *(["--exchange-hold-s", str(args.exchange_hold_s)] if args.exchange_hold_s is not None else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.driver_log, cwd=self.tree,
            env=dict(os.environ, PYTHONPATH=self.tree), limit=1 << 20)
        assert self.proc.stdout is not None
        words = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode().split()
        port = int(words[1])
        self.result["driver_elastic_ext"] = words[2] if len(words) > 2 else None
        self.job = Job(port, secret, self.send, gloo=n <= args.gloo_start_max, build_s=args.build_s,
                       registration=registration_value(service.addresses()["lo"][0][1], key),
                       process_start_s=args.process_start_s, after=self.after)
        job_ref.append(self.job)
        reader = loop.create_task(self.driver_lines())
        try:
            await self.phases()
        finally:
            self.result["driver_counts"] = await self.counts() if self.proc.returncode is None else {}
            self.send("quit")
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:
                self.proc.kill()
            reader.cancel()
            service.shutdown()
            self.driver_log.close()
            with open(self.driver_log.name, errors="replace") as handle:
                log = handle.read()
            self.result["driver_log"] = {"broken_pipes": log.count("BrokenPipeError"),
                                         "connection_resets": log.count("ConnectionResetError"),
                                         "tail": log[-1500:] if self.proc.returncode not in (0, None) else ""}
            for worker in self.job.workers.values():
                for task in list(worker.tasks):
                    task.cancel()
        return self.result

    async def phases(self) -> None:
        n, args, job = self.n, self.args, self.job
        await self.phase("start")
        await self.until("start", lambda: len(job.times.get("trained", {})) >= n, args.start_timeout_s)
        await self.close_phase("start")
        # A start that did not end in its bound goes on: the steady load is that of the workers there.
        self.result["trained_at_steady"] = len(job.times.get("trained", {}))
        await self.phase("steady")
        await asyncio.sleep(args.steady_s)
        steady = await self.close_phase("steady")
        await self.phase("stalled")
        os.kill(self.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(args.stall_s)
        os.kill(self.proc.pid, signal.SIGCONT)
        await asyncio.sleep(driver_watch.FENCE_S + 5 if args.after_stall_s is None else args.after_stall_s)
        stalled = await self.close_phase("stalled")
        self.result.update({k: steady[k] for k in ("requests_per_s", "p50_ms", "p99_ms", "driver_cpu_cores")})
        # What the workers ask in steady training: the driver watch's reads per poll, 2 before issue 55, 1 after.
        reads = 1 if self.after else 2
        self.result["requests_asked_per_s"] = round(reads * len(job.alive()) / driver_watch.POLL_S, 1)
        self.result["false_fences_stalled"] = stalled["fenced"]
        # A SIGKILL of one worker (not the coordinator): the round forms from the others.
        victim = sorted(job.alive(), key=lambda w: w.rank)[min(3, n - 1)]
        self.result["victim"] = f"{victim.host}[{victim.slot_lr}]"
        job.gloo = True
        await self.phase("reset")
        killed = time.monotonic()
        job.kill(victim)
        survivors = [w for w in job.alive()]
        formed = await self.until("reset", lambda: self.survivors_done("released", len(survivors)),
                                  args.reset_timeout_s)
        ranked = job.times.get("ranked", {})
        self.result["rank_s"] = round(max(ranked.values()) - killed, 3) if len(ranked) >= len(survivors) else None
        reset = await self.close_phase("reset")
        released = job.times.get("released", {})
        self.result["round_formed_s"] = round(max(released.values()) - killed, 3) if formed else None
        # When the survivors sent their rank request, had their rank and were released: first, median, last.
        self.result["reset_phases_s"] = {
            event: [round(times[0], 3), round(times[len(times) // 2], 3), round(times[-1], 3)]
            for event, times in ((event, sorted(t - killed for t in job.times.get(event, {}).values()))
                                 for event in ("asked", "ranked", "released")) if times}
        self.result["survivors_released"] = len([w for w in survivors if w.wid in released])
        self.result["survivors"] = len(survivors)
        self.result["survivor_answers"] = sorted({w.answers[-1][1] for w in survivors if w.answers})
        # The failed member is absent: the round has one slot per survivor, and each survivor holds one of them.
        answers = [w.answers[-1] for w in survivors if w.answers]
        self.result["survivor_ranks_distinct"] = sorted(rank for rank, _ in answers) == list(range(len(survivors)))
        self.result["false_fences"] = steady["fenced"] + reset["fenced"]
        if not formed:
            self.extrapolate(reset, len(survivors))
            return
        await self.until("trained_after_reset", lambda: self.survivors_done("trained", len(survivors)), 30)
        # Each survivor's first sync after the kill: the slots of the round it trains in.
        seen = {len(w.rounds_seen) for w in survivors}
        self.result["round_slots"] = sorted({w.rounds_seen[-1][1] for w in survivors if w.rounds_seen})
        if len(seen) != 1:
            self.result["round_slots"] = None  # some survivor synced in more rounds than another: not one round
        if args.until == "reset":
            return
        await self.phase("regrow")
        regrown = await self.until("regrow", lambda: len(job.alive()) >= n and self.survivors_done("released", n),
                                   args.reset_timeout_s)
        await self.close_phase("regrow")
        if not regrown:
            return
        await self.until("trained_after_regrow", lambda: self.survivors_done("trained", n), 30)
        await self.phase("host_added")
        added = time.monotonic()
        self.hosts[f"host-{len(self.hosts):03d}"] = self.slots
        self.write_hosts()
        grown = await self.until("host_added", lambda: len(job.alive()) >= n + self.slots
                                 and self.survivors_done("released", n + self.slots), args.reset_timeout_s)
        await self.close_phase("host_added")
        if grown:
            self.result["host_added_s"] = round(max(job.times["released"].values()) - added, 3)

    def extrapolate(self, reset: Dict[str, Any], size: int) -> None:
        self.result["reset_extrapolated"] = extrapolate(reset, size, self.slots, self.args.reset_timeout_s,
                                                        self.after)
