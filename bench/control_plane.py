"""The control plane at scale: ``elastic-horovodrun``'s real driver and store against N simulated workers.

``python -m bench.control_plane --workers 64,256,1024`` runs, per N, the
driver of :mod:`bench.control_plane_driver` (Horovod's ``ElasticDriver``
and rendezvous server with the launcher's changes and the job's secret) in a
process of its own, and N simulated workers (:mod:`bench.control_plane_sim`)
in this one, on hosts of :data:`SLOTS` slots. Phases, each bounded by its
own timeout (reported as such, never a hang):

1. ``start``: the driver starts the N workers; each runs its first
   ``hvd.init()`` (Gloo's rendezvous only up to ``--gloo-start-max``
   workers, 0 by default: the start is not what is measured), registers,
   syncs. A start that does not end in its bound goes on with the workers
   that trained (``trained_at_steady``).
2. ``steady``: ``--steady-s`` of training: requests per second, p50/p99
   latency, the driver's CPU (``/proc/<pid>/stat``) per second, false fences.
3. ``stalled``: the driver stopped (SIGSTOP) for ``--stall-s``, then
   continued, and ``FENCE_S + 5`` s more: the workers that would have fenced.
4. ``reset``: one worker SIGKILLed (the driver sees its exit status; its
   peers' collective fails at once): ``round_formed_s`` is the time until
   every survivor's ``hvd.init()`` returned (``rank_s``: until every
   survivor had its rank). Gloo's rendezvous reads every peer's address
   twice, a value of 136 bytes per peer: about ``2.5 N^2`` requests and
   ``272 N^3`` bytes per global context; where it cannot end in
   ``--reset-timeout-s`` the measured rate and the extrapolation are
   reported instead.
5. ``regrow``: the round left the failed slot out; the survivors' early
   start brings its new worker in (a second reset).
6. ``host_added``: a host of :data:`SLOTS` slots is added to discovery; the
   coordinator's notice starts an early start (a third reset).

``--validate`` compares the simulation with real jobs of 4 and 6 workers
(:mod:`bench.control_plane_validate`). Results: ``bench/results/control_plane.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from bench.control_plane_run import SLOTS, Run

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "control_plane.json")


def machine() -> Dict[str, Any]:
    return {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unknown ({exc})"


def run_one(n: int, args: argparse.Namespace) -> Dict[str, Any]:
    run = Run(n, args)
    with tempfile.TemporaryDirectory(prefix="control_plane.") as tmp:
        run.tmp = tmp
        started = time.monotonic()
        result = asyncio.run(asyncio.wait_for(run.go(), args.run_timeout_s))
        result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="64,256,1024")
    parser.add_argument("--version", default="before", help="results.<version> (before: today's main)")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--stall-s", type=float, default=5.0)
    parser.add_argument("--start-timeout-s", type=float, default=90.0)
    parser.add_argument("--reset-timeout-s", type=float, default=45.0)
    parser.add_argument("--run-timeout-s", type=float, default=400.0)
    parser.add_argument("--gloo-start-max", type=int, default=0)
    parser.add_argument("--build-s", type=float, default=1.0, help="a newcomer's model build (s)")
    parser.add_argument("--process-start-s", type=float, default=1.0,
                        help="a worker's process start to its first request (Python, Horovod, the framework)")
    parser.add_argument("--driver-backlog", type=int, default=None,
                        help="a diagnosis only: the store's listen backlog (Horovod's: 5); never in results.before")
    parser.add_argument("--slots", type=int, default=SLOTS, help="slots per simulated host")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--until", choices=("reset", "host_added"), default="host_added",
                        help="the last phase to run (the suite's test stops after the reset)")
    parser.add_argument("--validate", action="store_true")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.validate:
        from bench import control_plane_validate
        control_plane_validate.main(args)
        return
    doc: Dict[str, Any] = {}
    if os.path.exists(args.output):
        with open(args.output) as handle:
            doc = json.load(handle)
    for n in [int(w) for w in args.workers.split(",")]:
        print(f"control_plane: N={n} ...", flush=True)
        result = run_one(n, args)
        print(json.dumps({k: v for k, v in result.items() if k not in ("phases", "driver_counts")}), flush=True)
        doc.setdefault("results", {}).setdefault(args.version, {})[str(n)] = result
        doc.update({"machine": machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "commit": commit(), "command": "python -m bench.control_plane " + " ".join(
                        sys.argv[1:] if argv is None else argv)})
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as handle:
            json.dump(doc, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
