"""Soak: one long elastic job under a seeded schedule of faults, then an audit.

One real ``horovodrun`` job (4 workers, three 2-slot pseudo-hosts, durable
checkpoints every commit, tensor fusion on) trains on the UCI digits
while this script injects faults drawn from a seeded schedule:

- ``kill``: SIGKILL a random worker at a random moment;
- ``kill_rank0``: SIGKILL rank 0, which writes a checkpoint at every commit;
- ``kill_recovering``: SIGKILL a random process as soon as the previous
  fault's recovery started (during the reset, the rendezvous or a
  newcomer's start);
- ``stop``: SIGSTOP a worker (its guardian must kill it);
- ``term``: SIGTERM a worker (it leaves at its next commit);
- ``remove_host`` / ``add_host``: rewrite the discovery host file;
- ``kill_commit`` / ``kill_sync``: a worker SIGKILLs itself in the middle of
  ``commit()`` or with an allreduce in flight (declared to the worker up
  front, fired once at a given step).

Then it stops the job at the next epoch end and reports: faults injected
and survived, job deaths, samples duplicated and skipped per the ledger,
whether the final parameters are equal on every rank, and the native
aborts seen in the log.

    python -m bench.soak --faults 30 --seed 1 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, Optional

import psutil

from bench import harness
from devkit import analysis, launch, ledger

DIGITS = 1797
STEPS_PER_EPOCH = 29  # 1797 samples, global batch 64, policy "pad"
EXTERNAL = ("kill", "kill_rank0", "kill_recovering", "stop", "term", "remove_host")
INTERNAL = ("kill_commit", "kill_sync")
WEIGHTS = {"kill": 4, "kill_rank0": 2, "kill_recovering": 3, "stop": 2, "term": 2, "remove_host": 2,
           "kill_commit": 1, "kill_sync": 1}
# What Horovod's driver says when it ends the job.
DRIVER_STOPS = ("failure count ==", "blacklisted slots count ==", "failed to activate new hosts",
                "number of resets during elastic job exceeded limit")
NATIVE_ABORTS = ("has been removed from elastic job", "EnforceNotMet", "op.preamble.length <= op.nbytes",
                 "Aborted", "terminate called")


def hosts_all() -> List[str]:
    return ["localhost:2", "127.0.0.1:2", f"{launch.third_host()}:2"]


def make_schedule(count: int, seed: int) -> List[str]:
    """``count`` fault kinds drawn with WEIGHTS; every kind appears at least once if count allows."""
    rng = random.Random(seed)
    kinds = list(WEIGHTS)
    chosen = kinds[:count] if count >= len(kinds) else rng.sample(kinds, count)
    while len(chosen) < count:
        chosen.append(rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0])
    rng.shuffle(chosen)
    return chosen


def workers(root_pid: int) -> List[psutil.Process]:
    try:
        tree = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for proc in tree:
        try:
            cmd = " ".join(proc.cmdline())
            launcher = "horovodrun" in cmd or "elastic_ext.launch.supervise" in cmd  # the driver is not a worker
            if "lifecycle.py" in cmd and not launcher and "elastic_ext.runtime.guardian" not in cmd \
                    and proc.status() != psutil.STATUS_ZOMBIE \
                    and os.path.basename(proc.cmdline()[0]).startswith("python"):
                found.append(proc)
        except (psutil.NoSuchProcess, IndexError):
            pass
    return [p for p in found if not any(q.pid == p.ppid() for q in found)]  # the worker, not a child it forked


def rank_of(out: str, pid: int) -> Optional[int]:
    path = os.path.join(out, f"steps-{pid}.jsonl")
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(path) - 4096))
            lines = [line for line in handle.read().splitlines() if line.strip()]
        return int(json.loads(lines[-1])["rank"])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def events(out: str) -> List[dict]:
    try:
        return analysis.read_events(os.path.join(out, "events.jsonl"))
    except ValueError:  # a line being written
        return []


def steps_after(out: str, t: float) -> int:
    try:
        return sum(1 for r in ledger.read(out) if "gen" in r and r.get("t", 0) > t)
    except (OSError, ValueError):
        return 0


def soak(out: str, count: int, seed: int, gap_s=(5.0, 9.0), timeout_s: float = 1800.0,
         log=print, restarts: int = 0, driver_log_level: str = "", restart_in_place: bool = True,
         rendezvous_timeout_s: float = 0.0) -> Dict[str, Any]:
    os.makedirs(out, exist_ok=True)
    rng = random.Random(seed + 1)
    schedule = make_schedule(count, seed)
    internal = [k for k in schedule if k in INTERNAL]
    external = [k for k in schedule if k not in INTERNAL]
    # Internal faults: ranks 0/1 (always present with min-np 2), spread over the run.
    spec = []
    for i, kind in enumerate(internal):
        step = STEPS_PER_EPOCH * (3 + 4 * i) + rng.randrange(1, STEPS_PER_EPOCH)
        step -= step % 4 if kind == "kill_commit" else 0  # commits happen at steps divisible by 4
        spec.append(f"{rng.randrange(2)}:{step}:kill:{'commit' if kind == 'kill_commit' else 'allreduce'}")
    hosts_file = os.path.join(out, "hosts")
    all_hosts = hosts_all()
    launch.write_hosts(hosts_file, all_hosts)
    stop_file = os.path.join(out, "stop")
    cmd = harness.horovodrun(os.path.join(launch.WORKERS, "lifecycle.py"),
                             ["--out", out, "--epochs", "100000", "--commit-every", "4", "--step-sleep-s", "0.05",
                              "--fusion", "--stop-file", stop_file, "--faults", ",".join(spec)],
                             hosts_file, options=["--blacklist-cooldown-range", "2", "4",
                                                  *(["--log-level", driver_log_level] if driver_log_level else [])])
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=os.path.join(out, "events.jsonl"),
                          ELASTIC_EXT_CHECKPOINT_DIR=os.path.join(out, "ckpt"), ELASTIC_EXT_CHECKPOINT_EVERY=1,
                          ELASTIC_EXT_CHECKPOINT_KEEP_LAST=3, ELASTIC_EXT_HANG_TIMEOUT_S=10,
                          ELASTIC_EXT_TERM_GRACE_S=20, ELASTIC_EXT_ROLLBACK_LIMIT=20)
    env.pop("HOROVOD_FUSION_THRESHOLD", None)  # Horovod's default: fused allreduces
    if restart_in_place:  # workers with keepers (the job has checkpoints), under elastic-horovodrun
        cmd = launch.under_elastic_ext_driver(cmd)
    if rendezvous_timeout_s:
        env["ELASTIC_EXT_RENDEZVOUS_TIMEOUT_S"] = str(rendezvous_timeout_s)
    if restarts:  # a job Horovod's driver ends is started again and resumes from its newest checkpoint
        cmd = [sys.executable, "-m", "elastic_ext.launch.supervise", "--max-restarts", str(restarts), "--backoff-s", "2",
               "--", *cmd]
    started = time.time()
    job = launch.Job(cmd, env, os.path.join(out, "horovodrun.log"))
    injected: List[Dict[str, Any]] = []
    removed: Optional[str] = None
    deadline = time.monotonic() + timeout_s

    def alive() -> bool:
        return job.proc.poll() is None

    def wait_until(predicate, limit_s: float) -> bool:
        end = time.monotonic() + limit_s
        while time.monotonic() < end and alive():
            job.track()
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    wait_until(lambda: steps_after(out, 0) >= 4 * 2 * STEPS_PER_EPOCH, 300)  # two epochs first
    for kind in external:
        if not alive() or time.monotonic() > deadline:
            break
        if kind == "kill_recovering" and injected:
            n_before = len([e for e in events(out) if e["event"] in ("rollback", "resize")])
            # the previous fault's recovery has started on some rank: strike now
            wait_until(lambda: len([e for e in events(out) if e["event"] in ("rollback", "resize")]) > n_before,
                       15)
            time.sleep(rng.uniform(0.0, 1.5))
        else:
            time.sleep(rng.uniform(*gap_s))
            if removed is not None and rng.random() < 0.7:
                launch.write_hosts(hosts_file, all_hosts)
                injected.append({"kind": "add_host", "host": removed, "t": time.time()})
                log(f"[soak] +{time.time() - started:6.1f}s add_host {removed}")
                removed = None
                time.sleep(rng.uniform(*gap_s))
        procs = workers(job.proc.pid)
        if not procs:
            continue
        record: Dict[str, Any] = {"kind": kind, "t": time.time()}
        if kind == "remove_host":
            candidates = [h for h in all_hosts if h != removed]
            removed = rng.choice(candidates)
            launch.write_hosts(hosts_file, [h for h in all_hosts if h != removed])
            record["host"] = removed
        else:
            # The script's process; a SIGKILL takes its keeper too (a lost machine), SIGSTOP and SIGTERM
            # reach the script (a hang; a scheduler signals every process of the job).
            scripts = [launch.script_process(p) for p in procs]
            target = scripts[rng.randrange(len(scripts))]
            if kind == "kill_rank0":
                zero = [p for p in scripts if rank_of(out, p.pid) == 0]
                target = zero[0] if zero else target
            try:
                if kind in ("stop", "term"):
                    target.send_signal(signal.SIGSTOP if kind == "stop" else signal.SIGTERM)
                else:
                    launch.kill_worker(target.pid)
            except psutil.NoSuchProcess:
                continue
            record.update(pid=target.pid, rank=rank_of(out, target.pid))
        injected.append(record)
        log(f"[soak] +{time.time() - started:6.1f}s {kind} {({k: v for k, v in record.items() if k not in ('kind', 't')})}")
    if removed is not None:
        launch.write_hosts(hosts_file, all_hosts)
        injected.append({"kind": "add_host", "host": removed, "t": time.time()})
    # Let the internal faults fire, then stop at an epoch end.
    wait_until(lambda: len(os.listdir(os.path.join(out, "faults"))) >= len(spec)
               if os.path.isdir(os.path.join(out, "faults")) else not spec, max(0.0, deadline - time.monotonic()))
    wait_until(lambda: steps_after(out, time.time() - 1) > 0, 60)
    open(stop_file, "w").close()
    try:
        code, output = job.wait(max(60.0, deadline - time.monotonic() + 120))
        timed_out = False
    except AssertionError as exc:
        code, output, timed_out = None, str(exc), True
    for marker in sorted(os.listdir(os.path.join(out, "faults"))) if os.path.isdir(os.path.join(out, "faults")) else []:
        with open(os.path.join(out, "faults", marker)) as handle:
            fired = json.load(handle)
        injected.append({"kind": "kill_commit" if fired["where"] == "commit" else "kill_sync",
                         "t": fired["time"], "pid": fired["pid"], "rank": fired["rank"], "step": fired["step"]})
    injected.sort(key=lambda r: r["t"])
    return report(out, injected, code, output, timed_out, time.time() - started, seed)


def report(out: str, injected: List[dict], code: Optional[int], output: str, timed_out: bool,
           duration_s: float, seed: int) -> Dict[str, Any]:
    records = ledger.read(out)
    finals_meta = [json.load(open(os.path.join(out, n))) for n in os.listdir(out)
                   if n.startswith("final-") and n.endswith(".json")]
    epochs = max((m["epoch"] for m in finals_meta), default=0)
    audit = ledger.audit(records, DIGITS, epochs) if epochs else {"epochs": [], "exactly_once": False,
                                                                  "lost_steps": None}
    finals = analysis.load_finals(out)
    try:
        analysis.assert_ranks_identical(finals)
        identical = bool(finals)
    except AssertionError as exc:
        identical = False
        log_identical = str(exc)
    else:
        log_identical = ""
    last = max((r["t"] for r in records if "gen" in r), default=0.0)
    survived = [f for f in injected if any(r.get("t", 0) > f["t"] + 0.5 for r in records if "gen" in r)]
    kinds: Dict[str, int] = {}
    for fault in injected:
        kinds[fault["kind"]] = kinds.get(fault["kind"], 0) + 1
    evs = events(out)
    return {
        "seed": seed, "duration_s": round(duration_s, 1), "exit_code": code, "timed_out": timed_out,
        "faults_injected": len(injected), "faults_by_kind": kinds, "faults_survived": len(survived),
        "job_restarts": sum(e["event"] == "job_restart" for e in evs),
        "job_deaths": sum(e["event"] == "job_restart" for e in evs) + (0 if code == 0 else 1),
        "epochs_completed": epochs, "generations": len(ledger.starts(records)),
        "rollbacks": sum(e["event"] == "rollback" for e in evs), "resizes": sum(e["event"] == "resize" for e in evs),
        "leaves": sum(e["event"] == "leave" for e in evs), "stalls": sum(e["event"] == "stall" for e in evs),
        "samples_duplicated": sum(e["duplicated"] for e in audit["epochs"]),
        "samples_skipped": sum(e["missing"] for e in audit["epochs"]),
        "exactly_once": audit["exactly_once"], "final_ranks": sorted(finals),
        "final_parameters_identical": identical, "identical_detail": log_identical,
        "guardian_kills": output.count("sent no heartbeat"),
        "restarts_in_place": output.count("restarting it in place"),  # elastic_ext.worker.keeper
        "keepers_gave_up": output.count("not restarting it"),
        # Every worker holding the commit lost, the job going on from its checkpoint: at a
        # job restart, and inside one job when the next round had only fresh workers.
        "resumed_from_checkpoint": sum(e["event"] == "checkpoint_resumed" for e in evs),
        "driver_stops": {s: output.count(s) for s in DRIVER_STOPS if s in output},
        "native_aborts": {s: output.count(s) for s in NATIVE_ABORTS if s in output},
        "last_step_t": last, "faults": injected,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="/tmp/elastic_ext_soak")
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--restarts", type=int, default=0,
                        help="run the job under python -m elastic_ext.launch.supervise with this many restarts")
    parser.add_argument("--driver-log-level", default="", choices=["", "INFO", "DEBUG"],
                        help="horovodrun --log-level: the driver's rounds (who recorded READY or FAILURE) in the log")
    parser.add_argument("--no-restart-in-place", action="store_true",
                        help="plain horovodrun, whose workers have no keeper")
    parser.add_argument("--rendezvous-timeout-s", type=float, default=0.0,
                        help="ELASTIC_EXT_RENDEZVOUS_TIMEOUT_S for the job (0: elastic_ext's default, 120 s)")
    parser.add_argument("--report-from", default="",
                        help="recompute the report of an earlier run from its --json file and its --out directory "
                             "(after a change to the audit); runs no job")
    args = parser.parse_args(argv)
    if args.report_from:
        with open(args.report_from) as handle:
            earlier = json.load(handle)
        with open(os.path.join(args.out, "horovodrun.log"), errors="replace") as handle:
            output = handle.read()
        result = report(args.out, earlier["faults"], earlier["exit_code"], output, earlier["timed_out"],
                        earlier["duration_s"], earlier["seed"])
        result["options"] = earlier["options"]
        return finish(result, args.json)
    result = soak(args.out, args.faults, args.seed, restarts=args.restarts, driver_log_level=args.driver_log_level,
                  restart_in_place=not args.no_restart_in_place, rendezvous_timeout_s=args.rendezvous_timeout_s)
    result["options"] = {"restart_in_place": not args.no_restart_in_place,
                         "rendezvous_timeout_s": args.rendezvous_timeout_s or None, "restarts": args.restarts}
    return finish(result, args.json)


def finish(result: Dict[str, Any], json_path: str) -> int:
    """Prints the report (and writes it to ``json_path``); 0 when the run met the goal."""
    print(json.dumps({k: v for k, v in result.items() if k != "faults"}, indent=1, sort_keys=True))
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(result, handle, indent=1, sort_keys=True)
    ok = (result["job_deaths"] == 0 and result["faults_survived"] == result["faults_injected"]
          and result["exactly_once"] and result["final_parameters_identical"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
