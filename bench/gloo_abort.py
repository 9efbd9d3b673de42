"""Gloo's native abort of a surviving rank after a SIGKILL, with and without Horovod's response cache.

Run from the repository root: ``.venv/bin/python -m bench.gloo_abort [--trials 20]``.

No elastic_ext here: plain ``horovodrun --gloo -np 4`` jobs of
bench/workers/gloo_abort_worker.py, fused allreduces of the example MLP's
gradients in a loop, fused into one allreduce per round (Horovod's default
fusion threshold). Each trial SIGKILLs one rank (seeded choice and
moment) and counts survivors that then die in native code
(``terminate called``; ``op.preamble.length <= op.nbytes``). Trials
alternate between Horovod's defaults and ``HOROVOD_CACHE_CAPACITY=0``. Then
the rounds per second of the same loop without failures, alternating the two
settings ``--rate-runs`` times each: the price of the setting.

Why (see docs/failure_detection.md): Horovod's Gloo controller agrees on
cached responses every cycle with a ``gloo::allreduce`` of a bit vector (8
bytes with few tensors), on the same context and the same slot as the data
allreduces. A survivor whose data allreduce failed goes on to the next
cycle's bit-vector allreduce while a peer that has not failed yet still
sends it chunks of the failed one; Gloo matches a 1208-byte chunk to the
8-byte receive and throws in its event-loop thread, which ends the process.

Writes ``bench/results/gloo_abort.json``.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from typing import Any, Dict, List

from bench import harness
from elastic_ext.testing import launch

# Horovod's own fusion threshold in both (launch.base_env turns fusion off for the tests):
# one fused allreduce per round, as hvd.DistributedOptimizer does.
FUSED = {"HOROVOD_FUSION_THRESHOLD": harness.HOROVOD_DEFAULT_FUSION}
SETTINGS = {"horovod_default": dict(FUSED), "cache_capacity_0": dict(FUSED, HOROVOD_CACHE_CAPACITY="0")}
WORKER = os.path.join(harness.WORKERS, "gloo_abort_worker.py")
RANKS = 4
START_TIMEOUT_S = 90.0
END_TIMEOUT_S = 90.0


def command(*args: str) -> List[str]:
    return [os.path.join(launch.VENV_BIN, "horovodrun"), "--gloo", "-np", str(RANKS), "-H", f"localhost:{RANKS}",
            os.path.join(launch.VENV_BIN, "python"), WORKER, *args]


def trial(setting: str, directory: str, rng: random.Random) -> Dict[str, Any]:
    os.makedirs(directory)
    job = subprocess.Popen(command("loop", directory), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=launch.base_env(**SETTINGS[setting]))
    deadline = time.time() + START_TIMEOUT_S
    while len(glob.glob(os.path.join(directory, "ready.*"))) < RANKS and time.time() < deadline:
        time.sleep(harness.POLL_S)
    ready = sorted(glob.glob(os.path.join(directory, "ready.*")))
    victim, delay = rng.randrange(RANKS), 0.5 + rng.random()
    time.sleep(delay)
    if len(ready) == RANKS:
        os.kill(int(ready[victim].rsplit(".", 1)[1]), signal.SIGKILL)
    try:
        output, _ = job.communicate(timeout=END_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        output, _ = job.communicate()
    aborts = output.count("terminate called")
    preamble = output.count("op.preamble.length <= op.nbytes")
    if aborts:
        with open(os.path.join(directory, "output.txt"), "w") as handle:
            handle.write(output)
    return {"setting": setting, "started": len(ready) == RANKS, "killed_rank": victim, "kill_after_s": delay,
            "native_aborts": aborts, "preamble_aborts": preamble}


def rate(setting: str) -> float:
    output = subprocess.run(command("rate"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launch.base_env(**SETTINGS[setting]), timeout=300).stdout
    line = [x for x in output.splitlines() if "ROUNDS_PER_S" in x]
    if not line:
        raise RuntimeError(f"no rate from the {setting} job: {output[-2000:]}")
    return float(line[-1].split("ROUNDS_PER_S")[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=15, help="SIGKILL trials per setting")
    parser.add_argument("--rate-runs", type=int, default=3, help="failure-free rate runs per setting")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--name", default="gloo_abort")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="bench_gloo_abort_")
    machine = harness.machine()
    trials: List[Dict[str, Any]] = []
    for number in range(args.trials):
        for setting in SETTINGS:
            result = trial(setting, os.path.join(work, f"{setting}-{number}"), rng)
            trials.append(result)
            print(f"trial {number} {setting}: killed rank {result['killed_rank']}, native aborts "
                  f"{result['native_aborts']} (preamble {result['preamble_aborts']})", flush=True)
    rates: Dict[str, List[float]] = {s: [] for s in SETTINGS}
    for _ in range(args.rate_runs):
        for setting in SETTINGS:
            rates[setting].append(rate(setting))
            print(f"rate {setting}: {rates[setting][-1]:.1f} rounds/s", flush=True)
    summary = {}
    for setting in SETTINGS:
        mine = [t for t in trials if t["setting"] == setting and t["started"]]
        summary[setting] = {"trials": len(mine), "trials_with_a_native_abort": sum(bool(t["native_aborts"]) for t in mine),
                            "trials_with_a_preamble_abort": sum(bool(t["preamble_aborts"]) for t in mine),
                            "rounds_per_s_median": statistics.median(rates[setting])}
    default, safe = summary["horovod_default"], summary["cache_capacity_0"]
    result = {"benchmark": "gloo_abort", "machine": dict(machine, load_average_at_end=list(os.getloadavg())),
              "command": ".venv/bin/python -m bench.gloo_abort --trials %d" % args.trials, "seed": args.seed,
              "trials": trials, "rates_rounds_per_s": rates, "summary": summary,
              "rate_ratio_cache_off_to_default": safe["rounds_per_s_median"] / default["rounds_per_s_median"],
              "work_dir": work}
    path = harness.write_json(args.name, result)
    for setting, row in summary.items():
        print(f"{setting:16s} trials {row['trials']:3d}  with a native abort {row['trials_with_a_native_abort']:3d}  "
              f"(preamble {row['trials_with_a_preamble_abort']})  failure-free {row['rounds_per_s_median']:.1f} rounds/s")
    print(f"rate with HOROVOD_CACHE_CAPACITY=0: {result['rate_ratio_cache_off_to_default']:.2f} x the default")
    print(f"wrote {path}; trial logs with an abort under {work}")
    if not any(t["native_aborts"] for t in trials):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
