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
2. **Guard cost, custom loop.** Jobs without simulated compute: without a
   guard, with ``State(guard=NumericGuard())`` and ``state.guard_step`` after
   the allreduce (its allgather in Horovod's background thread, the step
   judged at the next ``guard_step`` or commit), and with the guard's
   blocking allgather per step as it was before (``--guard-blocking``): the
   median step time (from the ledger's step timestamps) and the median of
   ``guard_step`` itself as the worker timed it. Jobs differ in the load
   they meet on a shared machine, so ``guard_ab`` and ``guard_blocking_ab``
   also measure within one job: the guard on for 8 steps, off for 8, and
   so on; the ratio is the median step with it over the median without.
3. **Guard cost, model.fit.** tests/multiprocess/workers/keras_fit.py (Keras 3,
   a 64-32-10 MLP, global batch 64, a commit every 4 steps, 4 workers)
   with and without ``State(guard=NumericGuard())``: the guard's signal
   rides on the gradient allreduce and the callback judges each batch.

The guard jobs run in the order A B C C B A (``--rounds`` times), so that a
machine whose load drifts favours none.

    .venv/bin/python -m bench.soft_failures [--parts straggler,guard,fit]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
from typing import Any, Dict, List

from bench import harness
from elastic_ext.events import read_events
from devkit import launch, ledger

DIGITS = 1797
WORKER = os.path.join(launch.WORKERS, "lifecycle.py")
FIT_WORKER = os.path.join(launch.WORKERS, "keras_fit.py")
GUARD_BLOCKS = 8


def hosts_for(count: int) -> List[str]:
    names = harness.local_host_names()
    if len(names) >= count:
        return [f"{name}:1" for name in names[:count]]
    return ["localhost:2", "127.0.0.1:2"]  # fewer names: two 2-slot hosts (an eviction then takes two ranks)


def run_job(workdir: str, name: str, args: List[str], epochs: int, timeout_s: float,
            worker: str = WORKER, fusion: bool = False) -> Dict[str, Any]:
    out = os.path.join(workdir, name)
    os.makedirs(out)
    hosts = hosts_for(4)
    launch.write_hosts(os.path.join(out, "hosts"), hosts)
    cmd = harness.horovodrun(worker, ["--out", out, "--epochs", str(epochs), "--commit-every", "4", *args],
                             os.path.join(out, "hosts"), np_=4, min_np=2, max_np=4)
    # base_env turns tensor fusion off (bitwise-reproducible tests); --fusion gives Horovod's default back.
    fused = {"HOROVOD_FUSION_THRESHOLD": harness.HOROVOD_DEFAULT_FUSION} if fusion else {}
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=os.path.join(out, "events.jsonl"),
                                                   **fused),
                              os.path.join(out, "horovodrun.log"), timeout_s)
    if code != 0:
        raise RuntimeError(f"{name}: job failed with exit code {code}:\n{output[-3000:]}")
    records = ledger.read(out)
    steps = [r for r in records if "gen" in r]
    audit = ledger.audit(records, DIGITS, epochs)
    span = max(r["t"] for r in steps) - min(r["t"] for r in steps)
    events = read_events(os.path.join(out, "events.jsonl"))
    by_worker: Dict[tuple, List[dict]] = {}  # (generation, rank): one process's consecutive steps
    for record in steps:
        by_worker.setdefault((record["gen"], record["rank"]), []).append(record)
    step_gaps = [(a["step"], b["t"] - a["t"]) for records_ in by_worker.values()
                 for a, b in zip(sorted(records_, key=lambda r: r["t"]), sorted(records_, key=lambda r: r["t"])[1:])
                 if b["step"] == a["step"] + 1]  # a step's time: its start to the next one's
    gaps = [gap for _, gap in step_gaps]
    guards = [json.load(open(path)) for path in glob.glob(os.path.join(out, "guard-*.json"))]
    return {
        "name": name, "hosts": hosts, "span_s": round(span, 3), "exactly_once": audit["exactly_once"],
        "goodput_samples_per_s": round(DIGITS * epochs / span, 1) if audit["exactly_once"] else None,
        "step_s_median": statistics.median(gaps) if gaps else None,
        "guard_step_s_median": statistics.median(g["median_s"] for g in guards) if guards else None,
        "evictions": sum(e["event"] == "straggler" and "host" in e for e in events),
        "rollbacks": sum(e["event"] == "rollback" for e in events),
        "evicted_at_step": next((e["step"] for e in events if e["event"] == "straggler"), None),
        "step_gaps": step_gaps,
    }


GUARD_KINDS = {  # name: (worker, its arguments)
    "no_guard": (WORKER, []),
    "guard": (WORKER, ["--guard"]),
    "guard_blocking": (WORKER, ["--guard", "--guard-blocking"]),
    # On and off in one job (blocks of GUARD_BLOCKS steps): the same load on both sides.
    "guard_ab": (WORKER, ["--guard", "--guard-blocks", "8"]),
    "guard_blocking_ab": (WORKER, ["--guard", "--guard-blocking", "--guard-blocks", "8"]),
    "fit_no_guard": (FIT_WORKER, ["--keras", "3", "--global-batch", "64"]),
    "fit_guard": (FIT_WORKER, ["--keras", "3", "--global-batch", "64", "--guard"]),
}


