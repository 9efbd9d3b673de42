"""How long the store holds a Gloo exchange, compared over repeated resets at one N.

``python -m bench.control_plane_hold --workers 1024 --runs 3 --holds 5,30``
runs :mod:`bench.control_plane` ``--versions after --until reset`` once per
run and hold, the holds taking turns (run 1 with each hold, then run 2...),
so that both see the machine alike, and writes per run: whether the reset
ended within its bound, ``round_formed_s``, ``rank_s``, the exchanges the
store answered 404 (held past the hold: the rank sends its whole body
again) and the driver's CPU per request in the reset. Results:
``bench/results/control_plane_exchange_hold.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

from bench.control_plane import commit, machine

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "control_plane_exchange_hold.json")


def summary(result: Dict[str, Any]) -> Dict[str, Any]:
    """One reset's figures out of ``results.after.<N>`` of :mod:`bench.control_plane`."""
    resent = sum(count for key, count in result.get("driver_counts", {}).items()
                 if " _mesh_" in key and key.endswith(" 404"))
    reset = result.get("phases", {}).get("reset", {})
    return {"ended": result.get("round_formed_s") is not None, "round_formed_s": result.get("round_formed_s"),
            "rank_s": result.get("rank_s"), "exchanges_answered_404": resent,
            "driver_cpu_ms_per_request": reset.get("driver_cpu_ms_per_request"),
            "driver_cpu_cores": reset.get("driver_cpu_cores"), "requests": reset.get("requests")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--holds", default="5,30", help="hold times (s), comma-separated")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    holds = [float(hold) for hold in args.holds.split(",")]
    rows: Dict[str, List[Dict[str, Any]]] = {str(hold): [] for hold in holds}
    with tempfile.TemporaryDirectory(prefix="control_plane_hold.") as tmp:
        for run in range(args.runs):
            for hold in holds:
                out = os.path.join(tmp, f"{run}-{hold}.json")
                cmd = [sys.executable, "-m", "bench.control_plane", "--workers", str(args.workers),
                       "--versions", "after", "--until", "reset", "--exchange-hold-s", str(hold), "--output", out]
                code = subprocess.call(cmd, cwd=os.path.dirname(HERE), stdout=subprocess.DEVNULL)
                if code != 0:
                    print(f"control_plane_hold: {' '.join(cmd)} exited {code}", file=sys.stderr)
                    return 1
                with open(out) as handle:
                    row = summary(json.load(handle)["results"]["after"][str(args.workers)])
                rows[str(hold)].append(row)
                print(f"run {run + 1} hold {hold:g} s: {json.dumps(row)}", flush=True)
    ended = {hold: [row["round_formed_s"] for row in runs if row["ended"]] for hold, runs in rows.items()}
    report = {
        "command": " ".join(["python -m bench.control_plane_hold", *sys.argv[1:]]),
        "commit": commit(), "machine": machine(), "date": datetime.date.today().isoformat(),
        "workers": args.workers,
        "runs": rows,
        "summary": {hold: {"ended": len(times), "runs": len(rows[hold]),
                           "median_round_formed_s": statistics.median(times) if times else None,
                           "exchanges_answered_404": sum(row["exchanges_answered_404"] for row in rows[hold])}
                    for hold, times in ended.items()},
    }
    with open(args.output, "w") as handle:
        json.dump(report, handle, indent=1)
    print(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
