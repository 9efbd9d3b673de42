"""Soft failures: goodput with one 3x straggler (with and without eviction), and the numeric guard's cost.

Both measured on real ``horovodrun`` jobs of ``tests/multiprocess/workers/lifecycle.py``
(PyTorch, the UCI digits, global batch 64, a commit every 4 steps),
side by side in one run:

1. **Straggler.** Every rank spends ``--compute-s`` of simulated compute
   per 16 local samples inside ``state.step_timer`` (a sleep: the machine
   has 2 cores, and a sleep scales with the samples a rank holds as real
   compute would). Three jobs of ``--epochs`` epochs on 4 one-slot hosts:
   ``none`` (no straggler), ``straggler`` (rank 1 is 3x slower from step 20,
   eviction off), ``evicted`` (the same straggler, ``StragglerPolicy(
   factor=2.5, window_steps=8, warmup_steps=4)``). Goodput =
   samples committed exactly once / seconds from the first trained step to
   the last.
2. **Guard cost.** Two jobs without simulated compute, one with
   ``State(guard=NumericGuard())`` and ``state.guard_step`` after the
   allreduce: the median step time (from the ledger's step timestamps) with
   and without, and the median of ``guard_step`` itself as the worker timed it.

    .venv/bin/python -m bench.soft_failures
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
from typing import Any, Dict, List

from bench import harness
from elastic_ext.events import read_events
from elastic_ext.testing import launch, ledger

DIGITS = 1797
WORKER = os.path.join(launch.WORKERS, "lifecycle.py")


def hosts_for(count: int) -> List[str]:
    names = harness.local_host_names()
    if len(names) >= count:
        return [f"{name}:1" for name in names[:count]]
    return ["localhost:2", "127.0.0.1:2"]  # fewer names: two 2-slot hosts (an eviction then takes two ranks)


def run_job(workdir: str, name: str, args: List[str], epochs: int, timeout_s: float) -> Dict[str, Any]:
    out = os.path.join(workdir, name)
    os.makedirs(out)
    hosts = hosts_for(4)
    launch.write_hosts(os.path.join(out, "hosts"), hosts)
    cmd = harness.horovodrun(WORKER, ["--out", out, "--epochs", str(epochs), "--commit-every", "4", *args],
                             os.path.join(out, "hosts"), np_=4, min_np=2, max_np=4)
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=os.path.join(out, "events.jsonl")),
                              os.path.join(out, "horovodrun.log"), timeout_s)
    if code != 0:
        raise RuntimeError(f"{name}: job failed with exit code {code}:\n{output[-3000:]}")
    records = ledger.read(out)
    steps = [r for r in records if "gen" in r]
    audit = ledger.audit(records, DIGITS, epochs)
    span = max(r["t"] for r in steps) - min(r["t"] for r in steps)
    events = read_events(os.path.join(out, "events.jsonl"))
    by_worker: Dict[tuple, List[float]] = {}  # (generation, rank): one process's consecutive steps
    for record in steps:
        by_worker.setdefault((record["gen"], record["rank"]), []).append(record["t"])
    gaps = [b - a for times in by_worker.values() for a, b in zip(sorted(times), sorted(times)[1:])]
    guards = [json.load(open(path)) for path in glob.glob(os.path.join(out, "guard-*.json"))]
    return {
        "name": name, "hosts": hosts, "span_s": round(span, 3), "exactly_once": audit["exactly_once"],
        "goodput_samples_per_s": round(DIGITS * epochs / span, 1) if audit["exactly_once"] else None,
        "step_s_median": statistics.median(gaps) if gaps else None,
        "guard_step_s_median": statistics.median(g["median_s"] for g in guards) if guards else None,
        "evictions": sum(e["event"] == "straggler" and "host" in e for e in events),
        "rollbacks": sum(e["event"] == "rollback" for e in events),
        "evicted_at_step": next((e["step"] for e in events if e["event"] == "straggler"), None),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--compute-s", type=float, default=0.03)
    parser.add_argument("--guard-epochs", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--name", default="soft_failures", help="result file stem under bench/results")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_soft_")
    compute = ["--compute-s", str(args.compute_s)]
    runs = {
        "none": run_job(work, "none", compute, args.epochs, args.timeout_s),
        "straggler": run_job(work, "straggler", compute + ["--slow", "1:20:3"], args.epochs, args.timeout_s),
        "evicted": run_job(work, "evicted", compute + ["--slow", "1:20:3", "--straggler", "2.5:8:4"],
                           args.epochs, args.timeout_s),
        "no_guard": run_job(work, "no_guard", [], args.guard_epochs, args.timeout_s),
        "guard": run_job(work, "guard", ["--guard"], args.guard_epochs, args.timeout_s),
    }
    good = {k: runs[k]["goodput_samples_per_s"] for k in ("none", "straggler", "evicted")}
    ratios = {
        "goodput_evicted_over_straggler": harness.ratio(good["evicted"], good["straggler"]),
        "goodput_straggler_over_none": harness.ratio(good["straggler"], good["none"]),
        "goodput_evicted_over_none": harness.ratio(good["evicted"], good["none"]),
        "step_time_guard_over_no_guard": harness.ratio(runs["guard"]["step_s_median"],
                                                       runs["no_guard"]["step_s_median"]),
    }
    result = harness.machine(runs=runs, ratios=ratios, epochs=args.epochs, compute_s=args.compute_s)
    print(harness.table(["run", "goodput (samples/s)", "step median (ms)", "guard_step median (ms)", "evictions",
                         "rollbacks", "exactly once"],
                        [[r["name"], r["goodput_samples_per_s"], None if r["step_s_median"] is None
                          else 1000 * r["step_s_median"], None if r["guard_step_s_median"] is None
                          else 1000 * r["guard_step_s_median"], r["evictions"], r["rollbacks"], r["exactly_once"]]
                         for r in runs.values()]))
    print(json.dumps(ratios, indent=1))
    print("wrote", harness.write_json(args.name, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
