#!/usr/bin/env python3
"""A cluster of real hosts on one machine: network namespaces, a bridge, sshd in each (run as root).

    python3 tools/testcluster.py up 4     # hosts eeh0 .. eeh3 (first cleans what a crashed run left)
    python3 tools/testcluster.py status
    python3 tools/testcluster.py down     # removes everything that up made

Each host ``eehI`` is a network namespace with one interface, ``eth0``,
at ``192.0.2.(10+I)/24`` (TEST-NET-1, a documentation range), joined by a
veth pair to the bridge ``br0`` of the switch namespace ``eesw``. The
machine's own network namespace gets nothing: no bridge, no veth, no
address, no route; no namespace has a default route, so nothing in the
cluster can reach beyond it. Every host runs Debian's ``sshd`` on its
address with a host key generated here; the client key, the host keys,
``known_hosts``, an ``ssh_config`` and an ``ssh`` wrapper that uses it
(put ``bin/`` of the state directory first on PATH) live in the state
directory, so nothing of root's own ssh setup is read or written. The state
directory (:data:`STATE`, under ``/run``) is made mode 0700 and checked,
with each of its parents, to be root's and writable by no one else, since
root runs ``bin/ssh`` from it and sshd (``StrictModes yes``) trusts its
``authorized_keys``. Host
names resolve inside the namespaces through ``/etc/netns/eehI/hosts``
(``ip netns exec`` mounts it over ``/etc/hosts`` for what it starts, so
the machine's ``/etc/hosts`` is left alone). The file system is shared:
the project's venv is at the same path on every host.

Faults (:class:`Cluster`): :meth:`~Cluster.partition` drops all of a
host's traffic (nftables, in its namespace: packets vanish, nothing is
refused), :meth:`~Cluster.degrade` delays and drops its frames (``tc netem``
where the kernel has it, else ``tools/delayline.py`` between the host's
veth and the bridge), :meth:`~Cluster.kill_host` kills every process of a
host but its sshd. Only one cluster exists at a time (the names are fixed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

PREFIX = "eeh"            # host i is namespace and host name f"{PREFIX}{i}"
SWITCH = "eesw"           # the switch namespace, holding the bridge
BRIDGE = "br0"
SUBNET = "192.0.2"        # TEST-NET-1 (RFC 5737): never routed anywhere
FIRST_ADDRESS = 10
MAX_HOSTS = 16
# Root's alone: /run is root's and not world-writable (unlike /tmp, where another user could make this
# directory first and own what root later runs from its bin/); up() checks that on every start.
STATE = "/run/elastic_ext-testcluster"
NETNS_ETC = "/etc/netns"
PARTITION_TABLE = "ee_partition"
HOSTS_MARK = "# elastic_ext test cluster (tools/testcluster.py)"
DELAYLINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayline.py")
NEEDED = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables", "/usr/sbin/sshd": "openssh-server",
          "ssh": "openssh-client", "ssh-keygen": "openssh-client"}
COMMAND_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 15.0


class ClusterError(RuntimeError):
    """The cluster cannot be built, reached or cleaned."""


@dataclass(frozen=True)
class Host:
    index: int
    name: str
    address: str


def _run(*cmd: str, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result


def our_namespaces() -> List[str]:
    """The namespaces of a cluster (this one or a crashed one's), the switch last."""
    listed = _run("ip", "netns", "list").stdout.split()
    hosts = sorted(n for n in listed if n.startswith(PREFIX) and n[len(PREFIX):].isdigit())
    return hosts + ([SWITCH] if SWITCH in listed else [])


def namespace_pids(namespace: str) -> List[int]:
    result = _run("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def _kill_and_wait(pids: Sequence[int], timeout_s: float = 10.0) -> List[int]:
    """SIGKILLs ``pids``; returns those still alive after ``timeout_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
        time.sleep(0.05)
    return alive


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def leftovers(state: str = STATE) -> List[str]:
    """What a cluster left on this machine (empty once :func:`down` ran): namespaces, processes, files."""
    found = []
    for namespace in our_namespaces():
        found.append(f"namespace {namespace} (processes {namespace_pids(namespace)})")
    for name in sorted(os.listdir(NETNS_ETC)) if os.path.isdir(NETNS_ETC) else []:
        if name == SWITCH or name.startswith(PREFIX):
            found.append(f"{NETNS_ETC}/{name}")
    for line in _run("ip", "-o", "link", "show").stdout.splitlines():  # the machine's own namespace
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(tuple(f"{kind}-{PREFIX}" for kind in ("veth", "dl", "dlx"))):
            found.append(f"link {name} in the machine's namespace")
    if os.path.exists(state):
        found.append(f"state directory {state}")
    return found


def down(state: str = STATE) -> None:
    """Removes every namespace, process, file and directory a cluster made (also a crashed one's)."""
    namespaces = our_namespaces()
    stuck = _kill_and_wait([pid for ns in namespaces for pid in namespace_pids(ns)])
    if stuck:
        raise ClusterError(f"processes {stuck} in the cluster's namespaces survived SIGKILL")
    for namespace in namespaces:  # deleting a host's namespace deletes its veth pair, the switch's the bridge
        _run("ip", "netns", "delete", namespace)
    if os.path.isdir(NETNS_ETC):
        for name in os.listdir(NETNS_ETC):
            if name == SWITCH or name.startswith(PREFIX):
                shutil.rmtree(os.path.join(NETNS_ETC, name))
        if os.path.exists(os.path.join(state, "made-etc-netns")) and not os.listdir(NETNS_ETC):
            os.rmdir(NETNS_ETC)
    if os.path.exists(os.path.join(state, "made-run-sshd")) and not _sshd_running_elsewhere():
        shutil.rmtree("/run/sshd", ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)


def _sshd_running_elsewhere() -> bool:
    return any(name.isdigit() and _comm(int(name)) == "sshd" for name in os.listdir("/proc"))


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _untrusted(path: str, private: bool) -> Optional[str]:
    """Why root cannot trust directory ``path`` (None if it can); ``private``: nobody else may even enter it."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return str(exc)
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory (a symbolic link or a file)"
    if info.st_uid not in (0, os.geteuid()):
        return f"owned by uid {info.st_uid}"
    if info.st_mode & (0o077 if private else 0o022):
        return f"mode {stat.S_IMODE(info.st_mode):o} lets others {'in' if private else 'write'}"
    return None


def check_private(path: str) -> None:
    """Raises ClusterError unless ``path`` is root's alone, under parents nobody else can write."""
    path = os.path.abspath(path)
    chain, parent = [path], path
    while parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
        chain.append(parent)
    problems = [f"{p}: {why}" for p in chain if (why := _untrusted(p, private=p == path))]
    if problems:
        raise ClusterError(f"the state directory {path} is not root's alone ({'; '.join(problems)}); give the "
                           "cluster one under a directory only root can write")


def private_dir(path: str) -> None:
    """Makes ``path`` anew, mode 0700, and checks it; ClusterError if it exists (someone made it after
    :func:`down` removed it) or is not root's alone."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        raise ClusterError(f"the state directory {path} exists after down removed it: someone else made it; "
                           "remove it and look who did") from None
    check_private(path)


class Cluster:
    """``size`` hosts ``eeh0`` .. (see the module docstring); :meth:`up` builds them, :meth:`down` removes them."""

    def __init__(self, size: int, state: str = STATE) -> None:
        if not 1 <= size <= MAX_HOSTS:
            raise ClusterError(f"size ({size}) must be from 1 to {MAX_HOSTS}")
        self.state = state
        self.hosts = [Host(i, f"{PREFIX}{i}", f"{SUBNET}.{FIRST_ADDRESS + i}") for i in range(size)]
        self.bin = os.path.join(state, "bin")  # its ssh uses the cluster's keys and config
        self._delaylines: Dict[str, subprocess.Popen] = {}

    @classmethod
    def attach(cls, state: str = STATE) -> "Cluster":
        """The cluster that ``up`` (in this or another process) built."""
        check_private(state)
        try:
            with open(os.path.join(state, "cluster.json")) as handle:
                return cls(json.load(handle)["size"], state)
        except (OSError, ValueError, KeyError) as exc:
            raise ClusterError(f"no test cluster is up (reading {state}/cluster.json: {exc})") from None

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise ClusterError(f"no host {name!r} in the cluster; its hosts are {[h.name for h in self.hosts]}")

    # -- building ---------------------------------------------------------------
    def up(self) -> "Cluster":
        missing = sorted({pkg for tool, pkg in NEEDED.items() if shutil.which(tool) is None})
        if missing:
            raise ClusterError(f"missing Debian packages {missing}: run tools/setup.sh (as root)")
        if os.geteuid() != 0:
            raise ClusterError("the test cluster needs root (network namespaces, nftables, sshd)")
        down(self.state)
        private_dir(self.state)
        os.mkdir(self.bin, 0o700)
        if not os.path.isdir(NETNS_ETC):
            os.makedirs(NETNS_ETC)
            open(os.path.join(self.state, "made-etc-netns"), "w").close()
        if not os.path.isdir("/run/sshd"):  # sshd's privilege separation directory
            os.makedirs("/run/sshd", mode=0o755)
            open(os.path.join(self.state, "made-run-sshd"), "w").close()
        _run("ip", "netns", "add", SWITCH)
        _run("ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", SWITCH, "link", "set", BRIDGE, "up")
        self._keygen(os.path.join(self.state, "client_key"))
        os.replace(os.path.join(self.state, "client_key.pub"), os.path.join(self.state, "authorized_keys"))
        known = []
        for host in self.hosts:
            self._add_host(host)
            with open(os.path.join(self.state, host.name, "host_key.pub")) as handle:
                known.append(f"{host.name},{host.address} {' '.join(handle.read().split()[:2])}")
        self._write(os.path.join(self.state, "known_hosts"), "\n".join(known) + "\n")
        self._write_ssh_client()
        for host in self.hosts:
            self._wait_for_sshd(host)
        self._write(os.path.join(self.state, "cluster.json"), json.dumps({"size": len(self.hosts)}))
        return self

    def down(self) -> None:
        down(self.state)

    def _add_host(self, host: Host) -> None:
        ns, port = host.name, f"veth-{host.name}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", SWITCH)
        _run("ip", "-n", SWITCH, "link", "set", port, "master", BRIDGE)
        _run("ip", "-n", SWITCH, "link", "set", port, "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        etc = os.path.join(NETNS_ETC, ns)
        os.makedirs(etc)
        # The hosts share the machine's host name (one UTS namespace); on each host it resolves to that
        # host's own address, as a real host's name does: Horovod 0.28.1 builds its process sets' Gloo
        # contexts on that address, not on --network-interfaces.
        me = socket.gethostname()
        with open("/etc/hosts") as handle:
            machine = [line for line in handle.read().splitlines() if me not in line.split("#")[0].split()[1:]]
        names = "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        self._write(os.path.join(etc, "hosts"),
                    "\n".join(machine) + f"\n{HOSTS_MARK}\n{names}{host.address} {me}\n")
        home = os.path.join(self.state, ns)
        os.makedirs(home)
        self._keygen(os.path.join(home, "host_key"))
        config = os.path.join(home, "sshd_config")
        self._write(config, "\n".join([
            f"ListenAddress {host.address}:22", f"HostKey {home}/host_key", f"PidFile {home}/sshd.pid",
            f"AuthorizedKeysFile {self.state}/authorized_keys", "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes yes",
            "PrintMotd no", "MaxStartups 100", "MaxSessions 100", "ClientAliveInterval 5",
            "ClientAliveCountMax 3", "LogLevel ERROR", ""]))
        _run("ip", "netns", "exec", ns, "/usr/sbin/sshd", "-f", config, "-E", f"{home}/sshd.log")

    def _wait_for_sshd(self, host: Host) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            result = _run(*self.netns(self.hosts[0], os.path.join(self.bin, "ssh"), host.name, "true"),
                          check=False)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"sshd of {host.name} does not accept the cluster's key after "
                                   f"{READY_TIMEOUT_S:.0f}s: {result.stderr.strip()}")
            time.sleep(0.1)

    def _write_ssh_client(self) -> None:
        config = os.path.join(self.state, "ssh_config")
        self._write(config, "\n".join([
            f"Host {PREFIX}*", "  User root", f"  IdentityFile {self.state}/client_key", "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {self.state}/known_hosts", "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes", "  BatchMode yes", "  LogLevel ERROR", "  ConnectTimeout 10", ""]))
        wrapper = os.path.join(self.bin, "ssh")
        self._write(wrapper, f'#!/bin/sh\nexec /usr/bin/ssh -F {config} "$@"\n')
        os.chmod(wrapper, 0o755)

    @staticmethod
    def _keygen(path: str) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "elastic_ext-testcluster", "-f", path)

    @staticmethod
    def _write(path: str, text: str) -> None:
        with open(path, "w") as handle:
            handle.write(text)

    # -- running things on hosts --------------------------------------------------
    def netns(self, host: Host, *cmd: str) -> List[str]:
        """``cmd`` as run on ``host`` (in its namespace, with its /etc/hosts)."""
        return ["ip", "netns", "exec", host.name, *cmd]

    def run(self, host: Host, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*self.netns(host, *cmd), check=check)

    def sshd_pid(self, host: Host) -> Optional[int]:
        try:
            with open(os.path.join(self.state, host.name, "sshd.pid")) as handle:
                return int(handle.read().strip())
        except (OSError, ValueError):
            return None

    def processes(self, host: Host) -> List[int]:
        """Every process on ``host`` but its sshd listener (ssh sessions, the job's workers)."""
        return [pid for pid in namespace_pids(host.name) if pid != self.sshd_pid(host)]

    # -- faults ---------------------------------------------------------------------
    def kill_host(self, host: Host) -> List[int]:
        """SIGKILLs every process of ``host`` but its sshd listener, as a crash would; returns their PIDs."""
        pids = self.processes(host)
        stuck = _kill_and_wait(pids)
        if stuck:
            raise ClusterError(f"processes {stuck} of {host.name} survived SIGKILL")
        return pids

    def partition(self, host: Host) -> None:
        """From now on every packet to or from ``host`` on its link vanishes (both ways, nothing refused)."""
        rules = (f"table inet {PARTITION_TABLE} {{\n"
                 '  chain input { type filter hook input priority 0; policy accept; iifname "eth0" drop; }\n'
                 '  chain output { type filter hook output priority 0; policy accept; oifname "eth0" drop; }\n'
                 "}\n")
        subprocess.run(self.netns(host, "nft", "-f", "-"), input=rules, text=True, check=True,
                       capture_output=True, timeout=COMMAND_TIMEOUT_S)

    def heal(self, host: Host) -> None:
        self.run(host, "nft", "delete", "table", "inet", PARTITION_TABLE)

    def clear_faults(self) -> None:
        """Heals every partition and restores every degraded link (after a test that failed halfway)."""
        for host in self.hosts:
            if self.run(host, "nft", "list", "table", "inet", PARTITION_TABLE, check=False).returncode == 0:
                self.heal(host)
            if host.name in self._delaylines or "netem" in self.run(host, "tc", "qdisc", "show", "dev", "eth0").stdout:
                self.restore(host)

    def degrade(self, host: Host, delay_ms: float, loss_percent: float) -> str:
        """Delays every frame to and from ``host`` by ``delay_ms`` and drops ``loss_percent`` % of them, each
        way. Returns the mechanism: ``"netem"`` or, on a kernel without it, ``"delayline"``."""
        netem = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_percent}%"]
        first = self.run(host, "tc", "qdisc", "add", "dev", "eth0", "root", *netem, check=False)
        if first.returncode == 0:
            _run("ip", "netns", "exec", SWITCH, "tc", "qdisc", "add", "dev", f"veth-{host.name}", "root", *netem)
            return "netem"
        if "unknown" not in first.stderr.lower():
            raise ClusterError(f"tc netem on {host.name} failed: {first.stderr.strip()}")
        port, near, far = f"veth-{host.name}", f"dl-{host.name}", f"dlx-{host.name}"
        _run("ip", "-n", SWITCH, "link", "set", port, "nomaster")
        _run("ip", "-n", SWITCH, "link", "add", near, "type", "veth", "peer", "name", far)
        _run("ip", "-n", SWITCH, "link", "set", near, "master", BRIDGE)
        for name in (near, far):
            _run("ip", "-n", SWITCH, "link", "set", name, "up")
        proc = subprocess.Popen(["ip", "netns", "exec", SWITCH, sys.executable, DELAYLINE, port, far,
                                 str(delay_ms), str(loss_percent)], stdout=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            raise ClusterError(f"tools/delayline.py for {host.name} did not start (exit {proc.wait()})")
        self._delaylines[host.name] = proc
        return "delayline"

    def restore(self, host: Host) -> None:
        """Undoes :meth:`degrade`."""
        proc = self._delaylines.pop(host.name, None)
        if proc is None:
            self.run(host, "tc", "qdisc", "del", "dev", "eth0", "root")
            _run("ip", "netns", "exec", SWITCH, "tc", "qdisc", "del", "dev", f"veth-{host.name}", "root")
            return
        proc.kill()
        proc.wait()
        _run("ip", "-n", SWITCH, "link", "delete", f"dl-{host.name}")
        _run("ip", "-n", SWITCH, "link", "set", f"veth-{host.name}", "master", BRIDGE)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up_parser = sub.add_parser("up", help="build N hosts (after cleaning what a crashed run left)")
    up_parser.add_argument("size", type=int)
    sub.add_parser("down", help="remove everything up made")
    sub.add_parser("status", help="list what exists now")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            cluster = Cluster(args.size).up()
            for host in cluster.hosts:
                print(f"{host.name} {host.address}")
            print(f"ssh: PATH={cluster.bin}:$PATH ip netns exec {cluster.hosts[0].name} ssh {cluster.hosts[-1].name}")
        elif args.command == "down":
            down()
        else:
            print("\n".join(leftovers()) or "nothing")
    except ClusterError as exc:
        print(f"testcluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
