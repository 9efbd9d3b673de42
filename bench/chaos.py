"""Chaos: torchft's published failure profile scaled to this machine, every system under the same schedule.

torchft's chaos runs killed a random replica group every 15 s on average
(its punisher draws each wait uniformly from 0 to twice the mean and never
kills group 0). Here: ``--duration-s`` (at least 600) of training from the
first step at 4 workers; SIGKILLs at seeded times (waits uniform in
[0, 2 x ``--mtbf-s``]) of a seeded rank in 1..3 (the worker holding that rank
in the job's newest generation; if it is not alive, the highest rank alive;
if no worker of rank > 0 is alive, as during torchrun's restart of every
worker, the kill waits for one until the next kill's time and is dropped
after that), the same times and ranks for every system, whatever state the
job is in (a kill may land during a recovery). elastic_ext commits and torchrun
checkpoints every ``--commit-every`` steps (5: Young's interval for this
profile, see :data:`COMMIT_EVERY`); torchft commits every step. A job that dies, or that
completes no step for ``HANG_S``, is killed whole and launched again for the
time left. Then the job is stopped at a step boundary and each system
runs the failure-free jobs of bench.compare for its throughput: two of
``--overhead-s`` seconds (30), in the order A B C C B A. At 12 s the two
jobs of one system differed by up to 15 % in one run (torchft's 1036 and
891 samples/s in ``chaos_every5_2``), and their median sets every step
efficiency below.

Reported per system, beside bench.compare's figures (bench/compare_report.py):

- **step efficiency**: committed samples per second over the run (goodput)
  divided by the failure-free throughput;
- **analytic bound**: the fraction of the run not lost to the failures
  given the system's measured recovery R (the median time from a SIGKILL to
  the next completed step in this run): ``1 - |union of [kill, kill + R]| /
  run time`` over the SIGKILLs delivered, so that a kill during a recovery
  costs only what it adds (torchft's "82.3 % against an 83.3 % bound" is
  ``1 - R / MTBF`` with its restart time); also with the median time back to
  4 workers as R (a lower bound for systems that train on fewer meanwhile);
- **bound at the reduced throughput**, for a system that trains on fewer
  workers until the failed one is back: each failure loses the whole
  throughput for R and ``1 - c`` of it from then until the median time back
  to 4 workers F, where c is the system's throughput on 3 workers over its
  throughput on 4 in this run (median samples per second over the whole
  seconds at each size; 3/4 where the run has fewer than 5 such seconds at
  3 workers); overlapping failures count once, each instant at its worst;
- **step efficiency against the run's own pace**: goodput over the
  run's median second at 4 workers between failures (its timeline's
  seconds whose neighbours are at 4 too), which the VM's speed at the
  time moves as it moves the goodput; the failure-free jobs run minutes
  later. Reported beside the other, with its distance to the bound at
  the reduced throughput;
- **trained after a failure**: the samples of the 10 s after a failure
  (the run's per-second timeline), in seconds of failure-free throughput,
  averaged over the failures within 5 s of the previous one ("close": they
  can strike while its replacement starts) and over those with no other
  failure within 10 s ("isolated"). Every system gets the same schedule,
  so two runs compare failure by failure.

    .venv/bin/python -m bench.chaos --systems torchft,torchrun,ext [--duration-s 600] [--mtbf-s 15] [--seed 0]
    .venv/bin/python -m bench.chaos --report-from NAME    # the table of bench/results/NAME.json, recomputed

Writes bench/results/chaos.json (``--name``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import psutil

from bench import compare, harness
from bench.compare_report import LABELS, WORKERS_PER_JOB, analyze, failure_free
from bench.workers import compare_common
from devkit import launch

SYSTEMS = ("torchft", "torchrun", "ext", "torchft_ddp")  # the ones that refill a failed slot by themselves
MAX_RESTARTS = 1000  # torchrun agents (torchrun, torchft groups): every failure is a restart
HANG_S = 90.0  # no completed step for this long: the job is stuck, killed and launched again
# Young's interval sqrt(2 C M) for this profile: a commit (elastic_ext's, or torchrun's torch.save of
# the model) costs C of about 2 ms of training here (bench.compare's "commit, median"), a failure comes
# every M = 15 s: 0.25 s, 4 to 5 steps of 60 ms. (bench.compare, one failure per ~17 s cycle, keeps 10.)
COMMIT_EVERY = 5


def schedule(seed: int, mtbf_s: float, duration_s: float) -> List[Tuple[float, int]]:
    """(seconds after the first full-size step, rank to kill), seeded: the same for every system."""
    rng = random.Random(seed)
    at, kills = 0.0, []
    while True:
        at += rng.uniform(0.0, 2.0 * mtbf_s)
        if at >= duration_s:
            return kills
        kills.append((at, rng.choice(range(1, WORKERS_PER_JOB))))


def victim(run: compare.Attempt, rank: int) -> Optional[dict]:
    """The start record of the live worker holding ``rank`` in the newest generation, else of the
    highest rank alive (never rank 0); None when no worker of rank > 0 is alive."""
    pids = run.pids()
    starts = sorted((r for r in run.records if "start" in r and r.get("pid") in pids and r["rank"] > 0),
                    key=lambda r: r["t"], reverse=True)
    alive = [r for r in starts if running(r["pid"])]
    if not alive:
        return None
    newest = alive[0]["start"]
    exact = [r for r in alive if r["start"] == newest and r["rank"] == rank]
    return exact[0] if exact else max((r for r in alive if r["start"] == newest), key=lambda r: r["rank"])


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stuck(run: compare.Attempt) -> bool:
    """No completed step for HANG_S (the job is alive but will not train again by itself)."""
    last = run.last_step()
    return last is not None and time.time() - max(last["t"], max((f["killed_at"] for f in run.failures),
                                                                 default=0.0)) > HANG_S


def run_chaos(system: str, work: str, hosts: List[str], kills: List[Tuple[float, int]],
              args: argparse.Namespace) -> List[compare.Attempt]:
    """Launches ``system`` and applies ``kills`` for ``args.duration_s``; relaunches a job that dies."""
    attempts: List[compare.Attempt] = []
    t0: Optional[float] = None
    done = 0
    while t0 is None or time.time() < t0 + args.duration_s:
        log_dir = os.path.join(work, system, f"attempt-{len(attempts)}")
        os.makedirs(log_dir)
        hosts_file = os.path.join(log_dir, "hosts")
        launch.write_hosts(hosts_file, [f"{host}:{compare.SLOTS_PER_HOST}" for host in hosts[:2]])
        checkpoint = os.path.join(work, system, "checkpoint.pt")  # torchrun's, ext's beside it; survive a relaunch
        run = compare.Attempt(system, log_dir, compare.launch_jobs(system, log_dir, hosts_file, checkpoint, args),
                              time.time())
        attempts.append(run)
        first = run.expect(lambda r: "done" in r and r["size"] == WORKERS_PER_JOB, compare.START_TIMEOUT_S,
                           "first step")
        run.first_full = first["t"] if first else None
        if first is None:
            break
        t0 = first["t"] if t0 is None else t0
        for number, (offset, rank) in enumerate(kills[done:], start=done):
            run.idle_until(t0 + offset)
            if not run.alive() or stuck(run):
                break
            until = t0 + (kills[number + 1][0] if number + 1 < len(kills) else args.duration_s)
            # (a kill whose turn passed while a relaunched job started is dropped: no burst of kills)
            target = victim(run, rank) if time.time() < until else None
            while target is None and time.time() < until and run.alive():
                run.idle_until(time.time() + 0.1)
                target = victim(run, rank)
            done = number + 1
            if target is None:
                print(f"  {LABELS[system]}: failure {number} at +{offset:.1f} s dropped: no worker of rank > 0 "
                      "alive until the next one", flush=True)
                run.dropped = getattr(run, "dropped", 0) + 1
                continue
            last = run.last_step()
            killed_at = run.kill(target["pid"])
            if killed_at is not None:  # gen: the generation training was in (analyze() reads steps after it)
                run.failures.append({"killed_at": killed_at, "pid": target["pid"], "rank": target["rank"],
                                     "gen": last["g"] if last else target["start"], "number": number})
        else:
            while time.time() < t0 + args.duration_s and run.alive() and not stuck(run):
                run.idle_until(min(t0 + args.duration_s, time.time() + 5))
        if run.alive() and not stuck(run):
            run.poll()
            last = run.last_step()
            stop = (last["done"] // args.commit_every + 3) * args.commit_every if last else 0
            launch.write_hosts(os.path.join(log_dir, "stop"), [str(stop)])
        if stuck(run):
            run.problems.append(f"no step for {HANG_S:.0f} s: killed and launched again")
        for code, name in run.stop(compare.STOP_TIMEOUT_S if not run.problems else 5):
            run.exit_codes.append(code)
        run.ended = time.time()
        print(f"  {LABELS[system]}: attempt {len(attempts) - 1} ended after {run.ended - run.launched:.0f} s, "
              f"{len(run.failures)} SIGKILLs, exit codes {run.exit_codes}", flush=True)
        if done >= len(kills) and time.time() >= t0 + args.duration_s - 1:
            break
    for run in attempts:  # analyze() counts a failure as survived when training went on after it
        for f in run.failures:
            after = [r for r in run.records if "done" in r and r["t"] > f["killed_at"]]
            if after:
                f["resumed_at"] = min(r["t"] for r in after)
    return attempts


def lost(kills_at: List[float], recovery_s: float, end: float) -> float:
    """Length of the union of [kill, kill + recovery_s] (cut at ``end``)."""
    total, reach = 0.0, float("-inf")
    for at in sorted(kills_at):
        begin, stop = max(at, reach), min(at + recovery_s, end)
        total += max(0.0, stop - begin)
        reach = max(reach, at + recovery_s)
    return total


STEADY_MIN_SECONDS = 5  # fewer steady seconds at a size than this: its throughput is not measured


def steady(timeline: List[List[Any]], size: int) -> List[float]:
    """Samples of the seconds of the run's timeline (per second: [second, samples, size]) at ``size``
    workers whose neighbours are at that size too."""
    return [row[1] for before, row, after in zip(timeline, timeline[1:], timeline[2:])
            if before[2] == row[2] == after[2] == size and row[1] > 0]


def reduced_throughput(timeline: List[List[Any]], fewer: int = WORKERS_PER_JOB - 1) -> Tuple[float, bool]:
    """(throughput on ``fewer`` workers over throughput at full size, measured?) from the run's
    timeline: the median over the :func:`steady` seconds; ``fewer / WORKERS_PER_JOB`` when fewer
    than :data:`STEADY_MIN_SECONDS` such seconds."""
    full, reduced = steady(timeline, WORKERS_PER_JOB), steady(timeline, fewer)
    if len(full) < STEADY_MIN_SECONDS or len(reduced) < STEADY_MIN_SECONDS:
        return fewer / WORKERS_PER_JOB, False
    return min(1.0, harness.median(reduced) / harness.median(full)), True


def lost_capacity(kills_at: List[float], resume_s: float, full_s: float, reduced: float, end: float,
                  tick_s: float = 0.01) -> float:
    """Seconds of full throughput lost: all of it in [kill, kill + resume_s], ``1 - reduced`` of it until
    kill + full_s; where failures overlap, each instant counts at its worst (cut at ``end``)."""
    loss = [0.0] * (int(end / tick_s) + 1)
    for at in kills_at:
        for i in range(max(0, int(at / tick_s)), min(len(loss), int((at + max(full_s, resume_s)) / tick_s))):
            loss[i] = max(loss[i], 1.0 if i * tick_s < at + resume_s else 1.0 - reduced)
    return sum(loss) * tick_s


CLOSE_S = 5.0  # a failure this soon after the one before it can strike while that one's replacement starts
WINDOW_S = 10  # seconds of the timeline counted after a failure


def after_failures(result: Dict[str, Any]) -> Dict[str, List[float]]:
    """What the job trained in the :data:`WINDOW_S` seconds after each failure, in seconds of
    failure-free throughput: after a failure within :data:`CLOSE_S` of the previous one ("close"),
    and after one with no other failure within :data:`WINDOW_S` either side ("isolated")."""
    throughput = result.get("throughput_samples_per_s")
    per_second = {row[0]: row[1] for row in result.get("timeline") or []}
    kills = [f["at_s"] for f in result.get("failures", [])]
    out: Dict[str, List[float]] = {"close": [], "isolated": []}
    if not throughput:
        return out
    for i, at in enumerate(kills):
        trained = sum(per_second.get(t, 0) for t in range(int(at), int(at) + WINDOW_S)) / throughput
        before = at - kills[i - 1] if i else float("inf")
        after = kills[i + 1] - at if i + 1 < len(kills) else float("inf")
        if before <= CLOSE_S:
            out["close"].append(trained)
        elif before > WINDOW_S and after > WINDOW_S:
            out["isolated"].append(trained)
    return out


def efficiency(result: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """Step efficiency and its analytic bounds (see the module docstring)."""
    wall, throughput = result.get("training_wall_s"), result.get("throughput_samples_per_s")
    out: Dict[str, Optional[float]] = {"step_efficiency": None, "bound": None, "bound_full_size": None}
    if not wall or not throughput:
        return out
    out["step_efficiency"] = result["goodput_samples_per_s"] / throughput
    kills_at = [f["at_s"] for f in result.get("failures", [])]
    for key, field in (("bound", "resume_median_s"), ("bound_full_size", "full_size_median_s")):
        if result.get(field) is not None:
            out[key] = max(0.0, 1.0 - lost(kills_at, result[field], wall) / wall)
    if out["bound"] is not None:
        out["points_below_bound"] = 100.0 * (out["bound"] - out["step_efficiency"])
    resume, full = result.get("resume_median_s"), result.get("full_size_median_s")
    if resume is not None and full is not None:
        reduced, measured = reduced_throughput(result.get("timeline") or [])
        out["throughput_on_3_over_4"], out["throughput_on_3_measured"] = reduced, measured
        out["bound_reduced_throughput"] = max(0.0, 1.0 - lost_capacity(kills_at, resume, full, reduced, wall) / wall)
        out["points_below_bound_reduced_throughput"] = 100.0 * (out["bound_reduced_throughput"]
                                                                - out["step_efficiency"])
        # The same against the run's own pace: the median second at 4 workers between failures,
        # taken in the run rather than in the failure-free jobs that follow it.
        at_four = steady(result.get("timeline") or [], WORKERS_PER_JOB)
        if len(at_four) >= STEADY_MIN_SECONDS:
            out["throughput_in_run_samples_per_s"] = harness.median(at_four)
            out["step_efficiency_in_run"] = result["goodput_samples_per_s"] / out["throughput_in_run_samples_per_s"]
            out["points_below_bound_reduced_throughput_in_run"] = 100.0 * (out["bound_reduced_throughput"]
                                                                           - out["step_efficiency_in_run"])
    windows = after_failures(result)
    for kind in ("close", "isolated"):
        trained = windows[kind]
        out[f"trained_after_{kind}_failures_s"] = trained
        out[f"trained_after_{kind}_failure_mean_s"] = sum(trained) / len(trained) if trained else None
    return out


ROWS = [("SIGKILLs / job deaths", None), ("scheduled SIGKILLs dropped", "kills_dropped"), ("run time (s)", "training_wall_s"),
        ("goodput (samples/s)", "goodput_samples_per_s"), ("throughput w/o failures", "throughput_samples_per_s"),
        ("step efficiency", "step_efficiency"), ("analytic bound", "bound"),
        ("  points below the bound", "points_below_bound"), ("bound with back-to-4 time", "bound_full_size"),
        ("bound at the reduced throughput", "bound_reduced_throughput"),
        ("  points below it", "points_below_bound_reduced_throughput"),
        ("  throughput on 3 / on 4", "throughput_on_3_over_4"),
        ("throughput at 4 in the run (median second)", "throughput_in_run_samples_per_s"),
        ("step efficiency against it", "step_efficiency_in_run"),
        ("  points below the reduced bound", "points_below_bound_reduced_throughput_in_run"),
        (f"trained {WINDOW_S} s after a close failure (s)", "trained_after_close_failure_mean_s"),
        (f"trained {WINDOW_S} s after an isolated one (s)", "trained_after_isolated_failure_mean_s"),
        ("time to resume, median (s)", "resume_median_s"), ("back to 4 workers, median (s)", "full_size_median_s"),
        ("steps discarded", "steps_discarded"), ("per-rank batches discarded", "batches_discarded"),
        ("duplicated samples", "duplicated_samples"), ("skipped samples", "skipped_samples"),
        ("audited epochs", "audited_epochs")]


def print_table(results: Dict[str, Dict[str, Any]]) -> None:
    names = list(results)
    rows = []
    for label, key in ROWS:
        if key is None:
            rows.append([label] + [f"{len(results[n].get('failures', []))} / {results[n].get('job_deaths')}"
                                   for n in names])
        else:
            rows.append([label] + [harness.fmt(results[n].get(key)) for n in names])
    print(harness.table([""] + [LABELS[n] for n in names], rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="torchft,torchrun,ext")
    parser.add_argument("--duration-s", type=float, default=600.0, help="training time under failures")
    parser.add_argument("--mtbf-s", type=float, default=15.0, help="mean seconds between SIGKILLs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overhead-s", type=float, default=30.0,
                        help="seconds of each failure-free job (two per system, A B C C B A); 0: none")
    parser.add_argument("--commit-every", type=int, default=COMMIT_EVERY,
                        help="steps between commits (elastic_ext) and checkpoints (torchrun)")
    parser.add_argument("--compute-ms-per-sample", type=float, default=3.0)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--name", default="chaos")
    parser.add_argument("--report-from", metavar="NAME", help="recompute and print the table of "
                        "bench/results/NAME.json instead of running")
    args = parser.parse_args()
    if args.report_from:
        with open(harness.result_path(args.report_from + ".json"), encoding="utf-8") as handle:
            saved = json.load(handle)["results"]
        for result in saved.values():
            result.update(efficiency(result))
        print_table(saved)
        return 0
    args.max_restarts = MAX_RESTARTS  # what compare.launch_jobs reads
    systems = [s for s in args.systems.split(",") if s]
    for system in systems:
        if system not in SYSTEMS:
            parser.error(f"system {system!r} cannot run the chaos profile; choose from {SYSTEMS} "
                         "(plain horovodrun blacklists each failed host and would run out of hosts)")
    kills = schedule(args.seed, args.mtbf_s, args.duration_s)
    hosts = harness.local_host_names()
    work = tempfile.mkdtemp(prefix="bench_chaos_")
    args.data = os.path.join(work, "digits.npz")
    compare_common.write_data(args.data)
    started = time.time()
    print(f"{len(kills)} SIGKILLs in {args.duration_s:.0f} s (seed {args.seed}, mean gap {args.mtbf_s} s); "
          f"logs in {work}", flush=True)
    results: Dict[str, Dict[str, Any]] = {}
    for system in systems:
        print(f"{LABELS[system]}:", flush=True)
        attempts = run_chaos(system, work, hosts, kills, args)
        results[system] = analyze(system, attempts)
        results[system]["wall_s"] = attempts[-1].ended - attempts[0].launched
        results[system]["kills_dropped"] = sum(getattr(run, "dropped", 0) for run in attempts)
    if args.overhead_s > 0:
        print("failure-free jobs:", flush=True)
        runs: Dict[str, List[compare.Attempt]] = {system: [] for system in systems}
        for k, system in enumerate(systems + systems[::-1]):
            log_dir = os.path.join(work, "no-failure", f"{system}-{k}")
            runs[system].append(compare.run_attempt(system, log_dir, hosts, 0, os.path.join(log_dir, "ckpt.pt"),
                                                    args, uptime_s=args.overhead_s))
        for system in systems:
            measured = failure_free(runs[system])
            results[system]["throughput_samples_per_s"] = measured["samples_per_s"]
            results[system]["throughput_runs_samples_per_s"] = measured["runs_samples_per_s"]
    for system in systems:
        if results[system].get("throughput_samples_per_s") is None:
            results[system]["throughput_samples_per_s"] = \
                results[system].get("throughput_between_failures_samples_per_s")
        results[system].update(efficiency(results[system]))
    info = {"benchmark": "chaos", "machine": harness.machine(),
            "command": ".venv/bin/python -m bench.chaos " + " ".join(sys.argv[1:]),
            "settings": {"duration_s": args.duration_s, "mtbf_s": args.mtbf_s, "seed": args.seed,
                         "kills": [[round(at, 3), rank] for at, rank in kills], "workers": WORKERS_PER_JOB,
                         "commit_every": args.commit_every, "compute_ms_per_sample": args.compute_ms_per_sample,
                         "global_batch": args.global_batch, "max_restarts": MAX_RESTARTS},
            "work_dir": work, "results": results, "runtime_s": time.time() - started}
    harness.write_json(args.name, info, indent=1)
    print_table(results)
    print(f"runtime {info['runtime_s']:.0f} s; logs in {work}")
    return 0 if all(r.get("timeline") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
