"""Horovod's PyTorch collective wait: spinning on a core (Horovod's own) against sleeping between polls (elastic_ext's).

The bench.compare elastic_ext worker (the digits MLP, Adam, global batch
64, every gradient's allreduce in flight then waited for, as
``hvd.DistributedOptimizer`` does), failure-free under ``elastic-horovodrun``,
in two modes that differ in one thing:

- ``sleep``: the worker as the launcher starts it, whose ``hvd.init()``
  replaces the extension's wait (:mod:`elastic_ext.worker.torch_wait`);
- ``spin``: bench/workers/spin_wait.py takes that replacement back, so each
  wait spins in Horovod's ``horovod_torch_wait_and_clear``.

Each configuration (workers, emulated compute per sample) runs the modes in
the order A B B A (``--rounds`` times); each job trains ``--warmup-s``
seconds at full size, then is measured for ``--seconds``: rank 0's mean
step time (the measured seconds over its steps) and median, the median and
90th percentile of the step's allreduce-and-update part (the step log's step record to its done record:
where the wait is), and the CPU the workers used per step (all their
threads). Reported side by side, with the ratio spin / sleep.

    .venv/bin/python -m bench.engine [--rounds 2] [--seconds 15]

Writes bench/results/engine.json.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Dict, List

import psutil

from bench import harness
from bench.workers import compare_common
from devkit import launch

WORKERS = {"sleep": "compare_ext.py", "spin": "spin_wait.py"}
CONFIGS = [  # (workers, emulated compute in ms per sample)
    (4, 3.0),  # bench.compare's job
    (4, 0.0),
    (2, 0.0),  # no more workers than cores, the shortest steps: where a spin costs the least
]
START_TIMEOUT_S = 180.0


def one_job(work: str, data: str, workers: int, ms_per_sample: float, mode: str, args: argparse.Namespace) -> Dict:
    out = tempfile.mkdtemp(prefix=f"{mode}-{workers}-", dir=work)
    hosts = os.path.join(out, "hosts")
    launch.write_hosts(hosts, ["localhost:2", "127.0.0.1:2"][:workers // 2 or 1])
    cmd = launch.under_elastic_ext_driver(harness.horovodrun(
        os.path.join(harness.WORKERS, WORKERS[mode]),
        ["--out", out, "--data", data, "--compute-ms-per-sample", str(ms_per_sample)], hosts, workers, 2, workers))
    job = launch.Job(cmd, launch.base_env(HOROVOD_FUSION_THRESHOLD=harness.HOROVOD_DEFAULT_FUSION),
                     os.path.join(out, "horovodrun.log"))
    seen = harness.Watch([job], out)
    result: Dict = {"mode": mode, "workers": workers, "compute_ms_per_sample": ms_per_sample}
    try:
        first, why = seen.wait_for(lambda r: "done" in r and r["size"] == workers, START_TIMEOUT_S)
        if first is None:
            result["error"] = f"no step at {workers} workers: {why}"
            return result
        seen.idle_until(time.time() + args.warmup_s)
        procs = [psutil.Process(pid) for pid in worker_pids(seen)]
        cpu_before = sum(cpu_s(p) for p in procs)
        start = time.time()
        seen.idle_until(start + args.seconds)
        end = time.time()
        cpu_used = sum(cpu_s(p) for p in procs) - cpu_before
    finally:
        job.kill()
    seen.poll()
    steps = timed_steps(seen.records, workers, start, end)
    if len(steps) < 10:
        result["error"] = f"{len(steps)} steps measured"
        return result
    step_s = [b["done_t"] - a["done_t"] for a, b in zip(steps, steps[1:])]
    waits = [s["done_t"] - s["step_t"] for s in steps]
    per_s = (len(steps) - 1) / (steps[-1]["done_t"] - steps[0]["done_t"])
    result.update({"steps": len(steps), "steps_per_s": per_s, "step_ms": 1000 / per_s,
                   "step_median_ms": 1000 * statistics.median(step_s),
                   "allreduce_ms": 1000 * statistics.median(waits),
                   "allreduce_p90_ms": 1000 * sorted(waits)[int(0.9 * len(waits))],
                   "cpu_ms_per_step": 1000 * cpu_used / len(steps)})
    return result


def worker_pids(seen: harness.Watch) -> List[int]:
    """The workers: the processes that write a steps file (steps-<pid>.jsonl)."""
    return sorted({harness.writer_pid(path) for path in seen.offsets})


def cpu_s(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def timed_steps(records: List[dict], workers: int, start: float, end: float) -> List[Dict]:
    """Rank 0's steps at full size that ended in [start, end]: the step record's and the done record's times."""
    began: Dict = {}
    steps = []
    for r in records:
        if r.get("rank") != 0 or r.get("size") != workers:
            continue
        if "indices" in r:
            began[(r["gen"], r["step"])] = r["t"]
        elif "done" in r and (r["g"], r["done"]) in began and start <= r["t"] <= end:
            steps.append({"step_t": began[(r["g"], r["done"])], "done_t": r["t"]})
    return sorted(steps, key=lambda s: s["done_t"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="A B B A rounds per configuration")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds per job")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds at full size before measuring")
    parser.add_argument("--name", default="engine")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_engine_")
    data = os.path.join(work, "data.npz")
    compare_common.write_data(data)
    runs = []
    for workers, ms in CONFIGS:
        for _ in range(args.rounds):
            for mode in ("sleep", "spin", "spin", "sleep"):
                runs.append(one_job(work, data, workers, ms, mode, args))
                print(json.dumps(runs[-1]), flush=True)
    summary = []
    for workers, ms in CONFIGS:
        row: Dict = {"workers": workers, "compute_ms_per_sample": ms}
        for mode in WORKERS:
            ok = [r for r in runs if r["mode"] == mode and r["workers"] == workers
                  and r["compute_ms_per_sample"] == ms and "error" not in r]
            for key in ("step_ms", "step_median_ms", "allreduce_ms", "allreduce_p90_ms", "cpu_ms_per_step"):
                row[f"{mode}_{key}"] = harness.median([r[key] for r in ok])
        row["step_time_spin_over_sleep"] = harness.ratio(row["spin_step_ms"], row["sleep_step_ms"])
        summary.append(row)
    print(harness.table(
        ["workers", "ms/sample", "mean step ms sleep", "mean step ms spin", "spin/sleep", "allreduce ms sleep (p90)",
         "allreduce ms spin (p90)", "CPU ms/step sleep", "CPU ms/step spin"],
        [[r["workers"], r["compute_ms_per_sample"], r["sleep_step_ms"], r["spin_step_ms"],
          r["step_time_spin_over_sleep"],
          f"{harness.fmt(r['sleep_allreduce_ms'])} ({harness.fmt(r['sleep_allreduce_p90_ms'])})",
          f"{harness.fmt(r['spin_allreduce_ms'])} ({harness.fmt(r['spin_allreduce_p90_ms'])})",
          r["sleep_cpu_ms_per_step"], r["spin_cpu_ms_per_step"]] for r in summary]))
    print(f"logs in {work}")
    harness.write_json(args.name, {"benchmark": "engine", "machine": harness.machine(),
                                   "command": f"python -m bench.engine --rounds {args.rounds} --seconds {args.seconds}",
                                   "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
