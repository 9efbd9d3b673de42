"""host_discovery/slurm.py against a real slurmctld + slurmd cluster (see slurm_cluster.py).

node01 and node02 run slurmd; node03 and node04 have no daemon, so Slurm
reports them DOWN. Tests that drain a node resume it before they end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ext.discovery import (Deadline, DiscoveryInputError, DiscoveryTimeoutError,
                                   DiscoveryUnavailableError)
from elastic_ext.discovery import slurm
from elastic_ext.discovery.cli import EXIT_INPUT, EXIT_OK, EXIT_TIMEOUT, EXIT_UNAVAILABLE

# "signal" raises in the test, so fixture teardown still stops the daemons.
pytestmark = pytest.mark.timeout(90, method="signal")

RESUME_TIMEOUT_S = 25.0
SLURM_SCRIPT = Path(__file__).resolve().parents[2] / "host_discovery" / "slurm.py"


def run_in_cluster(cluster, argv):
    """Run a Slurm client command (salloc ...) against the test cluster."""
    env = dict(cluster.env)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def job_env(cluster, nodelist="node[01-04]", tasks="2(x2),4(x2)"):
    """The variables Slurm sets in an allocation (format as seen from salloc)."""
    return dict(cluster.env, SLURM_JOB_NODELIST=nodelist, SLURM_TASKS_PER_NODE=tasks,
                SLURM_JOB_CPUS_PER_NODE="2(x2),4(x2)")


def test_inside_a_real_allocation_prints_its_nodes_and_task_slots(slurm_cluster):
    proc = run_in_cluster(slurm_cluster, ["salloc", "-N2", "-n3", "--", str(SLURM_SCRIPT)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "node01:2\nnode02:1\n"


def test_down_nodes_without_daemon_are_left_out(slurm_cluster, run_script):
    proc = run_script("slurm", "--log-level", "INFO", env=job_env(slurm_cluster))
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == "node01:2\nnode02:2\n"
    assert "node03" in proc.stderr and "DOWN" in proc.stderr


def test_drained_node_leaves_and_returns_when_slurm_says_healthy(slurm_cluster, run_script):
    env = job_env(slurm_cluster)
    slurm_cluster.drain("node02")
    try:
        slurm_cluster.wait_state("node02", "drained")
        proc = run_script("slurm", env=env)
        assert (proc.returncode, proc.stdout) == (EXIT_OK, "node01:2\n"), proc.stderr
    finally:
        slurm_cluster.resume("node02")
    # After RESUME Slurm shows idle* (not responding) until slurmd registers again;
    # the node must come back exactly when Slurm calls it healthy, not before.
    end = time.monotonic() + RESUME_TIMEOUT_S
    while True:
        state_before = slurm_cluster.state("node02")
        out = run_script("slurm", env=env).stdout
        state_after = slurm_cluster.state("node02")
        if state_before == state_after:
            assert ("node02:2" in out) == (state_before == "idle"), (state_before, out)
        if state_before == state_after == "idle":
            break
        assert time.monotonic() < end, f"node02 still {state_after!r}"
        time.sleep(0.3)
    assert out == "node01:2\nnode02:2\n"


def test_node_drained_while_a_job_runs_on_it_is_left_out(slurm_cluster):
    """DRAINING (ALLOCATED+DRAIN) inside a real allocation."""
    script = (f"scontrol update NodeName=node02 State=DRAIN Reason=discovery-test && "
              f"sinfo -h -N -n node02 -o %T >&2; {SLURM_SCRIPT}; rc=$?; "
              f"scontrol update NodeName=node02 State=RESUME; exit $rc")
    try:
        proc = run_in_cluster(slurm_cluster, ["salloc", "-N2", "-n4", "--", "bash", "-c", script])
    finally:
        if "drain" in slurm_cluster.state("node02"):
            slurm_cluster.resume("node02")
    assert proc.returncode == 0, proc.stderr
    assert "draining" in proc.stderr
    assert proc.stdout == "node01:2\n"
    slurm_cluster.wait_state("node02", "idle", RESUME_TIMEOUT_S)


def test_no_healthy_node_in_the_allocation_exits_3(slurm_cluster, run_script):
    """node03/node04 have no slurmd: Slurm reports them DOWN (and NOT_RESPONDING once it has pinged)."""
    env = job_env(slurm_cluster, nodelist="node[03-04]", tasks="4(x2)")
    proc = run_script("slurm", env=env)
    assert (proc.returncode, proc.stdout) == (EXIT_UNAVAILABLE, ""), proc.stderr
    assert "no healthy node" in proc.stderr and "Horovod keeps its previous hosts" in proc.stderr
    assert "node03 DOWN" in proc.stderr and "node04 DOWN" in proc.stderr
    with pytest.raises(DiscoveryUnavailableError, match="no healthy node"):
        slurm.discover(env, Deadline(5))


def test_the_only_node_set_down_exits_3_then_returns_when_resumed(slurm_cluster, run_script):
    env = job_env(slurm_cluster, nodelist="node01", tasks="2")
    assert run_script("slurm", env=env).stdout == "node01:2\n"
    slurm_cluster.scontrol("update", "NodeName=node01", "State=DOWN", "Reason=discovery-test")
    try:
        slurm_cluster.wait_state("node01", "down")
        proc = run_script("slurm", env=env)
        assert (proc.returncode, proc.stdout) == (EXIT_UNAVAILABLE, ""), proc.stderr
        assert "node01 DOWN" in proc.stderr
        assert slurm.query_nodes(["node01"], Deadline(5), slurm_cluster.env)["node01"].states == {"DOWN"}
    finally:
        slurm_cluster.resume("node01")
    slurm_cluster.wait_state("node01", "idle", RESUME_TIMEOUT_S)
    proc = run_script("slurm", env=env)
    assert (proc.returncode, proc.stdout) == (EXIT_OK, "node01:2\n"), proc.stderr


def test_library_reports_states_and_addresses(slurm_cluster):
    nodes = slurm.query_nodes(["node01", "node03"], Deadline(5), slurm_cluster.env)
    assert nodes["node01"].unhealthy_reason() is None
    assert nodes["node01"].addr == "localhost"
    assert "DOWN" in nodes["node03"].unhealthy_reason()
    # Slurm 22.05 writes base+flags; the live words parse to exactly these.
    assert nodes["node01"].states == {"IDLE"}
    assert "DOWN" in nodes["node03"].states and nodes["node03"].states <= {"DOWN", "NOT_RESPONDING"}
    hosts = slurm.discover(job_env(slurm_cluster, "node[01-02]", "3,1"), Deadline(5),
                           address=slurm.Address.ADDR)
    # Two distinct local addresses, so horovodrun can treat them as two hosts.
    assert [(h.host, h.slots) for h in hosts] == [("localhost", 3), ("127.0.0.1", 1)]


def test_unknown_node_is_dropped_with_a_warning(slurm_cluster, run_script):
    proc = run_script("slurm", "--nodelist", "node01,ghost7", "--slots", "1",
                      env=slurm_cluster.env)
    assert (proc.returncode, proc.stdout) == (EXIT_OK, "node01:1\n"), proc.stderr
    assert "ghost7" in proc.stderr


@pytest.mark.parametrize("expr", ["node[01-02", "node[02-01]", "node[a-c]"])
def test_malformed_nodelist_exits_2(slurm_cluster, run_script, expr):
    proc = run_script("slurm", env=job_env(slurm_cluster, nodelist=expr))
    assert proc.returncode == EXIT_INPUT
    assert proc.stdout == ""
    assert repr(expr) in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_controller_is_killed_by_the_timeout(slurm_cluster, run_script, tmp_path):
    dead = tmp_path / "dead.conf"
    # A parsable config whose controller port nobody listens on: scontrol retries ~10 s.
    dead.write_text("ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
                    "NodeName=node01 NodeAddr=127.0.0.1\n")
    env = dict(job_env(slurm_cluster), SLURM_CONF=str(dead))
    proc = run_script("slurm", "--timeout-s", "1.5", env=env)
    assert proc.returncode == EXIT_TIMEOUT, proc.stderr
    assert proc.stdout == ""
    # Bounded by --timeout-s (exit 4), not by scontrol's own retries (which end in exit 3).
    assert "did not answer within" in proc.stderr
    with pytest.raises(DiscoveryTimeoutError):
        slurm.discover(env, Deadline(0.5))


def test_missing_scontrol_exits_3(slurm_cluster, run_script):
    proc = run_script("slurm", "--scontrol", "/nonexistent/scontrol", env=job_env(slurm_cluster))
    assert proc.returncode == EXIT_UNAVAILABLE
    assert proc.stdout == "" and "not found" in proc.stderr


def test_outside_an_allocation_without_nodelist_exits_2(slurm_cluster, run_script):
    env = {k: v for k, v in slurm_cluster.env.items() if not k.startswith("SLURM_JOB")}
    env.pop("SLURM_NODELIST", None)
    proc = run_script("slurm", env=env)
    assert proc.returncode == EXIT_INPUT
    assert "SLURM_JOB_NODELIST is not set" in proc.stderr
    with pytest.raises(DiscoveryInputError):
        slurm.discover(env, Deadline(1))
