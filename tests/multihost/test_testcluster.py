"""The test cluster itself (tools/testcluster.py): isolated hosts, ssh between them, and a rebuild that clears
what a crashed run left."""

import os
import subprocess

from tests.multihost.conftest import HOSTS
from tools.testcluster import NETNS_ETC, PREFIX, SUBNET, Cluster, leftovers


def test_hosts_reach_each_other_over_ssh_and_nothing_beyond_their_subnet(cluster):
    for host in cluster.hosts:
        routes = cluster.run(host, "ip", "-4", "route", "show").stdout
        assert routes.split() == f"{SUBNET}.0/24 dev eth0 proto kernel scope link src {host.address}".split(), \
            f"{host.name} must route its subnet only, with no default route: {routes!r}"
    first, last = cluster.hosts[0], cluster.hosts[-1]
    ssh = cluster.run(first, os.path.join(cluster.bin, "ssh"), last.name, "hostname -i")
    assert ssh.stdout.split() == [last.address], f"ssh {last.name} from {first.name} ran elsewhere: {ssh.stdout!r}"
    unreachable = cluster.run(first, "python3", "-c", "import socket; socket.create_connection(('10.0.0.1', 22), 5)",
                              check=False)
    assert "Network is unreachable" in unreachable.stderr, unreachable.stderr[-500:]


def test_up_clears_what_a_crashed_run_left(cluster):
    """A namespace with a process in it, its /etc/netns entry and a stale state file, as a killed run leaves
    them: the next up removes them and builds the same cluster again."""
    stale = f"{PREFIX}{HOSTS + 3}"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"], start_new_session=True)
    os.makedirs(os.path.join(NETNS_ETC, stale), exist_ok=True)
    try:
        assert any(stale in item for item in leftovers())
        rebuilt = Cluster(HOSTS, cluster.state).up()
        assert sleeper.wait(timeout=15) == -9, "the crashed run's process survived the next up"
        assert not [item for item in leftovers() if stale in item], leftovers()
        assert [h.name for h in rebuilt.hosts] == [h.name for h in cluster.hosts]
        assert cluster.run(cluster.hosts[0], os.path.join(cluster.bin, "ssh"), cluster.hosts[1].name,
                           "true").returncode == 0
    finally:
        sleeper.kill()
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)
