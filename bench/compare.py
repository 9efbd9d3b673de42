"""Side by side under the same failures: plain Horovod elastic, torchrun, elastic_ext.

One run, the same model, data, global batch and failure schedule for every system:

- ``plain``: Horovod elastic as its examples write it (``hvd.elastic.TorchState``,
  ``@hvd.elastic.run``, Horovod's ``ElasticSampler``): bench/workers/compare_plain.py;
- ``torchrun``: ``torchrun`` elastic restarts from a checkpoint (DDP over Gloo,
  c10d rendezvous, rank 0 saves every N steps): bench/workers/compare_torchrun.py;
- ``ext``: elastic_ext (``elastic_ext.State``, ``@elastic_ext.run``, its
  ``ElasticSampler``): bench/workers/compare_ext.py.

Each worker trains the digits MLP of examples/pytorch_elastic.py on 4
workers (global batch 64, commit or checkpoint every ``--commit-every`` steps
and at each epoch's end, ``--compute-ms-per-sample`` of emulated compute: a
sleep before the allreduce, since the MLP itself takes a millisecond).

- Horovod (plain, ext): ``horovodrun -np 4 --min-np 2 --max-np 4`` with a
  host file of two pseudo-hosts with 2 slots each (localhost, 127.0.0.1). A
  SIGKILL blacklists the failed worker's host; the job goes on with the 2
  survivors. Once it has, the driver adds a spare pseudo-host (another name
  of this machine: the hostname, other local names from /etc/hosts, the
  non-loopback IPv4 addresses) and the job grows back to 4.
- torchrun: two agents on this machine, ``--nnodes 1:2 --nproc-per-node 2
  --rdzv-backend c10d --rdzv-endpoint localhost:PORT --max-restarts 10``;
  a failure restarts all 4 workers, which load the last checkpoint.

Failure schedule (the same for all): ``--uptime-s`` seconds plus a seeded
jitter of 0 to 2 s (the same draws for every system, so that failures fall
anywhere in the commit interval) after the job first has 4 workers, and
again each time it is back to 4 after a failure, the driver SIGKILLs the
worker with the highest rank, ``--failures`` times; ``--uptime-s`` after the
last recovery it stops the job at a step boundary (a stop file the workers
read at commit steps). A job that dies instead of recovering is relaunched
once for the failures left (a relaunched torchrun job resumes from its
checkpoint; Horovod jobs keep no durable state here and start over).
Then each system runs two failure-free jobs of ``--overhead-s`` seconds,
in the order A B C C B A, for the throughput without failures.

Measured: time to resume (SIGKILL to the first step completed by the
re-formed job, on any number of workers), time back to 4 workers, steps lost
(steps done before the failure minus the step training resumed from); these
three over the failures the job survived, job deaths counted apart with the
steps they lost;
goodput (samples in the committed history per second, first step to last,
failures and relaunches included), throughput without failures (samples per
second of the failure-free jobs from 1 s after their first step; the same
over the stretches at 4 workers between failures is kept as a cross-check),
commit cost (seconds in commit or checkpoint on rank 0, per
commit and per step), and samples duplicated or skipped over the committed
history (every worker logs its per-step sample ids in the format of
``elastic_ext.ledger``; each generation undoes the steps at or after the
position it resumed from: for torchrun, the checkpoint the restart loaded).

    .venv/bin/python -m bench.compare [--failures 3] [--uptime-s 10] [--overhead-s 12]

Writes bench/results/compare.json, compare_timeline.png and compare_ratios.png.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import psutil

from bench.common import machine
from elastic_ext.testing import launch, ledger

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
WORKERS = os.path.join(HERE, "workers")
SYSTEMS = ("plain", "torchrun", "ext")
LABELS = {"plain": "plain Horovod", "torchrun": "torchrun", "ext": "elastic_ext"}
WORKERS_PER_JOB = 4
SLOTS_PER_HOST = 2
DATASET_SIZE = 1500
TORCHRUN_MAX_RESTARTS = 10
ATTEMPTS = 2  # a job that dies is relaunched once for the failures left
POLL_S = 0.1
START_TIMEOUT_S = 180.0
RESUME_TIMEOUT_S = 150.0
STOP_TIMEOUT_S = 120.0
WARMUP_S = 1.0  # throughput stretches start this long after the job is at 4 workers
# Each SIGKILL comes uptime_s plus a jitter after the job is back at 4 workers, so that it falls at
# a random point of the commit interval (a fixed delay locks onto the commit period and makes
# every failure lose the same number of steps). The jitters are seeded: the same for every system.
JITTER_S = 2.0
GEN_STRIDE = 10 ** 19  # generation ids of attempt a become a * GEN_STRIDE + id (ids are < 2**63)


# ------------------------------------------------------------------ machine


def local_host_names() -> List[str]:
    """Names that resolve to an address of this machine, so horovodrun runs them without ssh.

    Each is a separate host to Horovod (blacklisted on its own), which gives
    a job on one machine spare hosts to grow back onto after a failure.
    """
    addresses = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    candidates = ["localhost", "127.0.0.1", socket.gethostname()]
    try:
        with open("/etc/hosts", encoding="utf-8") as handle:
            for line in handle:
                fields = line.split("#", 1)[0].split()
                if fields and fields[0] in addresses:
                    candidates.extend(fields[1:])
    except OSError:
        pass
    candidates.extend(sorted(a for a in addresses if not a.startswith("127.")))
    names: List[str] = []
    for name in candidates:
        try:
            if name not in names and socket.gethostbyname(name) in addresses:
                names.append(name)
        except OSError:
            continue
    return names


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------- step logs


class StepTail:
    """Reads the workers' step logs incrementally (whole lines only)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.offsets: Dict[str, int] = {}
        self.records: List[dict] = []

    def poll(self) -> List[dict]:
        new = []
        for path in glob.glob(os.path.join(self.directory, "steps-*.jsonl")):
            with open(path, "rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                data = handle.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.records.extend(new)
        return new

    def last_step(self) -> Optional[dict]:
        """The newest completed step ("done" record)."""
        return max((r for r in self.records if "done" in r), key=lambda r: r["t"], default=None)


# ------------------------------------------------------------------- jobs


def worker_args(log_dir: str, args: argparse.Namespace) -> List[str]:
    return ["--out", log_dir, "--data", args.data, "--global-batch", str(args.global_batch),
            "--commit-every", str(args.commit_every), "--compute-ms-per-sample", str(args.compute_ms_per_sample)]


def horovod_jobs(system: str, log_dir: str, hosts_file: str, args: argparse.Namespace) -> List[launch.Job]:
    cmd = [os.path.join(launch.VENV_BIN, "horovodrun"), "-np", str(WORKERS_PER_JOB), "--min-np", "2",
           "--max-np", str(WORKERS_PER_JOB), "--network-interfaces", "lo",
           "--host-discovery-script", f"{launch.STATIC} {hosts_file}",
           sys.executable, os.path.join(WORKERS, f"compare_{system}.py"), *worker_args(log_dir, args)]
    env = launch.base_env(HOROVOD_FUSION_THRESHOLD=str(64 * 1024 * 1024),  # Horovod's default: not comparing bits
                          ELASTIC_EXT_EVENTS_PATH=os.path.join(log_dir, "events-{rank}.jsonl"))
    return [launch.Job(cmd, env, os.path.join(log_dir, "horovodrun.log"))]


def torchrun_jobs(log_dir: str, checkpoint: str, args: argparse.Namespace) -> List[launch.Job]:
    port = free_port()
    # With the rendezvous TCP store shared with the workers (the default), the workers of the
    # agent whose own workers did not fail read the previous attempt's keys after a restart
    # (the attempt number is TORCHELASTIC_RESTART_COUNT, counted per agent) and connect to
    # dead ports: pytorch/pytorch#135712, reproduced here. Its documented workaround:
    env = launch.base_env(GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    jobs = []
    for agent in range(2):
        cmd = [os.path.join(launch.VENV_BIN, "torchrun"), "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
               "--rdzv-id", f"compare-{os.getpid()}-{port}", "--max-restarts", str(TORCHRUN_MAX_RESTARTS),
               os.path.join(WORKERS, "compare_torchrun.py"), *worker_args(log_dir, args), "--checkpoint", checkpoint]
        jobs.append(launch.Job(cmd, env, os.path.join(log_dir, f"torchrun-agent{agent}.log")))
        time.sleep(0.5)  # the first agent hosts the c10d store
    return jobs


class Attempt:
    """One launched job of one system, driven through (part of) the failure schedule."""

    def __init__(self, system: str, log_dir: str, jobs: List[launch.Job], launched: float) -> None:
        self.system = system
        self.log_dir = log_dir
        self.jobs = jobs
        self.launched = launched
        self.tail = StepTail(log_dir)
        self.failures: List[Dict[str, Any]] = []
        self.problems: List[str] = []
        self.first_full: Optional[float] = None  # time of the first step with 4 workers
        self.exit_codes: List[Optional[int]] = []
        self.ended = launched

    def alive(self) -> bool:
        return all(job.proc.poll() is None for job in self.jobs)

    def pids(self) -> set:
        pids = set()
        for job in self.jobs:
            job.track()
            pids |= job.descendants
        return pids

    def wait_for(self, predicate: Callable[[dict], bool], timeout_s: float, what: str) -> Optional[dict]:
        """The earliest record, already read or still to come, that satisfies ``predicate``."""
        seen = [r for r in self.tail.records if predicate(r)]
        if seen:
            return min(seen, key=lambda r: r["t"])
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for record in self.tail.poll():
                if predicate(record):
                    return record
            if not self.alive():
                self.problems.append(f"the job exited while waiting for {what}")
                return None
            self.pids()
            time.sleep(POLL_S)
        self.problems.append(f"no {what} within {timeout_s:.0f} s")
        return None

    def idle_until(self, when: float) -> None:
        while time.time() < when and self.alive():
            self.tail.poll()
            self.pids()
            time.sleep(POLL_S)


def run_attempt(system: str, log_dir: str, hosts: List[str], failures: int, checkpoint: str,
                args: argparse.Namespace, first_failure: int = 0, uptime_s: Optional[float] = None) -> Attempt:
    """Launches a job of ``system`` and drives it through ``failures`` SIGKILLs, then stops it.

    After each SIGKILL it waits for the first step after it; for Horovod jobs
    it then adds a spare pseudo-host to the host file (capacity coming back)
    and waits until the job has 4 workers again. ``first_failure`` numbers
    the failures (it picks their jitters); ``uptime_s`` overrides the
    setting of that name.
    """
    uptime_s = args.uptime_s if uptime_s is None else uptime_s
    os.makedirs(log_dir)
    hosts_file = os.path.join(log_dir, "hosts")
    in_use, spares = list(hosts[:2]), list(hosts[2:])
    launch.write_hosts(hosts_file, [f"{host}:{SLOTS_PER_HOST}" for host in in_use])
    launched = time.time()
    if system == "torchrun":
        jobs = torchrun_jobs(log_dir, checkpoint, args)
    else:
        jobs = horovod_jobs(system, log_dir, hosts_file, args)
    run = Attempt(system, log_dir, jobs, launched)
    first = run.wait_for(lambda r: "done" in r and r["size"] == WORKERS_PER_JOB, START_TIMEOUT_S, "first step")
    full_at = first["t"] if first else None
    run.first_full = full_at
    for number in range(first_failure, first_failure + failures if first else 0):
        run.idle_until(full_at + uptime_s + random.Random(number).uniform(0, JITTER_S))
        run.tail.poll()
        gen = run.tail.last_step()["g"]
        victim = max((r for r in run.tail.records if r.get("start") == gen), key=lambda r: r["rank"])
        if victim["pid"] not in run.pids():  # never signal a process this job did not start
            run.problems.append(f"victim pid {victim['pid']} is not a process of this job")
            break
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        failure: Dict[str, Any] = {"killed_at": killed_at, "pid": victim["pid"], "rank": victim["rank"], "gen": gen,
                                   "number": number}
        run.failures.append(failure)
        print(f"  {LABELS[system]}: SIGKILL rank {victim['rank']} (pid {victim['pid']}) "
              f"{killed_at - launched:.1f} s after launch", flush=True)
        back = run.wait_for(lambda r: "done" in r and r["g"] != gen and r["t"] > killed_at, RESUME_TIMEOUT_S,
                            "step after the failure")
        if back is None:
            break
        failure["resumed_at"] = back["t"]
        full = back
        if back["size"] < WORKERS_PER_JOB:
            if not spares:
                run.problems.append("no spare host left to grow back to 4 workers")
                break
            in_use.append(spares.pop(0))
            launch.write_hosts(hosts_file, [f"{host}:{SLOTS_PER_HOST}" for host in in_use])
            failure["host_added_at"], failure["host_added"] = time.time(), in_use[-1]
            full = run.wait_for(lambda r: "done" in r and r["size"] == WORKERS_PER_JOB and r["t"] > back["t"],
                                RESUME_TIMEOUT_S, "4 workers again")
            if full is None:
                break
        failure["full_at"] = full_at = full["t"]
        print(f"  {LABELS[system]}: first step {back['t'] - killed_at:.1f} s after the SIGKILL "
              f"(on {back['size']} workers), 4 workers after {full['t'] - killed_at:.1f} s", flush=True)
    if full_at is not None and not run.problems:
        run.idle_until(full_at + uptime_s)
        run.tail.poll()
        stop = (run.tail.last_step()["done"] // args.commit_every + 3) * args.commit_every
        with open(os.path.join(log_dir, "stop.tmp"), "w") as handle:
            handle.write(f"{stop}\n")
        os.replace(os.path.join(log_dir, "stop.tmp"), os.path.join(log_dir, "stop"))
    for job in jobs:
        try:
            code, _ = job.wait(STOP_TIMEOUT_S if not run.problems else 5)
        except AssertionError:
            code = None
            if not run.problems:
                run.problems.append(f"{os.path.basename(job.log_path)} did not stop in {STOP_TIMEOUT_S:.0f} s")
        run.exit_codes.append(code)
    run.ended = time.time()
    return run


def run_system(system: str, work: str, hosts: List[str], args: argparse.Namespace) -> List[Attempt]:
    attempts: List[Attempt] = []
    left = args.failures
    checkpoint = os.path.join(work, system, "checkpoint.pt")  # torchrun only; survives a relaunch
    for index in range(ATTEMPTS):
        run = run_attempt(system, os.path.join(work, system, f"attempt-{index}"), hosts, left, checkpoint, args,
                          first_failure=args.failures - left)
        attempts.append(run)
        left -= len(run.failures)
        print(f"  {LABELS[system]}: attempt {index} ended after {run.ended - run.launched:.0f} s, exit codes "
              f"{run.exit_codes}" + (f"; {'; '.join(run.problems)}" if run.problems else ""), flush=True)
        if not run.problems:
            break
        if run.first_full is None:
            break  # it never started: relaunching would not help
    return attempts


# --------------------------------------------------------------- analysis


def median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def combined_records(attempts: List[Attempt]) -> List[dict]:
    """Every attempt's records, generation ids made unique across attempts (attempt a first)."""
    records = []
    for index, run in enumerate(attempts):
        for record in ledger.read(run.log_dir):
            if "gen" in record:
                record["gen"] = index * GEN_STRIDE + record["gen"]
            if "g" in record:
                record["g"] = index * GEN_STRIDE + record["g"]
            if "start" in record:
                record["start"] = index * GEN_STRIDE + record["start"]
            record["attempt"] = index
            records.append(record)
    return records


def committed_history(records: List[dict]) -> List[dict]:
    """The steps whose effect is in the final state, over generations in order.

    Each generation undoes every step at or after the position it resumed
    from, whichever generation ran it. This is ``elastic_ext.ledger``'s rule
    made general: the ledger only cuts the generation just before, which is
    all a rollback inside one job needs, but a job relaunched from scratch
    (or from a checkpoint older than the last generation) undoes more.
    """
    begun = ledger.starts(records)
    history: List[dict] = []
    for gen in sorted(begun):
        start = begun[gen][:2]
        history = [r for r in history if (r["epoch"], r["cursor"]) < start]
        history.extend(r for r in records if r.get("gen") == gen and (r["epoch"], r["cursor"]) >= start)
    return history


def audit(history: List[dict], epochs: int) -> Dict[str, Any]:
    """Samples seen twice and never, per complete epoch of the committed history (as ``ledger.audit``)."""
    rows = []
    for epoch in range(epochs):
        seen = [i for r in history if r["epoch"] == epoch for i in r["indices"]]
        counts = np.bincount(np.asarray(seen, dtype=np.int64), minlength=DATASET_SIZE)
        rows.append({"epoch": epoch, "processed": len(seen), "duplicated": int((counts > 1).sum()),
                     "missing": int((counts == 0).sum())})
    return {"epochs": rows, "duplicated": sum(r["duplicated"] for r in rows),
            "missing": sum(r["missing"] for r in rows)}


def throughput(steps: List[dict], stretches: List[tuple]) -> Dict[str, Any]:
    """All ranks' samples per second over the given (from, to) stretches, at 4 workers only.

    ``steps`` are "done" records (completed steps), sorted by time.
    """
    samples_total, seconds, step_count, windows = 0, 0.0, 0, []
    for begin, end in stretches:
        ticks = [r["t"] for r in steps if begin + WARMUP_S <= r["t"] < end and r["rank"] == 0
                 and r["size"] == WORKERS_PER_JOB]
        if len(ticks) < 3:
            continue
        samples = sum(r["n"] for r in steps if ticks[0] < r["t"] <= ticks[-1] + 0.05 and r["size"] == WORKERS_PER_JOB)
        samples_total += samples
        seconds += ticks[-1] - ticks[0]
        step_count += len(ticks) - 1
        windows.append({"from": begin, "to": end, "samples_per_s": samples / (ticks[-1] - ticks[0])})
    return {"samples_per_s": samples_total / seconds if seconds else None,
            "step_time_s": seconds / step_count if step_count else None, "windows": windows}


def analyze(system: str, attempts: List[Attempt]) -> Dict[str, Any]:
    records = combined_records(attempts)
    steps = sorted((r for r in records if "done" in r), key=lambda r: r["t"])  # completed steps
    begun: Dict[int, dict] = {}
    for r in sorted((r for r in records if "start" in r), key=lambda r: r["t"]):
        begun.setdefault(r["start"], r)
    result: Dict[str, Any] = {
        "system": system, "label": LABELS[system],
        "attempts": [{"launched_s": run.launched - attempts[0].launched, "wall_s": run.ended - run.launched,
                      "exit_codes": run.exit_codes, "problems": run.problems, "failures": len(run.failures),
                      "log_dir": run.log_dir} for run in attempts],
    }
    if not steps:
        result["problems"] = ["no step completed"]
        return result
    t0, t_end = steps[0]["t"], steps[-1]["t"]
    rank0 = [r for r in steps if r["rank"] == 0]

    failures: List[Dict[str, Any]] = []
    stretches = []  # (from, to) at 4 workers, for the throughput between failures
    for index, run in enumerate(attempts):
        begin = run.first_full
        for f in run.failures:
            gen = index * GEN_STRIDE + f["gen"]
            item: Dict[str, Any] = {"number": f["number"], "attempt": index, "at_s": f["killed_at"] - t0,
                                    "killed_rank": f["rank"], "job_died": "resumed_at" not in f}
            if begin is not None:
                stretches.append((begin, f["killed_at"]))
            after = [r for r in steps if r["g"] != gen and r["t"] > f["killed_at"]]
            if after:
                # After a job died, "after" is the relaunched job: its first step, from where it started.
                reached = max(r["done"] for r in steps if r["g"] == gen) + 1
                resumed_from = begun[after[0]["g"]]["step"]
                item.update(resume_s=after[0]["t"] - f["killed_at"], resumed_at_s=after[0]["t"] - t0,
                            world_after=after[0]["size"], steps_done_before=reached,
                            resumed_from_step=resumed_from, steps_lost=reached - resumed_from)
                full = next((r for r in after if r["size"] == WORKERS_PER_JOB), None)
                if full is not None:
                    item.update(full_size_s=full["t"] - f["killed_at"], full_at_s=full["t"] - t0)
            if "host_added_at" in f:
                item.update(host_added=f["host_added"], host_added_at_s=f["host_added_at"] - t0)
                if "full_at" in f:
                    small = [r["t"] for r in rank0 if f["killed_at"] < r["t"] <= f["full_at"]
                             and r["size"] < WORKERS_PER_JOB]
                    item.update(steps_on_survivors=len(small),
                                regrow_stall_s=f["full_at"] - (small[-1] if small else f["killed_at"]))
            failures.append(item)
            begin = f.get("full_at")
        if begin is not None and not run.problems:
            stretches.append((begin, max(r["t"] for r in steps if r["attempt"] == index) + 1))
    survived = [f for f in failures if not f["job_died"]]
    resumes = [f["resume_s"] for f in survived if "resume_s" in f]
    fulls = [f["full_size_s"] for f in survived if "full_size_s" in f]
    lost = [f["steps_lost"] for f in survived if "steps_lost" in f]
    between = throughput(steps, stretches)

    commits = [r["commit_s"] for r in records if "commit_s" in r and r["rank"] == 0]
    history = committed_history(records)
    useful = sum(len(r["indices"]) for r in history)
    processed = sum(r["n"] for r in steps)
    last_epoch = max(r["epoch"] for r in history)
    checked = audit(history, last_epoch)  # complete epochs only
    recovered = []
    for run in attempts:
        for path in glob.glob(os.path.join(run.log_dir, "events-*.jsonl")):
            with open(path, encoding="utf-8") as handle:
                recovered.extend(e for e in map(json.loads, filter(str.strip, handle)) if e["event"] == "recovered")
    first_of_gen: Dict[Any, dict] = {}
    for event in sorted(recovered, key=lambda e: e["time"]):
        first_of_gen.setdefault(event.get("generation"), event)

    result.update({
        "failures": failures,
        "failures_survived": len(survived),
        "job_deaths": len(failures) - len(survived),
        "steps_lost_to_job_deaths": sum(f.get("steps_lost", 0) for f in failures if f["job_died"]),
        "resume_s": resumes, "resume_median_s": median(resumes), "resume_worst_s": max(resumes) if resumes else None,
        "full_size_s": fulls, "full_size_median_s": median(fulls), "full_size_worst_s": max(fulls) if fulls else None,
        "steps_lost": lost, "steps_lost_mean": statistics.mean(lost) if lost else None,
        "startup_s": attempts[0].first_full - attempts[0].launched if attempts[0].first_full else None,
        "training_wall_s": t_end - t0,
        "samples_processed": processed,
        "samples_useful": useful,
        "samples_recomputed": processed - useful,
        "goodput_samples_per_s": useful / (t_end - t0),
        "throughput_between_failures_samples_per_s": between["samples_per_s"],
        "step_time_between_failures_s": between["step_time_s"],
        "throughput_windows": [{"from_s": w["from"] - t0, "to_s": w["to"] - t0, "samples_per_s": w["samples_per_s"]}
                               for w in between["windows"]],
        "commits_rank0": len(commits),
        "commit_median_s": median(commits),
        "commit_per_step_s": sum(commits) / len(rank0),
        "audited_epochs": last_epoch,
        "duplicated_samples": checked["duplicated"],
        "skipped_samples": checked["missing"],
        "exactly_once": checked["duplicated"] == 0 and checked["missing"] == 0 and last_epoch > 0,
        "audit_epochs": checked["epochs"],
        "library_recovery_events": [{k: e.get(k) for k in ("generation", "cause", "size", "recovery_s",
                                                             "steps_rolled_back")} for e in first_of_gen.values()],
        "timeline": timeline(steps, t0),
    })
    return result


def timeline(steps: List[dict], t0: float) -> List[List[Any]]:
    """Per second since the first step: [second, samples completed (all ranks), largest world size or None]."""
    end = int(steps[-1]["t"] - t0) + 1
    rows: List[List[Any]] = [[second, 0, None] for second in range(end + 1)]
    for r in steps:
        row = rows[int(r["t"] - t0)]
        row[1] += r["n"]
        row[2] = r["size"] if row[2] is None else max(row[2], r["size"])
    return rows


def failure_free(runs: List[Attempt]) -> Dict[str, Any]:
    """Throughput of failure-free jobs: from 1 s after the first step at 4 workers to the stop."""
    values, steps_s = [], []
    for run in runs:
        steps = sorted((r for r in ledger.read(run.log_dir) if "done" in r), key=lambda r: r["t"])
        if run.first_full is None or not steps:
            continue
        measured = throughput(steps, [(run.first_full, steps[-1]["t"] + 1)])
        if measured["samples_per_s"]:
            values.append(measured["samples_per_s"])
            steps_s.append(measured["step_time_s"])
    return {"samples_per_s": median(values), "runs_samples_per_s": values, "step_time_s": median(steps_s)}


def ratios(results: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Optional[float]]]:
    """elastic_ext against each baseline, as a factor in elastic_ext's favour (> 1: elastic_ext better)."""
    ext = results.get("ext")
    table: Dict[str, Dict[str, Optional[float]]] = {}
    if not ext:
        return table

    def favour(key: str, lower_is_better: bool, base: Dict[str, Any]) -> Optional[float]:
        theirs, mine = base.get(key), ext.get(key)
        if theirs is None or mine is None:
            return None
        if lower_is_better:
            return theirs / mine if mine else (float("inf") if theirs else 1.0)
        return mine / theirs if theirs else None

    for name, base in results.items():
        if name != "ext":
            table[name] = {
                "resume_median": favour("resume_median_s", True, base),
                "resume_worst": favour("resume_worst_s", True, base),
                "full_size_median": favour("full_size_median_s", True, base),
                "steps_lost_mean": favour("steps_lost_mean", True, base),
                "goodput": favour("goodput_samples_per_s", False, base),
                "throughput_no_failure": favour("throughput_samples_per_s", False, base),
                "commit_per_step": favour("commit_per_step_s", True, base),
            }
    return table


# ------------------------------------------------------------------ plots


def plot_timeline(results: Dict[str, Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results.values() if r.get("timeline")]
    span = max(r["timeline"][-1][0] for r in shown) + 2
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 2.7 * len(shown)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        seconds = [row[0] for row in r["timeline"]]
        samples = [row[1] for row in r["timeline"]]
        size = [row[2] for row in r["timeline"]]
        ax.fill_between(seconds, samples, step="post", alpha=0.35, color="#2b6cb0", label="samples/s")
        ax.set_ylabel("samples per second")
        ax.set_xlim(0, span)
        twin = ax.twinx()
        xs = [i for i, s in enumerate(size) if s is not None]
        twin.plot([x + 0.5 for x in xs], [size[i] for i in xs], ".", color="#c05621", markersize=4)
        twin.set_ylim(0, 5)
        twin.set_ylabel("world size (dots)", color="#c05621")
        for k, f in enumerate(r["failures"]):
            ax.axvline(f["at_s"], color="red", linestyle="--", linewidth=1.2, label="SIGKILL" if k == 0 else None)
            if f.get("resumed_at_s") is not None:
                ax.axvline(f["resumed_at_s"], color="green", linestyle=":", linewidth=1.4,
                           label="first step after it" if k == 0 else None)
            if f.get("host_added_at_s") is not None:
                ax.axvline(f["host_added_at_s"], color="purple", linestyle="-.", linewidth=0.8,
                           label="spare host added" if k == 0 else None)
        title = (f"{r['label']}: goodput {r['goodput_samples_per_s']:.0f} samples/s, time to resume median "
                 f"{_fmt(r.get('resume_median_s'))} s, back to 4 workers median {_fmt(r.get('full_size_median_s'))} s")
        if r.get("job_deaths"):
            title += f" (the job died {r['job_deaths']}x and was relaunched)"
        ax.set_title(title, fontsize=9)
        ax.legend(loc="upper left", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("seconds since the first step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


METRIC_LABELS = {
    "resume_median": "time to resume\n(median)", "resume_worst": "time to resume\n(worst)",
    "full_size_median": "back to 4 workers\n(median)", "steps_lost_mean": "steps lost\nper failure",
    "goodput": "goodput", "throughput_no_failure": "throughput\nwithout failures",
    "commit_per_step": "commit cost\nper step",
}


def plot_ratios(table: Dict[str, Dict[str, Optional[float]]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(METRIC_LABELS)
    fig, ax = plt.subplots(figsize=(12, 4.2))
    width = 0.8 / max(1, len(table))
    for k, (name, values) in enumerate(table.items()):
        raw = [values.get(m) for m in metrics]
        heights = [min(v, 1e3) if v else 0 for v in raw]  # inf (elastic_ext lost nothing) drawn at 1000
        bars = ax.bar([i + k * width for i in range(len(metrics))], heights, width, label=f"vs {LABELS[name]}")
        for bar, value in zip(bars, raw):
            ax.annotate(_fmt(value) + ("x" if value is not None else ""),
                        (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), 0.011)),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(1, color="k", linewidth=1)
    ax.set_yscale("log")
    ax.set_ylim(0.01, 2e3)
    ax.set_xticks([i + width * (len(table) - 1) / 2 for i in range(len(metrics))])
    ax.set_xticklabels([METRIC_LABELS[m] for m in metrics], fontsize=8)
    ax.set_ylabel("factor in elastic_ext's favour\n(> 1: elastic_ext better)")
    ax.set_title("elastic_ext against each baseline (same model, data and failures)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    if value == float("inf"):
        return "inf"
    return f"{value:.3g}"


def print_table(results: Dict[str, Dict[str, Any]], table: Dict[str, Dict[str, Optional[float]]]) -> None:
    rows = [("failures survived / job deaths", None, 1),
            ("time to resume, median (s)", "resume_median_s", 1), ("time to resume, worst (s)", "resume_worst_s", 1),
            ("back to 4 workers, median (s)", "full_size_median_s", 1),
            ("steps lost per failure (mean)", "steps_lost_mean", 1),
            ("steps lost to job deaths", "steps_lost_to_job_deaths", 1),
            ("goodput (samples/s)", "goodput_samples_per_s", 1),
            ("throughput w/o failures (samples/s)", "throughput_samples_per_s", 1),
            ("  same, between failures (samples/s)", "throughput_between_failures_samples_per_s", 1),
            ("commit, median (ms)", "commit_median_s", 1000), ("commit per step (ms)", "commit_per_step_s", 1000),
            ("duplicated samples", "duplicated_samples", 1), ("skipped samples", "skipped_samples", 1),
            ("audited epochs", "audited_epochs", 1)]
    names = list(results)
    print(f"{'':38s}" + "".join(f"{LABELS[n]:>15s}" for n in names))
    for label, key, scale in rows:
        if key is None:
            counts = [f"{results[n].get('failures_survived')} / {results[n].get('job_deaths')}" for n in names]
            print(f"{label:38s}" + "".join(f"{c:>15s}" for c in counts))
            continue
        cells = [results[n].get(key) for n in names]
        print(f"{label:38s}" + "".join(f"{_fmt(c * scale if c is not None else None):>15s}" for c in cells))
    for name, values in table.items():
        print(f"elastic_ext vs {LABELS[name]} (> 1: elastic_ext better): "
              + ", ".join(f"{k} {_fmt(v)}x" for k, v in values.items()))


# ------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=3, help="SIGKILLs per system")
    parser.add_argument("--uptime-s", type=float, default=10.0,
                        help="seconds at 4 workers before each failure and after the last recovery")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--commit-every", type=int, default=10, help="steps between commits / checkpoints")
    parser.add_argument("--compute-ms-per-sample", type=float, default=3.0,
                        help="emulated compute (a sleep) per sample a rank processes")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--overhead-s", type=float, default=12.0,
                        help="seconds of each failure-free job (two per system, in the order A B C C B A); 0: none")
    parser.add_argument("--name", default="compare", help="result file stem under bench/results")
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    for system in systems:
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r}; choose from {SYSTEMS}")
    hosts = local_host_names()
    if len(hosts) < args.failures + 2:
        print(f"warning: {len(hosts)} local host names ({hosts}) give Horovod jobs spares for "
              f"{len(hosts) - 2} failures; a job with no spare left stops there", flush=True)
    work = tempfile.mkdtemp(prefix="bench_compare_")
    args.data = os.path.join(work, "digits.npz")
    sys.path.insert(0, WORKERS)
    import compare_common
    compare_common.write_data(args.data)
    started = time.time()
    info: Dict[str, Any] = {
        "benchmark": "compare", "machine": machine(), "load_average_at_start": list(os.getloadavg()),
        "command": ".venv/bin/python -m bench.compare " + " ".join(sys.argv[1:]),
        "settings": {"failures": args.failures, "uptime_s": args.uptime_s, "commit_every": args.commit_every,
                     "compute_ms_per_sample": args.compute_ms_per_sample, "global_batch": args.global_batch,
                     "workers": WORKERS_PER_JOB, "horovod_hosts": hosts, "slots_per_host": SLOTS_PER_HOST,
                     "dataset_size": DATASET_SIZE, "torchrun_max_restarts": TORCHRUN_MAX_RESTARTS,
                     "kill_jitter_s": [0, JITTER_S], "overhead_s": args.overhead_s},
        "work_dir": work}
    results: Dict[str, Dict[str, Any]] = {}
    for system in systems:
        print(f"{LABELS[system]}:", flush=True)
        load = os.getloadavg()[0]
        attempts = run_system(system, work, hosts, args)
        results[system] = analyze(system, attempts)
        results[system]["load_average_1min_before"] = load
        results[system]["wall_s"] = attempts[-1].ended - attempts[0].launched
    # Failure-free throughput, from short jobs run back to back in the order A B C C B A, so that
    # a machine whose load drifts (other jobs) favours no system.
    plain_runs: Dict[str, List[Attempt]] = {system: [] for system in systems}
    if args.overhead_s > 0:
        print("failure-free jobs:", flush=True)
        for k, system in enumerate(systems + systems[::-1]):
            log_dir = os.path.join(work, "no-failure", f"{system}-{k}")
            run = run_attempt(system, log_dir, hosts, 0, os.path.join(log_dir, "checkpoint.pt"), args,
                              uptime_s=args.overhead_s)
            plain_runs[system].append(run)
            print(f"  {LABELS[system]}: {failure_free([run])['samples_per_s'] or float('nan'):.0f} samples/s"
                  + (f"; {'; '.join(run.problems)}" if run.problems else ""), flush=True)
    for system in systems:
        measured = failure_free(plain_runs[system])
        if measured["samples_per_s"] is None:  # no failure-free jobs: the stretches between failures
            measured["samples_per_s"] = results[system].get("throughput_between_failures_samples_per_s")
            measured["step_time_s"] = results[system].get("step_time_between_failures_s")
        results[system]["throughput_samples_per_s"] = measured["samples_per_s"]
        results[system]["throughput_runs_samples_per_s"] = measured["runs_samples_per_s"]
        results[system]["step_time_s"] = measured["step_time_s"]
    info["results"] = results
    info["ratios_in_favour_of_ext"] = ratios(results)
    info["runtime_s"] = time.time() - started
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.name}.json.tmp"), "w") as handle:
        json.dump(info, handle, indent=1)
    os.replace(os.path.join(RESULTS, f"{args.name}.json.tmp"), os.path.join(RESULTS, f"{args.name}.json"))
    plot_timeline(results, os.path.join(RESULTS, f"{args.name}_timeline.png"))
    if info["ratios_in_favour_of_ext"]:
        plot_ratios(info["ratios_in_favour_of_ext"], os.path.join(RESULTS, f"{args.name}_ratios.png"))
    print_table(results, info["ratios_in_favour_of_ext"])
    print(f"runtime {info['runtime_s']:.0f} s; logs in {work}")
    return 0 if all(r.get("timeline") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
