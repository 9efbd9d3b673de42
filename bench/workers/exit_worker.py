"""bench.worker_exit's worker: starts the guardian sidecar as a worker in ``@elastic_ext.run`` does
(stdin its heartbeat pipe, stdout discarded, stderr the worker's), connects to the driver-like
process at the port given once the guardian waits for heartbeats, sends its pid, and waits to be killed."""

import os
import socket
import subprocess
import sys
import time

SELECT_CALLS = {"23", "270", "72"}  # select and pselect6 on x86_64, pselect6 on aarch64

guardian = subprocess.Popen([sys.executable, "-m", "elastic_ext.runtime.guardian", "--pid", str(os.getpid()),
                             "--timeout-s", "60"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


def guardian_waits():
    """True while the guardian is blocked in its select() (the syscall it waits in, from /proc)."""
    with open(f"/proc/{guardian.pid}/syscall", encoding="ascii") as handle:
        return handle.read().split(" ", 1)[0] in SELECT_CALLS


# Ready once the guardian waits for a heartbeat in select() (its imports done), as in a training worker.
deadline = time.monotonic() + 30
while not guardian_waits() and time.monotonic() < deadline:
    time.sleep(0.01)
link = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
link.sendall(str(os.getpid()).encode())
while True:
    guardian.stdin.write(b"\n")  # a heartbeat
    guardian.stdin.flush()
    time.sleep(1)
