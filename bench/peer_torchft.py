"""torchft (0.2.0) as a peer of the benchmarks: its jobs, and which of its steps count.

Launch (:func:`launch`), the way torchft's ``torchx.py`` component and its
slurm example set a job up: a Lighthouse (``torchft_lighthouse --min_replicas 1
--quorum_tick_ms 100 --join_timeout_ms 10000``, its other settings at their
defaults, among them ``--heartbeat_timeout_ms 5000``) on localhost, and per
replica group one ``torchrun --nnodes 1 --nproc-per-node 1 --max-restarts N``
(whose agent holds the group's TCPStore and starts a killed worker again)
with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` in
the environment, running bench/workers/compare_torchft.py under the Python
of ``.venv-bench`` (made by ``bash tools/setup_bench.sh``).

Commit (:func:`history`): torchft decides per step and per replica group
(``should_commit``); a group's batch is in the committed history when its
gradients went into a committed step: it took part (not healing) and its
outcome record says committed, or, for a worker killed before writing its
outcome, another group committed the same step of the same quorum (the
allreduce completed, so its gradients were in it).
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

from bench import harness
from devkit import launch

BENCH_VENV = os.path.join(harness.REPO_ROOT, ".venv-bench")
GROUPS = 4
LIGHTHOUSE_OPTIONS = ("--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000")


def bench_bin(name: str) -> str:
    """An executable of .venv-bench.

    Raises:
        SystemExit: .venv-bench is not set up (it names the command that sets it up).
    """
    path = os.path.join(BENCH_VENV, "bin", name)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path} is missing: the torchft systems need `bash tools/setup_bench.sh` "
                         "(after tools/setup.sh) to make .venv-bench")
    return path


class Service(launch.Job):
    """torchft's Lighthouse: a server the workers use, which never ends by itself; waiting for it stops it.

    It comes last in :func:`launch_jobs`'s list, so ``harness.Watch.stop``
    has waited for every replica group before it is stopped.
    """

    def wait(self, timeout_s: float) -> Tuple[int, str]:
        self.kill()
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return 0, handle.read()


def launch_jobs(log_dir: str, worker_args: Sequence[str], max_restarts: int, ddp: bool = False,
                groups: int = GROUPS, script: str = "compare_torchft.py",
                lighthouse_options: Sequence[str] = ()) -> List[launch.Job]:
    """One torchrun agent per replica group running ``script`` (of bench/workers/) with ``worker_args``,
    then the Lighthouse (started first, listed last: see :class:`Service`) with ``LIGHTHOUSE_OPTIONS`` and
    ``lighthouse_options``."""
    python, lighthouse = bench_bin("python"), bench_bin("torchft_lighthouse")
    port = harness.free_port()
    env = launch.base_env(GLOO_SOCKET_IFNAME="lo")
    server = Service([lighthouse, *LIGHTHOUSE_OPTIONS, *lighthouse_options, "--bind", f"[::]:{port}"], env,
                     os.path.join(log_dir, "lighthouse.log"))
    jobs: List[launch.Job] = []
    script = os.path.join(harness.WORKERS, script)
    for group in range(groups):
        group_env = dict(env, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(groups),
                         TORCHFT_LIGHTHOUSE=f"http://localhost:{port}")
        cmd = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
               "--max-restarts", str(max_restarts), "--master-port", str(harness.free_port()),
               script, *worker_args, *(["--ddp"] if ddp else [])]
        jobs.append(launch.Job(cmd, group_env, os.path.join(log_dir, f"torchft-group{group}.log")))
    return jobs + [server]


def history(records: List[dict]) -> List[dict]:
    """The step records (ledger format) whose samples went into a committed step (see the module docstring).

    ``records`` in ``ledger.read``'s order: each process's records in the
    order written, so a step record is followed by its outcome record
    unless the process died in that step.
    """
    committed_steps = {(r["g"], r["outcome"]) for r in records if "outcome" in r and r["committed"]}
    kept: List[dict] = []
    pending: Dict[int, Optional[dict]] = {}

    def settle_unanswered(rank: int) -> None:
        step = pending.pop(rank, None)
        if step is not None and step["part"] and (step["gen"], step["step"]) in committed_steps:
            kept.append(step)

    for record in records:
        if "gen" in record and "part" in record:
            settle_unanswered(record["rank"])  # the previous step of this rank's process never got an outcome
            pending[record["rank"]] = record
        elif "outcome" in record:
            step = pending.get(record["rank"])
            if step is not None and (step["gen"], step["step"]) == (record["g"], record["outcome"]):
                pending[record["rank"]] = None
                if record["committed"] and step["part"]:
                    kept.append(step)
    for rank in list(pending):
        settle_unanswered(rank)
    return kept


def complete_epochs(history_records: List[dict]) -> int:
    """Epochs every replica group has finished: each group walks its own shard at its own pace."""
    last: Dict[int, int] = {}
    for record in history_records:
        last[record["rank"]] = max(last.get(record["rank"], 0), record["epoch"])
    return min(last.values()) if len(last) == GROUPS else 0


def discarded_steps(records: List[dict]) -> Tuple[int, int]:
    """(steps some group discarded, per-group batches discarded): should_commit said no, or the group healed."""
    outcomes = [r for r in records if "outcome" in r]
    steps = {(r["g"], r["outcome"]) for r in outcomes if not r["committed"]}
    batches = sum(1 for r in outcomes if not r["committed"] or not r["part"])
    return len(steps), batches
