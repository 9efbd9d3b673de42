"""A real, throw-away Slurm cluster on this machine, for discovery tests.

Starts munged (as the ``munge`` user), one slurmctld and two slurmd
(node01, node02, one port each) from the Debian packages. node03 and node04
are configured but have no daemon, so Slurm reports them down. See
docs/environment.md for why the settings are there. Everything is stopped
by PID, with SIGKILL after a bound; slurmctld and slurmd also die with the
test process (see procs.py). munged may outlive it: it is shared by every
cluster on the machine and reused by the next run.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from procs import die_with_parent, terminate

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
CLIENT_TIMEOUT_S = 10.0
LIVE_NODES = ("node01", "node02")
DEAD_NODES = ("node03", "node04")
# Two spellings of this machine: with `slurm.py --address addr` horovodrun sees
# two hosts (both local), so an elastic job can shrink to one and grow back.
NODE_ADDRS = ("localhost", "127.0.0.1")
NODE_CPUS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    """slurmctld + slurmd processes with their config under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env: Dict[str, str] = dict(os.environ, SLURM_CONF=str(self.conf))
        self._pids: List[int] = []
        self._munged_pid: Optional[int] = None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        for sub in ("state", "spool", "run", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in LIVE_NODES:
            (self.root / "spool" / node).mkdir(exist_ok=True)
        self._write_conf()
        self._start_munge()
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: "UP" in self.scontrol("ping", check=False), "slurmctld to answer ping")
        for node in LIVE_NODES:
            self._spawn(["slurmd", "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
        self._wait(lambda: all(self.state(n) == "idle" for n in LIVE_NODES), "nodes to be idle")
        return self

    def stop(self) -> None:
        pids = list(reversed(self._pids))
        # munged may serve other clusters on the machine; only stop one we started.
        if self._munged_pid is not None:
            pids.append(self._munged_pid)
        terminate(pids, STOP_TIMEOUT_S)
        self._pids.clear()
        self._munged_pid = None

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "ClusterName=disctest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root", "MailProg=/bin/true",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "SlurmdTimeout=30",
            "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        ]
        for node, addr in zip(LIVE_NODES, NODE_ADDRS):
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr={addr} "
                         f"Port={_free_port()} CPUs={NODE_CPUS} RealMemory=1000")
        for node in DEAD_NODES:
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 Port={_free_port()} "
                         "CPUs=4 RealMemory=1000 State=DOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True,
                          timeout=CLIENT_TIMEOUT_S).returncode == 0:
            return  # a munged is already serving this machine
        munge = pwd.getpwnam("munge")
        run_dir = Path("/run/munge")
        run_dir.mkdir(mode=0o755, exist_ok=True)
        os.chown(run_dir, munge.pw_uid, munge.pw_gid)
        pidfile = run_dir / "munged.pid"
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True,
                       timeout=CLIENT_TIMEOUT_S)
        self._wait(lambda: pidfile.exists() and pidfile.read_text().strip() != "",
                   "munged to write its PID")
        self._munged_pid = int(pidfile.read_text())
        self._wait(lambda: subprocess.run("munge -n | unmunge", shell=True, capture_output=True,
                                          timeout=CLIENT_TIMEOUT_S).returncode == 0, "munged")

    def _spawn(self, argv: List[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=self.env, start_new_session=True,
                                preexec_fn=die_with_parent)
        log.close()
        self._pids.append(proc.pid)
        time.sleep(0.05)
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited at once with {proc.returncode}; "
                               f"see {self.root}/log/{name}.out")

    def _wait(self, predicate, what: str) -> None:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if predicate():
                return
            time.sleep(0.1)
        logs = {p.name: p.read_text()[-2000:] for p in (self.root / "log").glob("*")}
        raise RuntimeError(f"timed out after {START_TIMEOUT_S} s waiting for {what}; logs: {logs}")

    # -- client helpers --------------------------------------------------------
    def scontrol(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True,
                              timeout=CLIENT_TIMEOUT_S)
        if check and proc.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)} failed: {proc.stderr}")
        return proc.stdout

    def state(self, node: str) -> str:
        """sinfo's long state of ``node``, e.g. ``idle``, ``drained``, ``down*``."""
        proc = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], env=self.env,
                              capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
        return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""

    def wait_state(self, node: str, state: str, timeout_s: float = 20.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.state(node) == state:
                return
            time.sleep(0.2)
        raise AssertionError(f"{node} is {self.state(node)!r}, not {state!r}, after {timeout_s} s")

    def drain(self, node: str) -> None:
        self.scontrol("update", f"NodeName={node}", "State=DRAIN", "Reason=discovery-test")

    def resume(self, node: str) -> None:
        self.scontrol("update", f"NodeName={node}", "State=RESUME")
