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
   continued, and ``FENCE_S + 5`` s more (``--after-stall-s``): the workers that would have fenced.
4. ``reset``: one worker SIGKILLed (the driver sees its exit status; its
   peers' collective fails at once): ``round_formed_s`` is the time until
   every survivor's ``hvd.init()`` returned (``rank_s``: until every
   survivor had its rank). Before issue 55's changes Gloo's rendezvous
   reads every peer's address twice, a value of 136 bytes per peer: about
   ``2.5 N^2`` requests and ``272 N^3`` bytes per global context; after
   them (Horovod with build patch 08) one request per rank, ``136 N^2``
   bytes. Where it cannot end in
   ``--reset-timeout-s`` the measured rate and the extrapolation are
   reported instead.
5. ``regrow``: the round left the failed slot out; the survivors' early
   start brings its new worker in (a second reset).
6. ``host_added``: a host of :data:`SLOTS` slots is added to discovery; the
   coordinator's notice starts an early start (a third reset).

Each N runs twice in one invocation, side by side (``--versions``):
``before``, the driver of main before issue 55 (``--before-commit``, in a
temporary git worktree) with the driver watch's old rule in the simulated
workers, and ``after``, this checkout's. Results: ``results.<version>.<N>``.

The simulated workers run on uvloop's event loop (``--sim-loop``): a
thousand workers' requests in one process are the simulation's cost, not
the driver's, and on asyncio's own loop that process took more CPU per
request than the driver's answer (0.36 to 0.47 ms against 0.27 to 0.37 at
1,024 workers), so on a 2-core machine the simulation, not the driver, set the pace of a reset's
bursts (``docs/benchmarks.md``). Real workers each have a CPU of their own.

``--validate`` compares the simulation with real jobs of 4 and 6 workers
(:mod:`bench.control_plane_validate`). Results: ``bench/results/control_plane.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

import uvloop

from bench.control_plane_run import SLOTS, Run

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "control_plane.json")
SIM_LOOPS = {"uvloop": uvloop.run, "asyncio": asyncio.run}
BEFORE_COMMIT = "5abd304"  # main before issue 55's changes: results.before


def machine() -> Dict[str, Any]:
    return {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"unknown ({exc})"


def run_one(n: int, args: argparse.Namespace, tree: Optional[str] = None, after: bool = True) -> Dict[str, Any]:
    """One N of the code of ``tree`` (this checkout by default), its workers speaking the protocol of main
    after issue 55's changes (``after``) or before them."""
    run = Run(n, args, **({} if tree is None else {"tree": tree}), after=after)
    with tempfile.TemporaryDirectory(prefix="control_plane.") as tmp:
        run.tmp = tmp
        started = time.monotonic()
        result = SIM_LOOPS[args.sim_loop](asyncio.wait_for(run.go(), args.run_timeout_s))
        result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="64,256,1024")
    parser.add_argument("--versions", default="before,after",
                        help="results.<version>, each N run by each in turn (before: main at --before-commit; "
                             "after: this checkout)")
    parser.add_argument("--before-commit", default=BEFORE_COMMIT, help="main before issue 55's changes")
    parser.add_argument("--before-tree", help="a checkout of --before-commit (default: a temporary git worktree)")
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--stall-s", type=float, default=5.0)
    parser.add_argument("--after-stall-s", type=float, default=None,
                        help="the stalled phase's time after the driver continues (default FENCE_S + 5)")
    parser.add_argument("--start-timeout-s", type=float, default=90.0)
    parser.add_argument("--reset-timeout-s", type=float, default=45.0)
    parser.add_argument("--run-timeout-s", type=float, default=400.0)
    parser.add_argument("--gloo-start-max", type=int, default=0)
    parser.add_argument("--build-s", type=float, default=1.0, help="a newcomer's model build (s)")
    parser.add_argument("--process-start-s", type=float, default=1.0,
                        help="a worker's process start to its first request (Python, Horovod, the framework)")
    parser.add_argument("--driver-backlog", type=int, default=None,
                        help="a diagnosis only: the store's listen backlog (Horovod's: 5); never in results")
    parser.add_argument("--exchange-hold-s", type=float, default=None,
                        help="a comparison only, of the after version: how long the store holds a Gloo exchange "
                             "(elastic_ext.launch.gloo_exchange.HOLD_S)")
    parser.add_argument("--slots", type=int, default=SLOTS, help="slots per simulated host")
    parser.add_argument("--sim-loop", choices=sorted(SIM_LOOPS), default="uvloop",
                        help="the simulated workers' event loop (module docstring)")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--until", choices=("reset", "host_added"), default="host_added",
                        help="the last phase to run (the suite's test stops after the reset)")
    parser.add_argument("--validate", action="store_true")
    return parser.parse_args(argv)


@contextlib.contextmanager
def before_tree(args: argparse.Namespace) -> Iterator[str]:
    """A checkout of main before the change: ``--before-tree``, or a temporary worktree of ``--before-commit``."""
    if args.before_tree:
        yield args.before_tree
        return
    with tempfile.TemporaryDirectory(prefix="control_plane_before.") as tmp:
        path = os.path.join(tmp, "tree")
        subprocess.run(["git", "worktree", "add", "--detach", path, args.before_commit], cwd=HERE, check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=HERE, capture_output=True)


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
    versions = args.versions.split(",")
    unknown = set(versions) - {"before", "after"}
    if unknown:
        raise SystemExit(f"--versions {args.versions!r}: {sorted(unknown)} unknown; expected before and/or after")
    doc["results"] = {}  # a run replaces every figure: before and after come from the same run, side by side
    with before_tree(args) if "before" in versions else contextlib.nullcontext(None) as before:
        trees = {"before": (before, False), "after": (None, True)}
        for n in [int(w) for w in args.workers.split(",")]:
            for version in versions:
                print(f"control_plane: N={n} {version} ...", flush=True)
                result = run_one(n, args, *trees[version])
                print(json.dumps({k: v for k, v in result.items() if k not in ("phases", "driver_counts")}),
                      flush=True)
                doc["results"].setdefault(version, {})[str(n)] = result
                doc.update({"machine": machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                            "commit": commit(), "before_commit": args.before_commit,
                            "command": "python -m bench.control_plane " + " ".join(
                                sys.argv[1:] if argv is None else argv)})
                os.makedirs(os.path.dirname(args.output), exist_ok=True)
                with open(args.output, "w") as handle:
                    json.dump(doc, handle, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
