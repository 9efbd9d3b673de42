"""The replica check's cost per step at its default cadence, on the bench.compare workload.

Failure-free jobs of bench/workers/compare_ext.py (the bench.compare worker: the digits
MLP 64-64-10 with Adam, 4 workers under ``elastic-horovodrun`` on two 2-slot pseudo-hosts,
global batch 64, 3 ms of emulated compute per sample, a commit every 10 steps), side by side
in the order A B ... B A (``--rounds`` times), with ``ELASTIC_EXT_REPLICA_CHECK_EVERY`` at 0
(off) and at the default cadence (or those ``--every`` names):

- the step time (median gap between completed steps on rank 0's log, from the first
  step at 4 workers to the stop) with the check over without it;
- what the check adds to a commit (the workers log each commit's seconds; the mean, since
  only every N-th commit is checked), per step: (commit seconds with - without) / commit
  interval, over the step time. Where commits overlap (PyTorch) a checked commit's
  collective blocks: that is in it too.

Also, in this process: a commit of that workload's state with and without the check in a
world of one (the digest's own cost, free of the collectives' noise), and the digest's
throughput over a state of ``--state-mb`` MB (what the check reads at each checked commit)
beside a plain copy (what every commit does).

And what a flip costs (``--flip-at STEP``, one more job at the default cadence): rank 1 flips
a bit of a parameter before STEP's forward pass; the check finds it, every rank replays from
the last agreed commit. From rank 0's events: the steps replayed and the seconds from the
``replica_replay`` to the ``transient`` verdict, over the same steps at the job's step time.
(The keep's host memory and commit time for a large state: ``bench.replica_keep``.)

    .venv/bin/python -m bench.replica_check [--every 10,1] [--rounds 2] [--overhead-s 20] [--flip-at 150]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

import numpy as np

from bench import compare, harness
from bench.compare_report import failure_free
from bench.workers import compare_common
from elastic_ext import ElasticConfig
from elastic_ext.events import read_events
from elastic_ext.policies.replica_check import replica_digest
from elastic_ext.state.snapshot import Entry
from devkit import ledger

ENV = "ELASTIC_EXT_REPLICA_CHECK_EVERY"


def commit_seconds(log_dir: str) -> List[float]:
    """Every commit's seconds on every rank (the workers' ``commit_s`` records)."""
    return [r["commit_s"] for r in ledger.read(log_dir) if "commit_s" in r]


def one_job(every: int, work: str, index: int, hosts: List[str], args: argparse.Namespace) -> Dict[str, Any]:
    os.environ[ENV] = str(every)  # launch.base_env copies this environment into the job's
    log_dir = os.path.join(work, f"every{every}-{index}")
    run = compare.run_attempt("ext", log_dir, hosts, 0, os.path.join(log_dir, "unused.pt"), args,
                              uptime_s=args.overhead_s)
    measured = failure_free([run])
    commits = commit_seconds(log_dir)
    result = {"every": every, "step_s": measured["step_time_s"], "samples_per_s": measured["samples_per_s"],
              "commit_s_mean": statistics.mean(commits) if commits else None, "commits": len(commits),
              "problems": run.problems}
    print(f"  replica_check_every={every}: step {1000 * (result['step_s'] or float('nan')):.2f} ms, "
          f"commit {1000 * (result['commit_s_mean'] or float('nan')):.3f} ms (mean of {len(commits)})"
          + (f"; {'; '.join(run.problems)}" if run.problems else ""), flush=True)
    return result


def flip_job(every: int, work: str, hosts: List[str], args: argparse.Namespace) -> Dict[str, Any]:
    """One job at cadence ``every`` with a bit flip before step ``args.flip_at``: what the replay cost."""
    os.environ[ENV] = str(every)
    os.environ["BENCH_FLIP_AT"] = str(args.flip_at)
    log_dir = os.path.join(work, f"flip-every{every}")
    try:
        run = compare.run_attempt("ext", log_dir, hosts, 0, os.path.join(log_dir, "unused.pt"), args,
                                  uptime_s=args.flip_overhead_s)
    finally:
        del os.environ["BENCH_FLIP_AT"]
    events = read_events(os.path.join(log_dir, "events-0.jsonl"))
    replay = next((e for e in events if e["event"] == "replica_replay"), None)
    verdict = next((e for e in events if e["event"] == "replica_mismatch"), None)
    step_s = failure_free([run])["step_time_s"]
    result: Dict[str, Any] = {"every": every, "flip_at": args.flip_at, "problems": run.problems, "step_s": step_s,
                              "replay": replay, "verdict": verdict}
    if replay is not None and verdict is not None:
        steps = (replay["commit_id"] - replay["back_to"]) * args.commit_every
        result.update(cause=verdict["cause"], steps_replayed=steps, replay_s=verdict["time"] - replay["time"],
                      replay_over_steps_at_step_time=harness.ratio(verdict["time"] - replay["time"],
                                                                   None if step_s is None else steps * step_s))
    print(f"  flip before step {args.flip_at}, check every {every}: {result.get('steps_replayed')} steps replayed "
          f"in {result.get('replay_s')} s ({result.get('cause')})", flush=True)
    return result


def commit_cost_in_process(commits: int = 200, rounds: int = 15) -> Dict[str, float]:
    """Seconds per commit of the bench.compare worker's state (the 64-64-10 MLP, Adam with its moments,
    the sampler, two counters) in a world of one, with the check at every commit and without
    (alternating blocks, the fastest block of each): the digest's own cost, free of the collectives'
    noise and of a busy machine's."""
    import torch

    from elastic_ext.testing import SoloBinding, state_on
    from elastic_ext.torch import ElasticSampler

    model, optimizer = compare_common.build_model()
    model(torch.zeros(4, 64)).sum().backward()
    optimizer.step()  # Adam's moments exist, as in training
    states = {}
    for every in (0, 1):
        sampler = ElasticSampler(compare_common.DATASET_SIZE, global_batch_size=64, seed=1, policy="pad",
                                 world=lambda: (0, 1))
        states[every] = state_on(SoloBinding(), config=ElasticConfig(replica_check_every=every), model=model,
                              optimizer=optimizer, sampler=sampler, epoch=0, step=0)
        states[every].commit()
    best = {0: float("inf"), 1: float("inf")}
    for _ in range(rounds):
        for every, state in states.items():
            started = time.perf_counter()
            for _ in range(commits):
                state.commit()
            best[every] = min(best[every], (time.perf_counter() - started) / commits)
    return {"commit_s_off": best[0], "commit_s_on": best[1], "check_s": best[1] - best[0]}


