"""A worker restarted in place: PyTorch imported by its keeper before the fork, against imported by the child.

Run from the repository root: ``.venv/bin/python -m bench.restart_start``.

When a member of a forming round dies, the others die inside
``hvd.init()`` and their keepers start the script again in a new child
(``elastic_ext/launch/keeper.py``). The keeper imports PyTorch before its
first fork when the script imports it, so a restarted child finds it
imported. This benchmark starts a keeper through the launcher's worker
entry (``python -m elastic_ext.launch.worker``, as ``elastic-horovodrun``
does) on a script that imports ``torch``, ``horovod.torch`` and
``elastic_ext`` as bench.compare's worker does, builds bench.compare's
model, then aborts inside ``hvd.init()`` (as Gloo's ``std::terminate``
ends a worker) ``--restarts`` times. It measures each restart from the
abort to the new child's model built, two ways, alternating:

- ``keeper imports torch``: the script's ``import torch`` (the keeper
  sees it);
- ``child imports torch``: the same script importing its modules through
  ``importlib.import_module``, which the keeper's scan of the script does
  not see: what every restart cost before the keeper imported PyTorch.

``--busy N`` keeps N processes spinning meanwhile (default 2, the cores of
this project's test machine: the other members train or restart too).
Writes bench/results/restart_start.json and prints a table, with the ratio
of the medians.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, List

from bench import harness
from elastic_ext.launch import keeper

SCRIPT = """
import json, os, sys, time
started = time.time()
preloaded = "torch" in sys.modules  # before the script's own imports: what the keeper did
from elastic_ext.launch import keeper
IMPORTS
import bench.models
model = bench.models.mlp([64, 256, 256, 10])
ready = time.time()
n = keeper.restarts()
out, restarts = sys.argv[1], int(sys.argv[2])
with open(os.path.join(out, f"child-{n}.json"), "w") as f:
    json.dump({"started": started, "ready": ready, "preloaded": preloaded, "aborted": time.time()}, f)
if n < restarts:
    keeper.enter_init()
    os.abort()  # as Gloo's std::terminate ends a worker inside hvd.init()
"""
SYSTEMS = {
    "keeper imports torch": "import torch\nimport horovod.torch as hvd\nimport elastic_ext\nimport elastic_ext.torch",
    "child imports torch": "import importlib\nfor name in ('torch', 'horovod.torch', 'elastic_ext', "
                           "'elastic_ext.torch'):\n    importlib.import_module(name)",
}


def one_job(system: str, restarts: int) -> List[Dict[str, float]]:
    """Runs one keeper through ``restarts`` restarts; per restart: abort to model built, and the child's own part."""
    with tempfile.TemporaryDirectory(prefix="bench_restart_") as out:
        path = os.path.join(out, "script.py")
        source = textwrap.dedent(SCRIPT).replace("IMPORTS", SYSTEMS[system])
        with open(path, "w") as f:
            f.write(source)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "ELASTIC_EXT_"))}
        env.update({"HOROVOD_ELASTIC": "1", "ELASTIC_EXT_RESTART_IN_PLACE": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [harness.REPO_ROOT, os.environ.get("PYTHONPATH")]))})
        proc = subprocess.run([sys.executable, "-m", "elastic_ext.launch.worker", path, out, str(restarts)],
                              env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{system}: the keeper ended with {proc.returncode}: {proc.stderr[-2000:]}")
        children = [json.load(open(os.path.join(out, f"child-{n}.json"))) for n in range(restarts + 1)]
    runs = []
    for before, child in zip(children, children[1:]):
        if child["preloaded"] != (system == "keeper imports torch"):
            raise SystemExit(f"{system}: a restarted child found torch imported: {child['preloaded']} (expected "
                             f"{system == 'keeper imports torch'})")
        runs.append({"abort_to_ready_s": child["ready"] - before["aborted"],
                     "child_start_to_ready_s": child["ready"] - child["started"]})
    return runs


def spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6, help="keepers per system, alternating")
    parser.add_argument("--restarts", type=int, default=keeper.MAX_RESTARTS_WITHOUT_JOINING,
                        help="restarts per keeper (at most keeper.MAX_RESTARTS_WITHOUT_JOINING: these children "
                             "never join a job)")
    parser.add_argument("--busy", type=int, default=2, help="processes spinning meanwhile")
    parser.add_argument("--name", default="restart_start")
    args = parser.parse_args()
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    results: Dict[str, List[Dict[str, float]]] = {system: [] for system in SYSTEMS}
    try:
        for _ in range(args.jobs):
            for system in SYSTEMS:
                results[system].extend(one_job(system, args.restarts))
    finally:
        for p in busy:
            p.terminate()
    times = {system: [r["abort_to_ready_s"] for r in runs] for system, runs in results.items()}
    own = {system: [r["child_start_to_ready_s"] for r in runs] for system, runs in results.items()}
    medians = {system: harness.median(values) for system, values in times.items()}
    ratio = medians["keeper imports torch"] / medians["child imports torch"]
    print(harness.table(["restart", "abort to model built, median s", "worst s", "child's own part, median s"],
                        [[system, medians[system], max(times[system]), harness.median(own[system])]
                         for system in SYSTEMS]))
    print(f"keeper imports torch / child imports torch: {ratio:.3f}")
    harness.write_json(args.name, {"command": "python -m bench.restart_start", "machine": harness.machine(),
                                   "jobs": args.jobs, "restarts": args.restarts, "busy": args.busy,
                                   "abort_to_ready_s": times, "child_start_to_ready_s": own,
                                   "median_s": medians, "ratio_preloaded_over_not": ratio})


if __name__ == "__main__":
    main()