def guard_runs(work: str, kinds: List[str], epochs: int, rounds: int, timeout_s: float,
               fusion: bool = False) -> Dict[str, Any]:
    """Every kind ``rounds`` times in the order A B C C B A; per kind the medians over its jobs."""
    jobs: Dict[str, List[Dict[str, Any]]] = {kind: [] for kind in kinds}
    for index, kind in enumerate((kinds + kinds[::-1]) * rounds):
        worker, worker_args = GUARD_KINDS[kind]
        job = run_job(work, f"{kind}-{index}", worker_args, epochs, timeout_s, worker, fusion)
        jobs[kind].append(job)
        print(f"  {kind}: step median {1000 * job['step_s_median']:.1f} ms", flush=True)
    runs = {}
    for kind, done in jobs.items():
        if kind.endswith("_ab"):  # within each job: the median step with the guard over the one without
            on = [gap for job in done for step, gap in job["step_gaps"] if (step // GUARD_BLOCKS) % 2 == 0]
            off = [gap for job in done for step, gap in job["step_gaps"] if (step // GUARD_BLOCKS) % 2]
            for job in done:
                job.pop("step_gaps")
            runs[kind] = {"name": kind, "jobs": done, "exactly_once": all(j["exactly_once"] for j in done),
                          "step_s_median": statistics.median(on), "step_s_median_off": statistics.median(off),
                          "guard_step_s_median": statistics.median(j["guard_step_s_median"] for j in done),
                          "goodput_samples_per_s": None, "evictions": 0, "rollbacks": 0}
            continue
        for job in done:
            job.pop("step_gaps")
        steps = [j["step_s_median"] for j in done if j["step_s_median"] is not None]
        guards = [j["guard_step_s_median"] for j in done if j["guard_step_s_median"] is not None]
        runs[kind] = {"name": kind, "jobs": done, "exactly_once": all(j["exactly_once"] for j in done),
                      "step_s_median": statistics.median(steps) if steps else None,
                      "guard_step_s_median": statistics.median(guards) if guards else None,
                      "goodput_samples_per_s": None, "evictions": 0, "rollbacks": sum(j["rollbacks"] for j in done)}
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="straggler,guard,fit")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--compute-s", type=float, default=0.03)
    parser.add_argument("--guard-epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of A B C C B A for the guard jobs")
    parser.add_argument("--fusion", action="store_true",
                        help="Horovod's default tensor fusion in the guard jobs (off by default, as in the tests)")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--name", default="soft_failures", help="result file stem under bench/results")
    args = parser.parse_args(argv)
    parts = set(filter(None, args.parts.split(",")))
    work = tempfile.mkdtemp(prefix="bench_soft_")
    compute = ["--compute-s", str(args.compute_s)]
    runs: Dict[str, Dict[str, Any]] = {}
    ratios: Dict[str, Any] = {}
    if "straggler" in parts:
        runs["none"] = run_job(work, "none", compute, args.epochs, args.timeout_s)
        runs["straggler"] = run_job(work, "straggler", compute + ["--slow", "1:20:3"], args.epochs, args.timeout_s)
        runs["evicted"] = run_job(work, "evicted", compute + ["--slow", "1:20:3", "--straggler", "2.5:8:4"],
                                  args.epochs, args.timeout_s)
        good = {k: runs[k]["goodput_samples_per_s"] for k in ("none", "straggler", "evicted")}
        ratios.update({
            "goodput_evicted_over_straggler": harness.ratio(good["evicted"], good["straggler"]),
            "goodput_straggler_over_none": harness.ratio(good["straggler"], good["none"]),
            "goodput_evicted_over_none": harness.ratio(good["evicted"], good["none"])})
    kinds = (["no_guard", "guard", "guard_blocking", "guard_ab", "guard_blocking_ab"] if "guard" in parts else []) + \
        (["fit_no_guard", "fit_guard"] if "fit" in parts else [])
    if kinds:
        runs.update(guard_runs(work, kinds, args.guard_epochs, args.rounds, args.timeout_s, args.fusion))
    step = {k: r["step_s_median"] for k, r in runs.items()}
    if "guard" in parts:
        ratios["step_time_guard_over_no_guard"] = harness.ratio(step["guard"], step["no_guard"])
        ratios["step_time_guard_blocking_over_no_guard"] = harness.ratio(step["guard_blocking"], step["no_guard"])
        for kind in ("guard_ab", "guard_blocking_ab"):
            ratios[f"{kind}_step_time_on_over_off_in_one_job"] = harness.ratio(
                runs[kind]["step_s_median"], runs[kind]["step_s_median_off"])
    if "fit" in parts:
        ratios["fit_step_time_guard_over_no_guard"] = harness.ratio(step["fit_guard"], step["fit_no_guard"])
    result = harness.machine(runs=runs, ratios=ratios, epochs=args.epochs, compute_s=args.compute_s,
                             fusion=args.fusion,
                             command="python -m bench.soft_failures " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:]))
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
