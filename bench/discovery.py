"""The driver's discovery runs: Horovod's against elastic-horovodrun's (elastic_ext/launch/discovery_runs.py).

Run from the repository root: ``.venv/bin/python -m bench.discovery``.

The discovery is the project's ``host_discovery/static.py`` on a host file of
two hosts, as in bench.compare. Two measurements, each system in turn
(Horovod, launcher, launcher, Horovod), in one process that plays the driver:

- **cost of one run** (``--runs`` runs each): wall time and CPU time (this
  process and its children: the middleman, the shell, the script) of
  ``HostDiscoveryScript.find_available_hosts_and_slots``, which Horovod's
  driver calls once a second for the whole job;
- **a round's wait for the host lock**: the driver's discovery loop runs
  (Horovod's ``ElasticDriver._discover_hosts`` or the launcher's) for
  ``--seconds``, and at seeded random moments another thread takes the host
  lock, as ``wait_for_available_slots`` does when a failure's round forms;
  each take's wait is recorded (``--takes`` takes).

Writes bench/results/discovery.json and prints a table, launcher over Horovod.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
import types
from typing import Any, Callable, Dict, List

from bench import harness

SYSTEMS = ("horovod", "launcher")


def cpu_s() -> float:
    """CPU seconds of this process and its ended children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def horovod_execute(discovery: Any) -> str:
    """Horovod 0.28.1's ``_execute_discovery_script``."""
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    return HostDiscoveryScript._execute_discovery_script(discovery)


def one_run(system: str, command: str) -> Dict[str, float]:
    from elastic_ext.launch import discovery_runs
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    discovery = HostDiscoveryScript(command, 1)
    execute = horovod_execute if system == "horovod" else discovery_runs.run_script
    cpu, wall = cpu_s(), time.perf_counter()
    output = execute(discovery)
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    if sorted(output.split()) != ["127.0.0.1:2", "localhost:2"]:
        raise RuntimeError(f"{system}: the discovery answered {output!r}")
    return {"wall_s": wall, "cpu_s": cpu}


def lock_waits(system: str, command: str, seconds: float, takes: int, seed: int) -> List[float]:
    """Waits for the host lock at ``takes`` seeded moments while ``system``'s discovery loop runs."""
    from elastic_ext.launch import discovery_runs
    from horovod.runner.elastic.discovery import HostDiscoveryScript, HostManager
    from horovod.runner.elastic.driver import ElasticDriver

    loop: Callable[[Any], None] = \
        ElasticDriver._discover_hosts if system == "horovod" else discovery_runs.discover_hosts
    discovery = HostDiscoveryScript(command, 1)
    if system == "launcher":  # the launcher's run of the script too, as its driver builds its discovery
        discovery = discovery_runs.script_discovery(discovery)
    driver = types.SimpleNamespace(_shutdown=threading.Event(), _wait_hosts_cond=threading.Condition(),
                                   _host_manager=HostManager(discovery),
                                   _notify_workers_host_changes=lambda hosts, result: None)
    thread = threading.Thread(target=loop, args=(driver,), daemon=True)
    thread.start()
    with driver._wait_hosts_cond:  # the first answer, as the driver's start waits for it
        driver._wait_hosts_cond.wait_for(lambda: driver._host_manager.current_hosts.count_available_slots(), 60)
    draw = random.Random(seed)
    waits = []
    for _ in range(takes):
        driver._shutdown.wait(draw.uniform(0, 2 * seconds / takes))  # a failure at a random moment
        started = time.perf_counter()
        with driver._wait_hosts_cond:
            waits.append(time.perf_counter() - started)
    driver._shutdown.set()
    thread.join(30)
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="discovery runs per system and turn")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of discovery loop per system and turn")
    parser.add_argument("--takes", type=int, default=60, help="takes of the host lock per system and turn")
    parser.add_argument("--name", default="discovery")
    args = parser.parse_args()
    if args.runs < 1 or args.takes < 1 or args.seconds <= 0:
        parser.error(f"--runs {args.runs}, --takes {args.takes}, --seconds {args.seconds}: expected positive values")

    work = tempfile.mkdtemp(prefix="bench_discovery_")
    hosts = os.path.join(work, "hosts")
    with open(hosts, "w") as handle:
        handle.write("localhost:2\n127.0.0.1:2\n")
    command = f"{sys.executable} {os.path.join(harness.REPO_ROOT, 'host_discovery', 'static.py')} {hosts}"

    runs: Dict[str, List[Dict[str, float]]] = {s: [] for s in SYSTEMS}
    waits: Dict[str, List[float]] = {s: [] for s in SYSTEMS}
    for turn, system in enumerate(("horovod", "launcher", "launcher", "horovod")):
        runs[system] += [one_run(system, command) for _ in range(args.runs)]
        waits[system] += lock_waits(system, command, args.seconds, args.takes, seed=turn)
        print(f"{system}: {args.runs} runs, {args.takes} takes of the lock", flush=True)

    results: Dict[str, Dict[str, float]] = {}
    for system in SYSTEMS:
        walls, cpus, held = [r["wall_s"] for r in runs[system]], [r["cpu_s"] for r in runs[system]], waits[system]
        results[system] = {
            "run_wall_median_s": statistics.median(walls), "run_cpu_median_s": statistics.median(cpus),
            "lock_wait_median_s": statistics.median(held), "lock_wait_mean_s": statistics.fmean(held),
            "lock_wait_p90_s": sorted(held)[int(0.9 * (len(held) - 1))], "lock_wait_max_s": max(held),
            "takes_waiting_over_10ms": sum(w > 0.01 for w in held) / len(held)}
    ratios = {key: harness.ratio(results["launcher"][key], results["horovod"][key])
              for key in results["horovod"] if key != "takes_waiting_over_10ms"}
    rows = [[key, results["horovod"][key], results["launcher"][key], ratios.get(key)] for key in results["horovod"]]
    print(harness.table(["", "horovod", "launcher", "launcher / horovod"], rows))
    path = harness.write_json(args.name, {
        "machine": harness.machine(), "command": " ".join(sys.argv), "settings": vars(args),
        "results": results, "launcher_over_horovod": ratios,
        "samples": {"runs": runs, "lock_waits_s": waits}})
    print(path)


if __name__ == "__main__":
    main()
