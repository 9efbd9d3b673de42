"""The control plane at scale: ``elastic-horovodrun``'s real driver and store against N simulated workers.

``python -m bench.control_plane --workers 64,256,1024`` runs, per N, the
driver of :mod:`bench.control_plane_driver` (Horovod's ``ElasticDriver``
and rendezvous server with the launcher's changes and the job's secret) in a
process of its own, and N simulated workers (:mod:`bench.control_plane_sim`)
in this one, on hosts of :data:`SLOTS` slots. Phases, each bounded by its
own timeout (reported as such, never a hang):

1. ``start``: the driver starts the N workers; each runs its first
   ``hvd.init()`` (Gloo's rendezvous only up to ``--gloo-start-max``
   workers: above, the start is not what is measured), registers, syncs.
2. ``steady``: ``--steady-s`` of training: requests per second, p50/p99
   latency, the driver's CPU (``/proc/<pid>/stat``) per second, false fences.
3. ``stalled``: the driver stopped (SIGSTOP) for ``--stall-s``, then
   continued, and ``FENCE_S + 5`` s more: the workers that would have fenced.
4. ``reset``: one worker SIGKILLed (the driver sees its exit status; its
   peers' collective fails at once): ``round_formed_s`` is the time until
   every survivor's ``hvd.init()`` returned (``rank_s``: until every
   survivor had its rank). Gloo's rendezvous reads every peer's address
   twice, a value of 136 bytes per peer: about ``2.5 N^2`` requests and
   ``272 N^3`` bytes per global context; where it cannot end in
   ``--reset-timeout-s`` the measured rate and the extrapolation are
   reported instead.
5. ``regrow``: the round left the failed slot out; the survivors' early
   start brings its new worker in (a second reset).
6. ``host_added``: a host of :data:`SLOTS` slots is added to discovery; the
   coordinator's notice starts an early start (a third reset).

``--validate`` compares the simulation with real jobs of 4 and 6 workers
(:mod:`bench.control_plane_validate`). Results: ``bench/results/control_plane.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from bench.control_plane_sim import ADDRESS_BYTES, Job, registration_value
from elastic_ext.runtime import driver_watch

SLOTS = 8
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "control_plane.json")


def driver_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gloo_requests(size: int) -> int:
    """The fewest store requests of one Gloo context of ``size`` ranks (no read of a missing key)."""
    return 3 * size + size * (size - 1) // 2 + 2 * size * (size - 1)


class Run:
    """One N: the driver process, the simulated job, the phases."""

    def __init__(self, n: int, args: argparse.Namespace) -> None:
        self.n, self.args = n, args
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
        self.marks = (time.monotonic(), driver_cpu_s(self.proc.pid), time.process_time())

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
                   "sim_cpu_cores": round((time.process_time() - self.marks[2]) / wall, 3),
                   "failed_requests": {f"{kind} {why}": n for (phase, kind, why), n in stats.failures.items()
                                       if phase == name},
                   "fenced": len(stats.fenced.get(name, ())),
                   "watch_failed_polls": stats.watch_failed.get(name, 0),
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
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.control_plane_driver", "--hosts-file", self.hosts_file, "--np", str(n),
            "--min-np", str(max(1, n // 2)), "--max-np", str(n + self.slots), "--secret", secret,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.driver_log, cwd=os.path.dirname(HERE),
            limit=1 << 20)
        assert self.proc.stdout is not None
        port = int((await asyncio.wait_for(self.proc.stdout.readline(), 60)).split()[1])
        self.job = Job(port, secret, self.send, gloo=n <= args.gloo_start_max, build_s=args.build_s,
                       registration=registration_value(service.addresses()["lo"][0][1], key),
                       process_start_s=args.process_start_s)
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
        started = await self.until("start", lambda: len(job.times.get("trained", {})) >= n, args.start_timeout_s)
        await self.close_phase("start")
        if not started:
            return
        await self.phase("steady")
        await asyncio.sleep(args.steady_s)
        steady = await self.close_phase("steady")
        await self.phase("stalled")
        os.kill(self.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(args.stall_s)
        os.kill(self.proc.pid, signal.SIGCONT)
        await asyncio.sleep(driver_watch.FENCE_S + 5)
        stalled = await self.close_phase("stalled")
        self.result.update({k: steady[k] for k in ("requests_per_s", "p50_ms", "p99_ms", "driver_cpu_cores")})
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
        """The reset's Gloo requests that ended in the bound, and the time all of them would take at that rate."""
        gloo = reset["by_kind"].get("gloo", 0)
        slots = self.slots
        local = [slots] * (size // slots) + ([size % slots] if size % slots else [])
        total = 2 * (gloo_requests(size) + sum(gloo_requests(s) for s in local)
                     + sum(gloo_requests(len([h for h in local if h > lr])) for lr in range(slots)))
        rate = gloo / reset["wall_s"] if reset["wall_s"] else 0.0
        self.result["reset_extrapolated"] = {
            "gloo_requests_done": gloo, "gloo_requests_needed": total,
            "gloo_requests_per_s": round(rate, 1),
            "round_formed_s_extrapolated": round(total / rate, 1) if rate else None,
            "gloo_bytes_read_needed": 2 * 2 * size * (size - 1) * ADDRESS_BYTES * (size - 1),
            "note": f"the reset did not end in {self.args.reset_timeout_s} s: Gloo's full-mesh rendezvous needs "
                    f"{total} store requests; at the measured rate it would take the time given"}


def machine() -> Dict[str, Any]:
    return {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unknown ({exc})"


def run_one(n: int, args: argparse.Namespace) -> Dict[str, Any]:
    run = Run(n, args)
    with tempfile.TemporaryDirectory(prefix="control_plane.") as tmp:
        run.tmp = tmp
        started = time.monotonic()
        result = asyncio.run(asyncio.wait_for(run.go(), args.run_timeout_s))
        result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="64,256,1024")
    parser.add_argument("--version", default="before", help="results.<version> (before: today's main)")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--stall-s", type=float, default=5.0)
    parser.add_argument("--start-timeout-s", type=float, default=90.0)
    parser.add_argument("--reset-timeout-s", type=float, default=45.0)
    parser.add_argument("--run-timeout-s", type=float, default=400.0)
    parser.add_argument("--gloo-start-max", type=int, default=64)
    parser.add_argument("--build-s", type=float, default=1.0, help="a newcomer's model build (s)")
    parser.add_argument("--process-start-s", type=float, default=1.0,
                        help="a worker's process start to its first request (Python, Horovod, the framework)")
    parser.add_argument("--slots", type=int, default=SLOTS, help="slots per simulated host")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--until", choices=("reset", "host_added"), default="host_added",
                        help="the last phase to run (the suite's test stops after the reset)")
    parser.add_argument("--validate", action="store_true")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.validate:
        from bench import control_plane_validate
        control_plane_validate.main(args)
        return
    doc: Dict[str, Any] = {}
    if os.path.exists(args.output):
        with open(args.output) as handle:
            doc = json.load(handle)
    for n in [int(w) for w in args.workers.split(",")]:
        print(f"control_plane: N={n} ...", flush=True)
        result = run_one(n, args)
        print(json.dumps({k: v for k, v in result.items() if k not in ("phases", "driver_counts")}), flush=True)
        doc.setdefault("results", {}).setdefault(args.version, {})[str(n)] = result
        doc.update({"machine": machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "commit": commit(), "command": "python -m bench.control_plane " + " ".join(
                        sys.argv[1:] if argv is None else argv)})
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as handle:
            json.dump(doc, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
