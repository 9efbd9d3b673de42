"""Every benchmark in bench/ but the soak, one after the other, each with its default arguments (``make bench-all``).

    .venv/bin/python -m bench.run_all [--only compare,commit] [--skip recovery]

The soak (``bench.soak``) is left out: it is one long job whose length is
set by its number of faults, run on its own.

Each module runs in its own process (``python -m bench.<name>``), writes its
own results under bench/results, and a failing one does not stop the
others. Prints each module's wall time and exit code at the end; exits
non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The side-by-side comparison first: it is what `make bench` is mostly for.
MODULES = ("compare", "commit", "checkpoint", "recovery", "soft_failures")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated modules to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated modules to leave out")
    args = parser.parse_args()
    only = [m for m in args.only.split(",") if m]
    skip = {m for m in args.skip.split(",") if m}
    unknown = [m for m in only + sorted(skip) if m not in MODULES]
    if unknown:
        parser.error(f"unknown modules {unknown}; choose from {MODULES}")
    chosen = [m for m in (only or MODULES) if m not in skip]
    done = []
    started = time.time()
    for module in chosen:
        print(f"=== bench.{module} ===", flush=True)
        t0 = time.time()
        code = subprocess.call([sys.executable, "-m", f"bench.{module}"], cwd=REPO)
        done.append((module, code, time.time() - t0))
    print("\n=== summary ===")
    for module, code, seconds in done:
        print(f"bench.{module:14s} exit {code}  {seconds:6.0f} s")
    print(f"total {time.time() - started:.0f} s")
    return 0 if all(code == 0 for _, code, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())
