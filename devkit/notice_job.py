"""Scripted preemption notices against real ``elastic-horovodrun`` jobs, for the tests and ``bench.preemption``.

:func:`run_cloud_notices`: one job of four workers on three pseudo-hosts
(``localhost:2``, ``127.0.0.1:1`` and :func:`~devkit.launch.third_host`
``:1``); every worker watches AWS, GCP and Azure at one
:class:`~devkit.metadata_server.MetadataServer`, where each
pseudo-host is a machine of its own. One notice per cloud, in turn
(:data:`CLOUD_PLAN`): the third host's spot instance-action, 127.0.0.1's
preemption, then an Azure ``Preempt`` of localhost, which holds ranks 0 and
1: the last workers leave and the job ends.

:func:`run_slurm_notice`: the same worker under ``sbatch``, the batch script
``exec``-ing ``elastic-horovodrun`` (as ``--signal=B:USR1@...`` needs);
``scancel --batch --signal=USR1`` delivers the signal the way Slurm's
``--signal`` does before the time limit, at a moment the test chooses.

Each returns a :class:`Phase` per notice (when it was announced, first
answered to a worker, and when that host's last worker process was gone)
and the job's directory, for the callers to assert on or to report.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import psutil

from devkit import ledger
from devkit.launch import (REPO, STATIC, WORKERS, Job, base_env, command_line, elastic_cmd,
                                        third_host, under_elastic_ext_driver, write_hosts)
from devkit.metadata_server import ENV, MetadataServer

WORKER = "train_torch.py"
COMMIT_EVERY = 4
STEP_SLEEP_S = "0.05"
EPOCHS = 60        # far more than the phases need: the last notice ends the job
STEPS_BETWEEN = 12  # steps trained at each size before the next notice
CLOUD_PLAN = (("aws", "third"), ("gcp", "127.0.0.1"), ("azure", "localhost"))


@dataclasses.dataclass
class Phase:
    """One notice: to which host, from which source, and when (Unix seconds) it was announced, first
    answered to a worker (None for a signal), and the host's last worker process was gone."""

    source: str
    host: str
    pids: List[int]
    announced: float
    served: Optional[float] = None
    gone: Optional[float] = None


