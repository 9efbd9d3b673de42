"""Hosts of a Slurm allocation, minus the nodes Slurm reports unhealthy.

The hosts come from ``SLURM_JOB_NODELIST`` (or ``--nodelist``); slots from
``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_CPUS_PER_NODE`` or
``SLURM_GPUS_PER_NODE`` (or ``--slots``); both are read with
:mod:`elastic_ext.discovery.slurm_hostlist` (python-hostlist).
Node health comes from one ``scontrol show node -o`` call per discovery,
bounded by the caller's :class:`~elastic_ext.discovery.deadline.Deadline`.
A node is dropped while any of its state words is in
:data:`UNHEALTHY_STATES` and comes back as soon as Slurm reports it healthy.
When no node of the allocation is healthy, :func:`discover` raises
:class:`DiscoveryUnavailableError` (exit 3) instead of returning an empty
list: Horovod then keeps its previous host set rather than dropping them all.

Functions take the environment as a mapping instead of reading
``os.environ``, so the caller decides where configuration comes from.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional

from elastic_ext.discovery.deadline import Deadline, command_failure, run_command
from elastic_ext.discovery.hosts import HostSlots, parse_slots
from elastic_ext.discovery.slurm_hostlist import (collect_nodelist, expand_nodelist, parse_gpus_per_node,
                                                  parse_per_node)
from elastic_ext.errors import DiscoveryInputError, DiscoveryUnavailableError

logger = logging.getLogger(__name__)

ENV_JOB_NODELIST = "SLURM_JOB_NODELIST"
ENV_NODELIST = "SLURM_NODELIST"  # older name, still set by Slurm
ENV_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
ENV_CPUS_PER_NODE = "SLURM_JOB_CPUS_PER_NODE"
ENV_GPUS_PER_NODE = "SLURM_GPUS_PER_NODE"

# Default bound for one scontrol call; the overall deadline may cut it shorter.
SCONTROL_TIMEOUT_S = 3.0

# How Slurm writes a node's state, by version (checked against its sources,
# src/common/slurm_protocol_defs.c and src/api/node_info.c):
# - scontrol since 21.08: ``State=BASE+FLAG+FLAG``, base one of DOWN, IDLE,
#   ALLOCATED, ERROR, MIXED, FUTURE, UNKNOWN, flags such as DRAIN,
#   NOT_RESPONDING, POWERED_DOWN, POWERING_UP, MAINTENANCE, CLOUD.
# - scontrol before 21.08: ``State=`` sinfo's long word, which carries a
#   one-character suffix for a flag (``IDLE*``, ``DOWN~``, ``MIXED#``...),
#   then ``+CLOUD``, ``+COMPLETING``, ``+DRAIN``, ``+FAIL`` and ``+POWER``
#   (power saving: the node is powered down); some versions also wrote
#   compound words such as DRAINED, DRAINING, FAILING, MAINT, REBOOT, INVAL.
# Both are parsed: each suffix becomes the flag it stands for.
STATE_SUFFIXES: Dict[str, str] = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "%": "POWERING_DOWN",
    "!": "POWER_DOWN",        # power down pending
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "-": "PLANNED",
}

# State words that mean "do not start workers here": the node is down,
# draining, failing, not responding, powered down or changing power state,
# rebooting now, in a maintenance reservation, or not a real node yet.
UNHEALTHY_STATES: FrozenSet[str] = frozenset({
    "DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING",
    "NO_RESPOND", "POWER", "POWERED_DOWN", "POWER_DOWN", "POWERING_DOWN", "POWERING_UP",
    "POWER_UP", "REBOOT_ISSUED", "REBOOT", "MAINTENANCE", "MAINT", "FUTURE", "UNKNOWN",
    "INVAL", "INVALID", "INVALID_REG", "ERROR", "END",
})
# Base states a node can run our workers in; a node without one is unhealthy.
# (RESERVED and PLANNED are what older Slurm writes for IDLE in a reservation /
# planned for a pending job.) Flags outside both sets (CLOUD, DYNAMIC_NORM,
# REBOOT_REQUESTED: a reboot once the node's jobs end...) do not change health.
HEALTHY_BASE_STATES: FrozenSet[str] = frozenset({
    "IDLE", "MIXED", "ALLOCATED", "ALLOC", "MIX", "COMPLETING", "RESERVED", "PLANNED",
})


def parse_state_words(text: str) -> FrozenSet[str]:
    """The words of a ``State=`` value, upper case, suffix characters turned into flags.

    ``IDLE*+POWER`` -> ``{IDLE, NOT_RESPONDING, POWER}``; ``MIXED+DRAIN`` ->
    ``{MIXED, DRAIN}``. A word that is only suffix characters is dropped.
    """
    words = set()
    for word in text.upper().split("+"):
        while word and word[-1] in STATE_SUFFIXES:
            words.add(STATE_SUFFIXES[word[-1]])
            word = word[:-1]
        if word:
            words.add(word)
    return frozenset(words)


class SlotSource(str, enum.Enum):
    """Where per-node slot counts come from when ``--slots`` is not given."""

    TASKS = "tasks"  # SLURM_TASKS_PER_NODE
    CPUS = "cpus"    # SLURM_JOB_CPUS_PER_NODE
    GPUS = "gpus"    # SLURM_GPUS_PER_NODE, the same for every node


@dataclass(frozen=True)
class NodeStatus:
    """What ``scontrol show node`` says about one node."""

    name: str
    states: FrozenSet[str]
    addr: Optional[str] = None
    hostname: Optional[str] = None

    def unhealthy_reason(self) -> Optional[str]:
        """Why workers must not run here, or None if the node is healthy."""
        bad = sorted(self.states & UNHEALTHY_STATES)
        if bad:
            return "+".join(bad)
        if not self.states & HEALTHY_BASE_STATES:
            return "no usable base state in " + "+".join(sorted(self.states))
        return None


class Address(str, enum.Enum):
    """Which name of a node to print for Horovod (and ssh)."""

    NAME = "name"          # NodeName, the name in the nodelist
    ADDR = "addr"          # NodeAddr
    HOSTNAME = "hostname"  # NodeHostName


def allocation_hosts(environ: Mapping[str, str], nodelist: Optional[str] = None,
                     slots: Optional[int] = None,
                     slots_from: SlotSource = SlotSource.TASKS) -> List[HostSlots]:
    """The allocation's nodes and their slots, before any health check.

    Args:
        environ: the job environment (``os.environ`` in the scripts).
        nodelist: overrides ``SLURM_JOB_NODELIST``.
        slots: the same slot count for every node; overrides ``slots_from``.
        slots_from: which Slurm variable gives per-node slots.

    Raises:
        DiscoveryInputError: no nodelist, or a malformed nodelist or count.
    """
    expr = nodelist if nodelist is not None else environ.get(ENV_JOB_NODELIST,
                                                             environ.get(ENV_NODELIST))
    if expr is None:
        raise DiscoveryInputError(
            f"{ENV_JOB_NODELIST} is not set: run inside a Slurm allocation or pass --nodelist")
    names = expand_nodelist(expr)
    if slots is not None:
        counts = [parse_slots(slots, "--slots")] * len(names)
    elif slots_from is SlotSource.GPUS:
        raw = _require(environ, ENV_GPUS_PER_NODE, "gpus")
        counts = [parse_gpus_per_node(raw, ENV_GPUS_PER_NODE)] * len(names)
    else:
        var = ENV_TASKS_PER_NODE if slots_from is SlotSource.TASKS else ENV_CPUS_PER_NODE
        counts = parse_per_node(_require(environ, var, slots_from.value), len(names), var)
    return [HostSlots(name, count) for name, count in zip(names, counts)]


def _require(environ: Mapping[str, str], var: str, what: str) -> str:
    value = environ.get(var)
    if value is None:
        raise DiscoveryInputError(
            f"{var} is not set, so slots cannot come from {what}: pass --slots N")
    return value


_FIELD_RE = {key: re.compile(r"(?:^|\s)" + key + r"=(\S*)")
             for key in ("NodeName", "State", "NodeAddr", "NodeHostName")}


def parse_scontrol_nodes(output: str) -> Dict[str, NodeStatus]:
    """Parse ``scontrol show node -o`` output (one node per line) by node name."""
    nodes: Dict[str, NodeStatus] = {}
    for line in output.splitlines():
        fields = {key: rx.search(line) for key, rx in _FIELD_RE.items()}
        if not fields["NodeName"] or not fields["State"]:
            if line.strip():
                logger.debug("ignoring scontrol line without NodeName/State: %r", line)
            continue
        name = fields["NodeName"].group(1)
        states = parse_state_words(fields["State"].group(1))
        addr = fields["NodeAddr"].group(1) if fields["NodeAddr"] else None
        hostname = fields["NodeHostName"].group(1) if fields["NodeHostName"] else None
        nodes[name] = NodeStatus(name, states, addr, hostname)
    return nodes


def query_nodes(names: List[str], deadline: Deadline, environ: Mapping[str, str],
                scontrol: str = "scontrol",
                call_timeout_s: float = SCONTROL_TIMEOUT_S) -> Dict[str, NodeStatus]:
    """Ask Slurm for the state of ``names`` with one bounded scontrol call.

    Raises:
        DiscoveryUnavailableError: scontrol is missing, fails, or says nothing parsable.
        DiscoveryTimeoutError: scontrol did not answer in time.
    """
    expr = collect_nodelist(names)
    argv = [scontrol, "show", "node", "-o", expr]
    timeout_s = deadline.call_timeout_s(call_timeout_s, "scontrol show node")
    # Names Slurm does not know make scontrol print "Node X not found" and exit 1
    # after printing the known ones, so a non-zero status alone is not a failure.
    result = run_command(argv, timeout_s, env=environ, check=False)
    nodes = parse_scontrol_nodes(result.stdout)
    for line in result.stdout.splitlines():
        if line.strip().endswith("not found"):
            logger.warning("scontrol: %s", line.strip())
    if not nodes:
        if result.returncode != 0:
            raise DiscoveryUnavailableError(
                command_failure(argv, result.returncode, result.stderr or result.stdout))
        raise DiscoveryUnavailableError(f"{' '.join(argv)!r} printed no node states")
    return nodes


def discover(environ: Mapping[str, str], deadline: Deadline, *, nodelist: Optional[str] = None,
             slots: Optional[int] = None, slots_from: SlotSource = SlotSource.TASKS,
             health_check: bool = True, address: Address = Address.NAME,
             scontrol: str = "scontrol",
             call_timeout_s: float = SCONTROL_TIMEOUT_S) -> List[HostSlots]:
    """The allocation's healthy hosts with their slots, in nodelist order (never empty).

    Raises:
        DiscoveryInputError: bad nodelist/slots, or ``address`` without ``health_check``.
        DiscoveryUnavailableError: Slurm could not be asked (includes timeouts),
            or it reports no node of the allocation healthy.
    """
    hosts = allocation_hosts(environ, nodelist, slots, slots_from)
    if not health_check:
        if address is not Address.NAME:
            raise DiscoveryInputError(
                f"--address {address.value} needs the Slurm node query; drop --no-health-check")
        return hosts
    nodes = query_nodes([h.host for h in hosts], deadline, environ, scontrol, call_timeout_s)
    healthy: List[HostSlots] = []
    reasons: List[str] = []
    for entry in hosts:
        node = nodes.get(entry.host)
        if node is None:
            logger.warning("dropping node %r: Slurm does not know it", entry.host)
            reasons.append(f"{entry.host} unknown to Slurm")
            continue
        reason = node.unhealthy_reason()
        if reason is not None:
            logger.info("leaving out node %r: Slurm reports %s", entry.host, reason)
            reasons.append(f"{entry.host} {reason}")
            continue
        healthy.append(HostSlots(_address_of(node, address), entry.slots))
    if not healthy:
        # An allocation does not lose every node at once: this is a moment
        # (a controller hiccup, a short NOT_RESPONDING) that an empty answer
        # would turn into Horovod dropping every host. Unavailable keeps them.
        raise DiscoveryUnavailableError(
            f"no healthy node in the allocation ({'; '.join(reasons)}): an empty host set is "
            "reported as unavailable so that Horovod keeps its previous hosts")
    return healthy


def _address_of(node: NodeStatus, address: Address) -> str:
    if address is Address.ADDR and node.addr:
        return node.addr
    if address is Address.HOSTNAME and node.hostname:
        return node.hostname
    return node.name


__all__ = ["SlotSource", "Address", "NodeStatus", "UNHEALTHY_STATES", "HEALTHY_BASE_STATES", "STATE_SUFFIXES",
           "parse_state_words", "allocation_hosts", "parse_scontrol_nodes",
           "query_nodes", "discover"]
