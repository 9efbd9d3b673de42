"""``bench.control_plane --validate``: the simulation against real jobs of 4 and 6 workers on this machine.

Each real job runs ``elastic-horovodrun`` (through
``bench.control_plane_driver --wrap``, which counts every request its store
answers, with its time) on two pseudo-hosts (``localhost``, ``127.0.0.1``)
with a checkpoint directory (so the keeper's round watch runs, as in the
simulation), the worker of ``bench/workers/control_plane_worker.py``: steady
training, rank 3 SIGKILLed, the survivors' reset, the slot's new worker
brought in by an early start. The simulation then runs the same N on the
same host layout. Compared, within :data:`MARGIN`:

- ``steady``: the store's requests per second per worker in steady training
  (the 5 s before the kill);
- ``reset``: the store's requests from the kill to the last survivor's end
  of ``hvd.init()``, by method, scope and key (Gloo's, the round keys,
  ``rank_and_size``); the phase's duration is reported beside it, not held
  to the margin (this machine's load decides it).

Bench-only, never in the suite. Writes ``validation`` into the results file.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

from bench import harness
from devkit import launch

MARGIN = 0.10  # relative difference allowed between a real and a simulated request count
STEADY_WINDOW_S = 10.0  # the polls are synchronised after a reset: a window of 10 polls, so one poll is 10 %
# The simulation's steady phase begins one poll interval before its first poll: 30 intervals, so that the
# poll not yet sent weighs 3 % instead of the margin's 10 % (the real job trains about 10 s before its kill).
SIM_STEADY_S = 30.0
# The reset's requests whose count the protocol fixes (the others, the polls, depend on the phase's duration).
DETERMINISTIC = ("gloo ", "GET rank_and_size/")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "control_plane_worker.py")


def group(key: str) -> str:
    """A counted request's group: Gloo's requests together, the launcher's keys and Horovod's apart."""
    method, scope, name, status = key.split(" ")
    if scope.split("_")[0] in ("global", "local", "cross"):
        return f"gloo {method}"
    return f"{method} {scope}/{name}"


def real_job(n: int, work: str) -> Dict[str, Any]:
    out = os.path.join(work, f"real-{n}")
    os.makedirs(os.path.join(out, "checkpoints"))
    hosts = os.path.join(out, "hosts")
    launch.write_hosts(hosts, [f"localhost:{n // 2}", f"127.0.0.1:{n - n // 2}"])
    cmd = harness.horovodrun(WORKER, ["--out", out, "--np", str(n)], hosts, np_=n, min_np=2, max_np=n)
    store_log = os.path.join(out, "store.jsonl")
    cmd = [sys.executable, "-m", "bench.control_plane_driver", "--wrap", store_log, "--",
           *launch.horovodrun_args(cmd)]
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=os.path.join(out, "events.jsonl"),
                          ELASTIC_EXT_CHECKPOINT_DIR=os.path.join(out, "checkpoints"))
    started = time.time()
    code, _ = launch.run(cmd, env, os.path.join(out, "horovodrun.log"), timeout_s=300)
    rows = [json.loads(line) for line in open(store_log)]
    with open(os.path.join(out, "kills.jsonl")) as handle:
        kill_t = json.loads(handle.readline())["t"]
    calls: Dict[int, List[Dict[str, Any]]] = collections.defaultdict(list)
    for path in glob.glob(os.path.join(out, "calls-*.jsonl")):
        for line in open(path):
            record = json.loads(line)
            calls[record["pid"]].append(record)
    # Survivors: a first init before the kill and an init after it (the killed one has none after).
    survivors = [min(c["end"] for c in cs if c["start"] > kill_t) for cs in calls.values()
                 if any(c["end"] < kill_t for c in cs) and any(c["start"] > kill_t for c in cs)]
    formed_t = max(survivors)
    steady = collections.Counter(group(" ".join(map(str, r[1:]))) for r in rows
                                 if kill_t - STEADY_WINDOW_S <= r[0] < kill_t)
    reset = collections.Counter(group(" ".join(map(str, r[1:]))) for r in rows if kill_t <= r[0] <= formed_t)
    return {"exit_code": code, "wall_s": round(time.time() - started, 1), "survivors": len(survivors),
            "round_formed_s": round(formed_t - kill_t, 3),
            "steady_per_worker_s": {k: round(v / STEADY_WINDOW_S / n, 3) for k, v in sorted(steady.items())},
            "reset_requests": dict(sorted(reset.items()))}


def simulated(n: int, args: argparse.Namespace) -> Dict[str, Any]:
    from bench import control_plane
    sim_args = argparse.Namespace(**vars(args))
    sim_args.slots = n // 2
    sim_args.gloo_start_max = n
    sim_args.steady_s = SIM_STEADY_S
    result = control_plane.run_one(n, sim_args)
    phases = result.get("phases", {})
    steady = collections.Counter()
    for key, count in phases.get("steady", {}).get("store_requests", {}).items():
        steady[group(key)] += count
    reset = collections.Counter()
    for key, count in phases.get("reset", {}).get("store_requests", {}).items():
        reset[group(key)] += count
    wall = phases.get("steady", {}).get("wall_s") or 1.0
    return {"round_formed_s": result.get("round_formed_s"), "timeouts": result.get("timeouts"),
            "steady_per_worker_s": {k: round(v / wall / n, 3) for k, v in sorted(steady.items())},
            "reset_requests": dict(sorted(reset.items()))}


def compare(real: Dict[str, float], sim: Dict[str, float], held: bool) -> Dict[str, Any]:
    """Each group's real and simulated figure; ``within_margin`` for those the protocol fixes (None: a poll
    whose count in the phase follows its duration, reported only)."""
    rows = {}
    for key in sorted(set(real) | set(sim)):
        r, s = real.get(key, 0), sim.get(key, 0)
        fixed = held or key.startswith(DETERMINISTIC)
        rows[key] = {"real": r, "sim": s, "within_margin": abs(r - s) <= MARGIN * max(r, s, 1) if fixed else None}
    return rows


def main(args: argparse.Namespace) -> None:
    validation: Dict[str, Any] = {"margin": MARGIN, "command": "python -m bench.control_plane --validate"}
    with tempfile.TemporaryDirectory(prefix="control_plane_validate.") as work:
        for n in (4, 6):
            print(f"validate: real job of {n} workers ...", flush=True)
            real = real_job(n, work)
            print(f"validate: simulation of {n} workers ...", flush=True)
            sim = simulated(n, args)
            validation[str(n)] = {
                "real": real, "sim": sim,
                "steady": compare(real["steady_per_worker_s"], sim["steady_per_worker_s"], held=True),
                "reset": compare(real["reset_requests"], sim["reset_requests"], held=False)}
            print(json.dumps(validation[str(n)], indent=1), flush=True)
    doc: Dict[str, Any] = {}
    if os.path.exists(args.output):
        with open(args.output) as handle:
            doc = json.load(handle)
    doc["validation"] = validation
    with open(args.output, "w") as handle:
        json.dump(doc, handle, indent=1, sort_keys=True)