def steps(out: str) -> List[dict]:
    return sorted((r for r in ledger.read(out) if "gen" in r), key=lambda r: r["t"])


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float, job: Optional[Job] = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if job is not None:
            job.track()
            if job.proc.poll() is not None:
                raise AssertionError(f"the job ended while waiting for {what}:\n"
                                     f"{open(job.log_path).read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def worker_pids(job: Job, host: str) -> List[int]:
    """The processes of ``job`` that run the worker script on pseudo-host ``host`` (keepers included)."""
    job.track()
    found = []
    for pid in sorted(job.descendants):
        try:
            proc = psutil.Process(pid)
            if any(WORKER in part for part in proc.cmdline()) and proc.environ().get("HOROVOD_HOSTNAME") == host:
                found.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(pids: Sequence[int], what: str, timeout_s: float) -> float:
    """When the last of ``pids`` ended (polled every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while any(_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: processes {list(pids)} still there after {timeout_s}s")
        time.sleep(0.01)
    return time.time()


def _running(pid: int) -> bool:
    """True while ``pid`` runs (neither gone nor a zombie; it may end while it is looked at)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def training_at(out: str, size: int, after: int) -> Callable[[], bool]:
    """True once ``STEPS_BETWEEN`` steps past step ``after`` were trained at world size ``size``."""
    def ready() -> bool:
        records = [r for r in steps(out) if r["size"] == size and r["step"] >= after]
        return len({r["step"] for r in records}) >= STEPS_BETWEEN
    return ready


def cloud_hosts() -> List[str]:
    return ["localhost:2", "127.0.0.1:1", f"{third_host()}:1"]


def run_cloud_notices(out: str, timeout_s: float = 300.0) -> Tuple[List[Phase], int, str]:
    """The clouds' job (see the module docstring); returns its phases, exit code and output."""
    os.makedirs(out, exist_ok=True)
    hosts_file = os.path.join(out, "hosts")
    write_hosts(hosts_file, cloud_hosts())
    plan = [(cloud, third_host() if host == "third" else host) for cloud, host in CLOUD_PLAN]
    slots = {host: int(count) for host, count in (entry.split(":") for entry in cloud_hosts())}
    phases: List[Phase] = []
    with MetadataServer() as server:
        env = base_env(ELASTIC_EXT_EVENTS_PATH=os.path.join(out, "events.jsonl"),
                       ELASTIC_EXT_CHECKPOINT_DIR=os.path.join(out, "ckpt"), **{ENV: server.env_value()})
        cmd = under_elastic_ext_driver(elastic_cmd(4, 1, 4, hosts_file, WORKER, "--out", out, "--epochs", str(EPOCHS),
                                                   "--commit-every", str(COMMIT_EVERY), "--step-sleep-s", STEP_SLEEP_S))
        job = Job(cmd, env, os.path.join(out, "horovodrun.log"))
        try:
            size, after = 4, 0
            for cloud, host in plan:
                wait_for(training_at(out, size, after), f"{STEPS_BETWEEN} steps at size {size}", 120, job)
                pids = worker_pids(job, host)
                phase = Phase(cloud, host, pids, time.time())
                server.announce(host, cloud)
                phase.served = server.wait_served(host, cloud, 30)
                phase.gone = wait_gone(pids, f"the workers of {host} after a {cloud} notice", 60)
                phases.append(phase)
                size -= slots[host]
                after = max((r["step"] for r in steps(out)), default=0)
        finally:
            code, output = job.wait(timeout_s)
    return phases, code, output


def batch_script(out: str, hosts_file: str) -> str:
    """The ``sbatch`` script: the launcher ``exec``-ed, so that ``--signal=B:`` (the batch shell) reaches it."""
    worker = os.path.join(WORKERS, WORKER)
    return (f"#!/bin/bash\nexec {sys.executable} -m elastic_ext.launch.horovodrun -np 2 --min-np 1 --max-np 2 "
            f"--host-discovery-script '{STATIC} {hosts_file}' --network-interfaces lo {sys.executable} {worker} "
            f"--out {out} --epochs {EPOCHS} --commit-every {COMMIT_EVERY} --step-sleep-s {STEP_SLEEP_S}\n")


def run_slurm_notice(out: str, slurm_env: Dict[str, str], timeout_s: float = 240.0) -> Tuple[Phase, str]:
    """The Slurm job (see the module docstring); returns its phase and the job's output."""
    os.makedirs(out, exist_ok=True)
    hosts_file = os.path.join(out, "hosts")
    write_hosts(hosts_file, ["localhost:2"])
    script = os.path.join(out, "job.sh")
    with open(script, "w") as handle:
        handle.write(batch_script(out, hosts_file))
    env = base_env(ELASTIC_EXT_EVENTS_PATH=os.path.join(out, "events.jsonl"),
                   ELASTIC_EXT_CHECKPOINT_DIR=os.path.join(out, "ckpt"), **slurm_env, **{ENV: "off"})
    log = os.path.join(out, "slurm.log")

    def slurm(*args: str) -> str:
        return subprocess.run(args, env=env, check=True, capture_output=True, text=True, timeout=30).stdout.strip()

    job_id = slurm("sbatch", "--parsable", "-N1", "-n1", f"--chdir={REPO}", f"--output={log}", "--export=ALL", script)
    try:
        wait_for(training_at(out, 2, 0), f"{STEPS_BETWEEN} steps of Slurm job {job_id}", 120)
        pids = [p.pid for p in psutil.Process(_batch_pid(job_id)).children(recursive=True)
                if any(WORKER in part for part in command_line(p))]
        phase = Phase("slurm", "localhost", pids, time.time())
        slurm("scancel", "--batch", "--signal=USR1", job_id)
        phase.gone = wait_gone(pids, f"the workers of Slurm job {job_id} after SIGUSR1", 60)
        wait_for(lambda: not slurm("squeue", "-h", "-j", job_id), f"Slurm job {job_id} to end", 60)
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=30)
    return phase, open(log).read() if os.path.exists(log) else ""


def _batch_pid(job_id: str) -> int:
    """The PID of the batch script's process (the ``exec``-ed launcher): on this machine, by its job id."""
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            environ, cmdline = proc.info["environ"] or {}, proc.info["cmdline"] or []
            if environ.get("SLURM_JOB_ID") == job_id and "elastic_ext.launch.horovodrun" in cmdline:
                return proc.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no launcher process of Slurm job {job_id} on this machine")


__all__ = ["Phase", "CLOUD_PLAN", "COMMIT_EVERY", "run_cloud_notices", "run_slurm_notice", "steps", "worker_pids"]
