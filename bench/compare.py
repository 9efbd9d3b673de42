"""Side by side under the same failures: plain Horovod elastic, torchrun, torchft, elastic_ext.

One run, the same model, data, global batch and failure schedule for every system:

- ``plain``: Horovod elastic as its examples write it (``hvd.elastic.TorchState``,
  ``@hvd.elastic.run``, Horovod's ``ElasticSampler``): bench/workers/compare_plain.py;
- ``torchrun``: ``torchrun`` elastic restarts from a checkpoint (DDP over Gloo,
  c10d rendezvous, rank 0 saves every N steps): bench/workers/compare_torchrun.py;
- ``ext``: elastic_ext (``elastic_ext.State``, ``@elastic_ext.run``, its
  ``ElasticSampler``) launched as the README says, by ``elastic-horovodrun``
  with the defaults and a checkpoint directory (``ELASTIC_EXT_CHECKPOINT_DIR``,
  checkpoints written in the background at the default cadence):
  bench/workers/compare_ext.py;
- ``ext_horovodrun`` (only when asked for): the same worker under plain
  ``horovodrun``, which gives up what the launcher does (a failed worker's
  host mate leaves with it; no early start of newcomers);
- ``torchft``: torchft 0.2.0, four replica groups of one worker, its
  Lighthouse on localhost, ``Manager`` + ``torchft.Optimizer`` +
  ``ProcessGroupGloo``, the gradients through ``Manager.allreduce``; a killed
  group's agent starts it again and it heals from a peer's live state
  (bench/peer_torchft.py, bench/workers/compare_torchft.py; needs ``bash
  tools/setup_bench.sh``);
- ``torchft_ddp`` (only when asked for): the same with
  ``torchft.DistributedDataParallel`` as torchft's train_ddp.py, whose
  survivors die when a peer is killed during the allreduce (see the worker).

Each worker trains the digits MLP of examples/pytorch_elastic.py on 4
workers (global batch 64, commit or checkpoint every ``--commit-every`` steps
and at each epoch's end, ``--compute-ms-per-sample`` of emulated compute: a
sleep before the allreduce, since the MLP itself takes a millisecond).

- Horovod (plain, ext, ext_horovodrun): ``horovodrun -np 4 --min-np 2
  --max-np 4`` (``elastic-horovodrun`` for ext) with a host file of two
  pseudo-hosts with 2 slots each (localhost, 127.0.0.1). Under plain
  ``horovodrun`` a SIGKILL blacklists the failed worker's host; the job goes
  on with the 2 survivors. Once it has, the driver adds a spare pseudo-host
  (another name of this machine: the hostname, other local names from
  /etc/hosts, the non-loopback IPv4 addresses) and the job grows back to 4.
  Under ``elastic-horovodrun`` the host stays and a new worker starts in the
  failed slot.
- torchrun: two agents on this machine, ``--nnodes 1:2 --nproc-per-node 2
  --rdzv-backend c10d --rdzv-endpoint localhost:PORT --max-restarts 10``;
  a failure restarts all 4 workers, which load the last checkpoint.
- torchft: the survivors go on at 3 groups once the Lighthouse has formed a
  quorum without the dead one; the replacement joins a later quorum.

Failure schedule (the same for all): ``--uptime-s`` seconds plus a seeded
jitter of 0 to 2 s (the same draws for every system, so that failures fall
anywhere in the commit interval) after the job first has 4 workers, and
again each time it is back to 4 after a failure, the driver SIGKILLs the
worker with the highest rank, ``--failures`` times; ``--uptime-s`` after the
last recovery it stops the job at a step boundary (a stop file the workers
read at commit steps). A job that dies instead of recovering is relaunched
once for the failures left (a relaunched torchrun or elastic_ext job resumes
from its newest checkpoint; plain Horovod jobs keep no durable state and
start over).
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
``devkit.ledger``; each generation undoes the steps at or after the
position it resumed from: for torchrun, the checkpoint the restart loaded).

    .venv/bin/python -m bench.compare [--failures 3] [--uptime-s 10] [--overhead-s 12]

Writes bench/results/compare.json, compare_timeline.png and compare_ratios.png.
The jobs are driven here; their logs are read by bench/compare_report.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from bench import harness, peer_torchft
from bench.compare_report import DATASET_SIZE, LABELS, WORKERS_PER_JOB, analyze, failure_free, plot_ratios, \
    plot_timeline, print_table, ratios
from bench.workers import compare_common
from devkit import launch

SYSTEMS = ("plain", "torchrun", "ext", "ext_horovodrun", "torchft", "torchft_ddp")
# Under plain horovodrun a failed worker's host is blacklisted: the job regrows onto a spare host the driver adds.
# The others start a new worker in the failed slot themselves.
REGROWS_ON_SPARE_HOST = ("plain", "ext_horovodrun")
SLOTS_PER_HOST = 2
ATTEMPTS = 2  # a job that dies is relaunched once for the failures left
START_TIMEOUT_S = 180.0
RESUME_TIMEOUT_S = 150.0
STOP_TIMEOUT_S = 120.0
JITTER_S = 2.0  # each SIGKILL: uptime_s plus a seeded jitter in [0, JITTER_S] (harness.kill_delay)


# ------------------------------------------------------------------- jobs


def worker_args(log_dir: str, args: argparse.Namespace) -> List[str]:
    return ["--out", log_dir, "--data", args.data, "--global-batch", str(args.global_batch),
            "--commit-every", str(args.commit_every), "--compute-ms-per-sample", str(args.compute_ms_per_sample)]


def launch_jobs(system: str, log_dir: str, hosts_file: str, checkpoint: str,
                args: argparse.Namespace) -> List[launch.Job]:
    """One horovodrun (plain, ext), two torchrun agents on this machine (torchrun), or torchft's Lighthouse
    and one torchrun agent per replica group (torchft)."""
    if system.startswith("torchft"):
        heartbeat = getattr(args, "torchft_heartbeat_timeout_ms", None)
        return peer_torchft.launch_jobs(log_dir, worker_args(log_dir, args), args.max_restarts,
                                        ddp=system == "torchft_ddp", lighthouse_options=() if heartbeat is None
                                        else ("--heartbeat_timeout_ms", str(heartbeat)))
    if system != "torchrun":
        script = "compare_ext.py" if system.startswith("ext") else f"compare_{system}.py"
        cmd = harness.horovodrun(os.path.join(harness.WORKERS, script), worker_args(log_dir, args),
                                 hosts_file, WORKERS_PER_JOB, 2, WORKERS_PER_JOB)
        if system == "ext":
            cmd = launch.under_elastic_ext_driver(cmd)  # elastic-horovodrun, the same arguments
        env = launch.base_env(HOROVOD_FUSION_THRESHOLD=harness.HOROVOD_DEFAULT_FUSION,
                              ELASTIC_EXT_EVENTS_PATH=os.path.join(log_dir, "events-{rank}.jsonl"))
        if system.startswith("ext"):
            # Durable checkpoints beside torchrun's file, as a user's job has them: a relaunch
            # resumes from the newest, and the launcher restarts workers in place.
            env["ELASTIC_EXT_CHECKPOINT_DIR"] = os.path.join(os.path.dirname(checkpoint), "ext-checkpoints")
        return [launch.Job(cmd, env, os.path.join(log_dir, "horovodrun.log"))]
    port = harness.free_port()
    # With the rendezvous TCP store shared with the workers (the default), the workers of the
    # agent whose own workers did not fail read the previous attempt's keys after a restart
    # (the attempt number is TORCHELASTIC_RESTART_COUNT, counted per agent) and connect to
    # dead ports: pytorch/pytorch#135712, reproduced here. Its documented workaround:
    env = launch.base_env(GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    jobs = []
    for agent in range(2):
        cmd = [os.path.join(launch.VENV_BIN, "torchrun"), "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
               "--rdzv-id", f"compare-{os.getpid()}-{port}", "--max-restarts", str(args.max_restarts),
               os.path.join(harness.WORKERS, "compare_torchrun.py"), *worker_args(log_dir, args),
               "--checkpoint", checkpoint]
        jobs.append(launch.Job(cmd, env, os.path.join(log_dir, f"torchrun-agent{agent}.log")))
        time.sleep(0.5)  # the first agent hosts the c10d store
    return jobs


class Attempt(harness.Watch):
    """One launched job of one system, driven through (part of) the failure schedule."""

    def __init__(self, system: str, log_dir: str, jobs: List[launch.Job], launched: float) -> None:
        super().__init__(jobs, log_dir)
        self.system = system
        self.log_dir = log_dir
        self.launched = launched
        self.failures: List[Dict[str, Any]] = []
        self.problems: List[str] = []
        self.first_full: Optional[float] = None  # time of the first step with 4 workers
        self.exit_codes: List[Optional[int]] = []
        self.ended = launched

    def expect(self, predicate: Callable[[dict], bool], timeout_s: float, what: str) -> Optional[dict]:
        """The earliest record that satisfies ``predicate``; None, with the reason kept, if none comes."""
        record, why = self.wait_for(predicate, timeout_s)
        if record is None:
            self.problems.append(f"no {what}: {why}")
        return record

    def last_step(self) -> Optional[dict]:
        """The newest completed step ("done" record)."""
        return max((r for r in self.records if "done" in r), key=lambda r: r["t"], default=None)


def run_attempt(system: str, log_dir: str, hosts: List[str], failures: int, checkpoint: str,
                args: argparse.Namespace, first_failure: int = 0, uptime_s: Optional[float] = None) -> Attempt:
    """Launches a job of ``system`` and drives it through ``failures`` SIGKILLs, then stops it.

    After each SIGKILL it waits for the first step after it; for Horovod jobs
    it then adds a spare pseudo-host to the host file (capacity coming back)
    and waits until the job has 4 workers again (the other systems regrow by themselves). ``first_failure`` numbers
    the failures (it picks their jitters); ``uptime_s`` overrides the
    setting of that name.
    """
    uptime_s = args.uptime_s if uptime_s is None else uptime_s
    os.makedirs(log_dir)
    hosts_file = os.path.join(log_dir, "hosts")
    in_use, spares = list(hosts[:2]), list(hosts[2:])
    launch.write_hosts(hosts_file, [f"{host}:{SLOTS_PER_HOST}" for host in in_use])
    launched = time.time()
    run = Attempt(system, log_dir, launch_jobs(system, log_dir, hosts_file, checkpoint, args), launched)
    first = run.expect(lambda r: "done" in r and r["size"] == WORKERS_PER_JOB, START_TIMEOUT_S, "first step")
    full_at = first["t"] if first else None
    run.first_full = full_at
    for number in range(first_failure, first_failure + failures if first else 0):
        run.idle_until(full_at + harness.kill_delay(number, uptime_s, JITTER_S))
        run.poll()
        gen = run.last_step()["g"]
        victim = max((r for r in run.records if r.get("start") == gen), key=lambda r: r["rank"])
        killed_at = run.kill(victim["pid"])
        if killed_at is None:
            run.problems.append(f"victim pid {victim['pid']} is not a process of this job")
            break
        failure: Dict[str, Any] = {"killed_at": killed_at, "pid": victim["pid"], "rank": victim["rank"], "gen": gen,
                                   "number": number}
        run.failures.append(failure)
        print(f"  {LABELS[system]}: SIGKILL rank {victim['rank']} (pid {victim['pid']}) "
              f"{killed_at - launched:.1f} s after launch", flush=True)
        back = run.expect(lambda r: "done" in r and r["g"] != gen and r["t"] > killed_at, RESUME_TIMEOUT_S,
                          "step after the failure")
        if back is None:
            break
        failure["resumed_at"] = back["t"]
        full = back
        if back["size"] < WORKERS_PER_JOB and system not in REGROWS_ON_SPARE_HOST:
            full = run.expect(lambda r: "done" in r and r["size"] == WORKERS_PER_JOB and r["t"] > back["t"],
                              RESUME_TIMEOUT_S, "4 workers again")
            if full is None:
                break
        elif back["size"] < WORKERS_PER_JOB:
            if not spares:
                run.problems.append("no spare host left to grow back to 4 workers")
                break
            in_use.append(spares.pop(0))
            launch.write_hosts(hosts_file, [f"{host}:{SLOTS_PER_HOST}" for host in in_use])
            failure["host_added_at"], failure["host_added"] = time.time(), in_use[-1]
            full = run.expect(lambda r: "done" in r and r["size"] == WORKERS_PER_JOB and r["t"] > back["t"],
                              RESUME_TIMEOUT_S, "4 workers again")
            if full is None:
                break
        failure["full_at"] = full_at = full["t"]
        print(f"  {LABELS[system]}: first step {back['t'] - killed_at:.1f} s after the SIGKILL "
              f"(on {back['size']} workers), 4 workers after {full['t'] - killed_at:.1f} s", flush=True)
    if full_at is not None and not run.problems:
        run.idle_until(full_at + uptime_s)
        run.poll()
        # The workers read the stop step at commit steps: a few commits ahead, every rank sees it in time.
        stop = (run.last_step()["done"] // args.commit_every + 3) * args.commit_every
        launch.write_hosts(os.path.join(log_dir, "stop"), [str(stop)])  # at once: no worker reads half of it
    for code, name in run.stop(STOP_TIMEOUT_S if not run.problems else 5):
        run.exit_codes.append(code)
        if code is None and not run.problems:
            run.problems.append(f"{name} did not stop in {STOP_TIMEOUT_S:.0f} s")
    run.ended = time.time()
    return run


def run_system(system: str, work: str, hosts: List[str], args: argparse.Namespace) -> List[Attempt]:
    attempts: List[Attempt] = []
    left = args.failures
    checkpoint = os.path.join(work, system, "checkpoint.pt")  # torchrun's, ext's beside it; survive a relaunch
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


# ------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=3, help="SIGKILLs per system")
    parser.add_argument("--uptime-s", type=float, default=10.0,
                        help="seconds at 4 workers before each failure and after the last recovery")
    parser.add_argument("--systems", default="plain,torchrun,ext")
    parser.add_argument("--commit-every", type=int, default=10, help="steps between commits / checkpoints")
    parser.add_argument("--compute-ms-per-sample", type=float, default=3.0,
                        help="emulated compute (a sleep) per sample a rank processes")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--overhead-s", type=float, default=12.0,
                        help="seconds of each failure-free job (two per system, in the order A B C C B A); 0: none")
    parser.add_argument("--max-restarts", type=int, default=10,
                        help="--max-restarts of the torchrun agents (torchrun, and each torchft replica group)")
    parser.add_argument("--torchft-heartbeat-timeout-ms", type=int,
                        help="the Lighthouse's --heartbeat_timeout_ms (default: its own, 5000): how long a dead "
                             "replica group still counts as alive, which the survivors' next quorum waits out")
    parser.add_argument("--name", default="compare", help="result file stem under bench/results")
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]  # default: every system but ext_horovodrun
    for system in systems:
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r}; choose from {SYSTEMS}")
    hosts = harness.local_host_names()
    if len(hosts) < args.failures + 2:
        print(f"warning: {len(hosts)} local host names ({hosts}) give Horovod jobs spares for "
              f"{len(hosts) - 2} failures; a job with no spare left stops there", flush=True)
    work = tempfile.mkdtemp(prefix="bench_compare_")
    args.data = os.path.join(work, "digits.npz")
    compare_common.write_data(args.data)
    started = time.time()
    info: Dict[str, Any] = {
        "benchmark": "compare", "machine": harness.machine(), "load_average_at_start": list(os.getloadavg()),
        "command": ".venv/bin/python -m bench.compare " + " ".join(sys.argv[1:]),
        "settings": {"failures": args.failures, "uptime_s": args.uptime_s, "commit_every": args.commit_every,
                     "compute_ms_per_sample": args.compute_ms_per_sample, "global_batch": args.global_batch,
                     "workers": WORKERS_PER_JOB, "horovod_hosts": hosts, "slots_per_host": SLOTS_PER_HOST,
                     "dataset_size": DATASET_SIZE, "torchrun_max_restarts": args.max_restarts,
                     "torchft_lighthouse": list(peer_torchft.LIGHTHOUSE_OPTIONS),
                     "torchft_heartbeat_timeout_ms": args.torchft_heartbeat_timeout_ms,
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
    if "ext_horovodrun" in results:
        info["ratios_in_favour_of_ext_horovodrun"] = ratios(results, "ext_horovodrun")
    info["runtime_s"] = time.time() - started
    harness.write_json(args.name, info, indent=1)
    plot_timeline(results, f"{args.name}_timeline")
    if info["ratios_in_favour_of_ext"]:
        plot_ratios(info["ratios_in_favour_of_ext"], f"{args.name}_ratios")
    print_table(results, info["ratios_in_favour_of_ext"])
    print(f"runtime {info['runtime_s']:.0f} s; logs in {work}")
    return 0 if all(r.get("timeline") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
