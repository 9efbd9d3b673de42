"""The guardian: a sidecar that SIGKILLs its worker when the heartbeat stops.

Run as ``python -m elastic_ext.guardian --pid PID --timeout-s T`` with the
worker's heartbeat pipe on stdin (see :mod:`elastic_ext.watchdog`). Exits
quietly on EOF (the worker stopped the watchdog, or died).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args(argv)
    # Ignore the terminal's and the driver's SIGINT/SIGTERM aimed at the group:
    # the guardian leaves when its pipe closes, i.e. when the worker is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    fd = stdin.fileno()
    last = time.monotonic()
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.05, args.timeout_s - (time.monotonic() - last)))
        if ready:
            data = os.read(fd, 4096)
            if not data:
                return 0
            last = time.monotonic()
            continue
        if time.monotonic() - last >= args.timeout_s:
            sys.stderr.write(f"elastic_ext guardian: worker {args.pid} sent no heartbeat for "
                             f"{args.timeout_s:.1f}s (stopped or frozen): SIGKILL\n")
            sys.stderr.flush()
            try:
                os.kill(args.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return 0


if __name__ == "__main__":
    sys.exit(main())
