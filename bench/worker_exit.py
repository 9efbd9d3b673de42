"""How soon the driver records a killed worker's end: Horovod's middleman against the launcher's child.

Run from the repository root: ``.venv/bin/python -m bench.worker_exit``.

A failure's round forms only once the driver has recorded the failed
worker's end (elastic_ext/launch/worker_runs.py). This process plays the
driver: it runs a worker-like command (``bench/workers/exit_worker.py``: a
Python process that starts the guardian sidecar as ``@elastic_ext.run``
does, then connects back here) through Horovod's ``safe_shell_exec.execute``
or the launcher's ``worker_runs.execute``, alternating, ``--rounds`` times
each, SIGKILLs it, and measures from the moment its connection here closes
(what the survivors see) to the moment ``execute`` returns its status.

Writes bench/results/worker_exit.json and prints a table, launcher over Horovod.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, TextIO

from bench import harness

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "exit_worker.py")


def one_round(execute: Callable[..., int], devnull: TextIO) -> Dict[str, float]:
    server = socket.create_server(("127.0.0.1", 0))
    command = (f"cd {shlex.quote(os.getcwd())} > /dev/null 2>&1 ; "
               f"{shlex.quote(sys.executable)} {shlex.quote(WORKER)} {server.getsockname()[1]}")
    ended: Dict[str, float] = {}

    def run() -> None:
        ended["status"] = execute(command, index=0, stdout=devnull, stderr=devnull)
        ended["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    link, _ = server.accept()
    pid = int(link.recv(64))  # the worker is up and its guardian waits in its loop
    os.kill(pid, signal.SIGKILL)
    link.recv(1)  # b"": the worker's connection closed
    closed = time.monotonic()
    thread.join()
    link.close()
    server.close()
    return {"recorded_after_close_s": ended["at"] - closed, "status": ended["status"]}


def main() -> None:
    from horovod.runner.common.util import safe_shell_exec

    from elastic_ext.launch import worker_runs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--name", default="worker_exit")
    args = parser.parse_args()
    systems = {"horovod": safe_shell_exec.execute, "launcher": worker_runs.execute}
    results: Dict[str, List[Dict[str, float]]] = {system: [] for system in systems}
    with open(os.devnull, "w", encoding="utf-8") as devnull:
        for _ in range(args.rounds):
            for system, execute in systems.items():
                results[system].append(one_round(execute, devnull))
    statuses = {system: sorted({r["status"] for r in runs}) for system, runs in results.items()}
    if any(status != [128 + signal.SIGKILL] for status in statuses.values()):
        raise SystemExit(f"a killed worker's status was not {128 + signal.SIGKILL}: {statuses}")
    times = {system: [r["recorded_after_close_s"] for r in runs] for system, runs in results.items()}
    medians = {system: harness.median(values) for system, values in times.items()}
    ratio = medians["launcher"] / medians["horovod"]
    print(harness.table(["system", "median ms", "worst ms"],
                        [[system, medians[system] * 1e3, max(times[system]) * 1e3] for system in systems]))
    print(f"launcher / horovod: {ratio:.3f}")
    harness.write_json(args.name, {"command": "python -m bench.worker_exit", "rounds": args.rounds,
                                   "recorded_after_close_s": times, "median_s": medians,
                                   "ratio_launcher_over_horovod": ratio})


if __name__ == "__main__":
    main()
