"""The test cluster of tests/multihost (tools/testcluster.py): built once per session, removed at its end.

After each test every fault is cleared and every host must be empty again
(only its sshd listener left) within a bound; at the end of the session no
namespace, veth, process or file of the cluster may remain. Both are
checked here, so a test that leaves something behind fails.
"""

import atexit
import time

import psutil
import pytest

from tools.testcluster import Cluster, down, leftovers

HOSTS = 4               # eeh0 runs the driver; eeh1 .. eeh3 run workers
EMPTY_WITHIN_S = 30.0   # a job's remote workers and ssh sessions end this soon after it


@pytest.fixture(scope="session")
def cluster():
    built = Cluster(HOSTS)
    atexit.register(down)  # also when pytest is interrupted
    try:
        yield built.up()
    finally:
        down()
        left = leftovers()
        assert not left, f"the test cluster left things behind: {left}"


def describe(pids):
    found = []
    for pid in pids:
        try:
            found.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:200]}")
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(autouse=True)
def hosts_empty_after_each_test(cluster):
    yield
    cluster.clear_faults()
    deadline = time.monotonic() + EMPTY_WITHIN_S
    remaining = {}
    while time.monotonic() < deadline:
        remaining = {host.name: describe(cluster.processes(host)) for host in cluster.hosts}
        remaining = {name: procs for name, procs in remaining.items() if procs}
        if not remaining:
            return
        time.sleep(0.2)
    for host in cluster.hosts:
        cluster.kill_host(host)
    pytest.fail(f"processes left on the test hosts {EMPTY_WITHIN_S:.0f}s after the test (now killed): {remaining}")