def digest_throughput(state_mb: int) -> Dict[str, float]:
    """GB/s of the check's digest and of a plain copy over ``state_mb`` MB of float32 arrays."""
    rng = np.random.default_rng(0)
    arrays = {f"layer{i}": rng.standard_normal(state_mb * (1 << 20) // 4 // 8, dtype=np.float32) for i in range(8)}
    entries = {"model": Entry(arrays=arrays, meta={"kind": "bench"})}
    nbytes = sum(a.nbytes for a in arrays.values())
    spare = {k: np.empty_like(a) for k, a in arrays.items()}
    digest_s, copy_s = [], []
    for _ in range(3):
        started = time.perf_counter()
        replica_digest(entries, ["model"], {"model": frozenset()})
        digest_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for key, array in arrays.items():
            np.copyto(spare[key], array)
        copy_s.append(time.perf_counter() - started)
    return {"state_bytes": nbytes, "digest_gb_per_s": nbytes / min(digest_s) / 1e9,
            "copy_gb_per_s": nbytes / min(copy_s) / 1e9}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", default="", help="cadences to measure besides off (default: the default one)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of A B ... B A")
    parser.add_argument("--overhead-s", type=float, default=20.0, help="seconds of each job at 4 workers")
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--compute-ms-per-sample", type=float, default=3.0)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--state-mb", type=int, default=256)
    parser.add_argument("--flip-at", type=int, default=0, help="also a job with a flip before this step (0: none)")
    parser.add_argument("--flip-overhead-s", type=float, default=45.0, help="seconds of the flip job at 4 workers")
    parser.add_argument("--name", default="replica_check", help="result file stem under bench/results")
    args = parser.parse_args(argv)
    args.overlap_commit = False  # bench.compare's option, not this benchmark's
    default = ElasticConfig().replica_check_every
    cadences = [int(x) for x in args.every.split(",") if x] or [default]
    work = tempfile.mkdtemp(prefix="bench_replica_")
    args.data = os.path.join(work, "digits.npz")
    compare_common.write_data(args.data)
    hosts = harness.local_host_names()
    arms = [0] + cadences
    jobs: Dict[int, List[Dict[str, Any]]] = {every: [] for every in arms}
    for index, every in enumerate((arms + arms[::-1]) * args.rounds):
        jobs[every].append(one_job(every, work, index, hosts, args))

    def median_of(runs, key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    step = {every: median_of(runs, "step_s") for every, runs in jobs.items()}
    commit = {every: median_of(runs, "commit_s_mean") for every, runs in jobs.items()}
    flip = flip_job(default, work, hosts, args) if args.flip_at else None
    throughput = digest_throughput(args.state_mb)
    in_process = commit_cost_in_process()
    ratios: Dict[str, Any] = {"digest_over_copy_time": throughput["copy_gb_per_s"] / throughput["digest_gb_per_s"]}
    for every in cadences:
        ratios[f"step_time_every_{every}_over_off"] = harness.ratio(step[every], step[0])
        ratios[f"commit_cost_per_step_every_{every}_over_step_time"] = (
            None if None in (commit[every], commit[0], step[0])
            else (commit[every] - commit[0]) / args.commit_every / step[0])
        ratios[f"in_process_digest_per_step_every_{every}_over_step_time"] = (
            None if step[0] is None else in_process["check_s"] / every / args.commit_every / step[0])
    result = harness.machine(default_every=default, commit_every=args.commit_every, runs=jobs, step_s=step,
                             commit_s_mean=commit, digest=throughput, in_process=in_process, ratios=ratios, flip=flip,
                             command="python -m bench.replica_check " + " ".join(sys.argv[1:]))
    print(harness.table(["replica check", "step median (ms)", "commit mean (ms)", "jobs"],
                        [["off" if every == 0 else f"every {every} commit(s)",
                          None if step[every] is None else 1000 * step[every],
                          None if commit[every] is None else 1000 * commit[every], len(jobs[every])]
                         for every in arms]))
    print(f"digest {throughput['digest_gb_per_s']:.2f} GB/s, copy {throughput['copy_gb_per_s']:.2f} GB/s "
          f"over {throughput['state_bytes'] / 1e6:.0f} MB; in one process a commit of this workload's state "
          f"takes {1e6 * in_process['commit_s_off']:.0f} us, {1e6 * in_process['check_s']:.0f} us more with the check")
    print(ratios)
    print("wrote", harness.write_json(args.name, result))
    flip_ok = flip is None or (flip.get("cause") == "transient" and not flip["problems"])
    return 0 if flip_ok and all(not r["problems"] for runs in jobs.values() for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
