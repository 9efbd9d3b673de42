"""How soon a SIGKILLed worker's links close, its tensors in 4 KiB pages against huge pages.

Run from the repository root: ``.venv/bin/python -m bench.kill_close``.

The survivors of a failure learn of it when the killed worker's TCP
connections close, and the kernel closes a killed process's sockets only
after it freed the process's memory. This process plays a survivor: it
starts ``bench/workers/held_memory_worker.py`` (a 432 MB tensor, written,
committed into its buffer and written again), with PyTorch's
``THP_MEM_ALLOC_ENABLE`` unset and set to 1 as the launcher's worker entry
sets it (``elastic_ext/worker/torch_pages.py``), alternating, ``--rounds``
times each, SIGKILLs the worker and measures until its connection here
closes.

Writes bench/results/kill_close.json and prints a table, huge pages over 4 KiB pages.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List

from bench import harness
from elastic_ext.worker.torch_pages import VARIABLE

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "held_memory_worker.py")
SYSTEMS = {"4 KiB pages": None, "huge pages": "1"}


def one_round(value: str, megabytes: int) -> Dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    if value is not None:
        env[VARIABLE] = value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [harness.REPO_ROOT, env.get("PYTHONPATH")]))
    server = socket.create_server(("127.0.0.1", 0))
    worker = subprocess.Popen([sys.executable, WORKER, str(server.getsockname()[1]), str(megabytes)], env=env)
    try:
        server.settimeout(120)
        link, _ = server.accept()
        pid, huge_mb = (int(x) for x in link.recv(64).split())
        link.settimeout(60)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if link.recv(1) != b"":
            raise SystemExit("the worker sent more than its pid")
        closed = time.monotonic()
        link.close()
    finally:
        worker.kill()
        worker.wait()
        server.close()
    return {"close_after_kill_s": closed - killed, "huge_mb": huge_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--megabytes", type=int, default=432, help="the tensor's size (its buffer is as large)")
    parser.add_argument("--name", default="kill_close")
    args = parser.parse_args()
    results: Dict[str, List[Dict[str, float]]] = {system: [] for system in SYSTEMS}
    for _ in range(args.rounds):
        for system, value in SYSTEMS.items():
            results[system].append(one_round(value, args.megabytes))
    times = {system: [r["close_after_kill_s"] for r in runs] for system, runs in results.items()}
    huge = {system: [r["huge_mb"] for r in runs] for system, runs in results.items()}
    medians = {system: harness.median(values) for system, values in times.items()}
    ratio = medians["huge pages"] / medians["4 KiB pages"]
    print(harness.table(["tensor in", "median ms", "worst ms", "MB in huge pages (median)"],
                        [[system, medians[system] * 1e3, max(times[system]) * 1e3, harness.median(huge[system])]
                         for system in SYSTEMS]))
    print(f"huge pages / 4 KiB pages: {ratio:.3f}")
    harness.write_json(args.name, {"command": "python -m bench.kill_close", "rounds": args.rounds,
                                   "megabytes": args.megabytes, "close_after_kill_s": times,
                                   "huge_pages_mb": huge, "median_s": medians,
                                   "ratio_huge_over_small_pages": ratio})


if __name__ == "__main__":
    main()
