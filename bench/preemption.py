"""Preemption notice -> worker gone, and the training lost, per cloud and for Slurm, under real jobs.

Run from the repository root, as root (the Slurm part starts a throw-away
Slurm cluster, as ``tests/discovery`` does): ``.venv/bin/python -m bench.preemption``.

The jobs are :mod:`devkit.notice_job`'s: one ``elastic-horovodrun``
job of four workers that gets an AWS, a GCP and an Azure notice in turn
(from a local server answering as each cloud documents its endpoint), and
one ``sbatch`` job signalled with ``scancel --batch --signal=USR1``. For each
notice: when it was announced, first answered to a worker (detection), and
when the host's last worker process was gone; the training lost is the
steps trained and not kept (rolled back, or trained after the newest
durable checkpoint when the last workers leave).

Writes ``bench/results/preemption.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from bench import harness
from elastic_ext.checkpoint import CheckpointStore
from devkit import ledger
from devkit.notice_job import run_cloud_notices, run_slurm_notice, steps


def lost_steps(out: str) -> Dict[str, Any]:
    """Steps thrown away by rollbacks, and steps trained after the newest durable checkpoint."""
    records = ledger.read(out)
    trained = max(r["step"] for r in steps(out)) + 1
    newest = CheckpointStore(os.path.join(out, "ckpt")).load_newest()
    kept = newest.entries["step"].meta if newest is not None else 0
    return {"rolled_back": ledger.audit(records, 1797, 0)["lost_steps"], "after_last_durable": trained - kept,
            "trained": trained}


def row(phase: Any, lost: Dict[str, Any]) -> Dict[str, Any]:
    answered = None if phase.served is None else phase.served - phase.announced
    return {"source": phase.source, "host": phase.host, "workers": len(phase.pids),
            "answered_s": answered, "gone_s": phase.gone - phase.announced,
            "answered_to_gone_s": None if phase.served is None else phase.gone - phase.served, **lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-slurm", action="store_true", help="only the clouds' job")
    parser.add_argument("--name", default="preemption", help="result file stem under bench/results")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="elastic_ext_bench_preemption_")
    rows: List[Dict[str, Any]] = []
    try:
        out = os.path.join(root, "clouds")
        phases, code, _ = run_cloud_notices(out)
        lost = lost_steps(out)
        rows.extend(row(phase, lost) for phase in phases)
        if not args.skip_slurm:
            sys.path.insert(0, os.path.join(harness.REPO_ROOT, "tests", "discovery"))
            from slurm_cluster import SlurmCluster

            cluster = SlurmCluster(Path(root) / "slurm").start()
            try:
                out = os.path.join(root, "slurm")
                phase, _ = run_slurm_notice(out, {"SLURM_CONF": cluster.env["SLURM_CONF"]})
                rows.append(row(phase, lost_steps(out)))
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"benchmark": "preemption", "what": __doc__.split("\n")[0], "rows": rows,
              "machine": dict(harness.machine(), load_average_at_end=list(os.getloadavg()))}
    path = harness.write_json(args.name, result)
    print(harness.table(["source", "host", "workers", "answered s", "gone s", "answered->gone s",
                         "steps rolled back", "steps after last durable"],
                        [[r["source"], r["host"], r["workers"], r["answered_s"], r["gone_s"], r["answered_to_gone_s"],
                          r["rolled_back"], r["after_last_durable"]] for r in rows]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
