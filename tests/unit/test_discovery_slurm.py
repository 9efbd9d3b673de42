"""Slurm parsing and health rules, without a cluster (live tests: tests/discovery/)."""

from __future__ import annotations

import pytest

from elastic_ext.discovery import DiscoveryInputError, HostSlots
from elastic_ext.discovery import slurm, slurm_hostlist

# One line of real `scontrol show node -o` output (Slurm 22.05.8), shortened.
SCONTROL_LINE = ("NodeName={name} Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUTot=2 "
                 "NodeAddr=127.0.0.1 NodeHostName=vm Port=35195 Version=22.05.8 "
                 "OS=Linux 6.1 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 State={state} "
                 "ThreadsPerCore=1 Partitions=debug Reason=disk full [root@2026-11-21T06:10:13]")


@pytest.mark.parametrize("expr, names", [
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("n[001-002,010],gpu7", ["n001", "n002", "n010", "gpu7"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("single", ["single"]),
])
def test_expand_nodelist(expr, names):
    assert slurm_hostlist.expand_nodelist(expr) == names


@pytest.mark.parametrize("expr", ["node[1-2", "node[3-1]", "n[a-c]", ""])
def test_malformed_nodelist_quotes_expression(expr):
    with pytest.raises(DiscoveryInputError, match=repr(expr).replace("[", r"\[")):
        slurm_hostlist.expand_nodelist(expr)


def test_slots_from_tasks_cpus_gpus_and_flag():
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1",
           "SLURM_JOB_CPUS_PER_NODE": "8(x3)", "SLURM_GPUS_PER_NODE": "a100:2,v100:1"}
    slots = lambda **kw: [h.slots for h in slurm.allocation_hosts(env, **kw)]  # noqa: E731
    assert slots() == [2, 2, 1]
    assert slots(slots_from=slurm.SlotSource.CPUS) == [8, 8, 8]
    assert slots(slots_from=slurm.SlotSource.GPUS) == [3, 3, 3]
    assert slots(slots=4) == [4, 4, 4]
    assert slurm.allocation_hosts(env, nodelist="x[1-2]", slots=1) == [HostSlots("x1", 1),
                                                                      HostSlots("x2", 1)]


def test_old_variable_name_is_a_fallback():
    env = {"SLURM_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "4"}
    assert slurm.allocation_hosts(env) == [HostSlots("n1", 4)]


@pytest.mark.parametrize("env, needle", [
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x3)"}, "3 counts for 2 nodes"),
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "two"}, "'two'"),
    ({"SLURM_JOB_NODELIST": "n[1-2]"}, "SLURM_TASKS_PER_NODE is not set"),
    ({}, "SLURM_JOB_NODELIST is not set"),
])
def test_bad_allocation_environment(env, needle):
    with pytest.raises(DiscoveryInputError, match=needle.replace("(", r"\(")):
        slurm.allocation_hosts(env)


def test_parse_scontrol_lines():
    out = "\n".join([SCONTROL_LINE.format(name="node01", state="IDLE"),
                     SCONTROL_LINE.format(name="node02", state="MIXED+DRAIN"),
                     "Node ghost not found", ""])
    nodes = slurm.parse_scontrol_nodes(out)
    assert set(nodes) == {"node01", "node02"}
    assert nodes["node02"].states == {"MIXED", "DRAIN"}
    assert (nodes["node01"].addr, nodes["node01"].hostname) == ("127.0.0.1", "vm")


@pytest.mark.parametrize("state", ["IDLE", "MIXED", "ALLOCATED", "IDLE+COMPLETING",
                                   "ALLOCATED+COMPLETING", "IDLE+RESERVED", "MIXED+PLANNED"])
def test_healthy_states(state):
    assert slurm.parse_scontrol_nodes(SCONTROL_LINE.format(name="n", state=state))[
        "n"].unhealthy_reason() is None


@pytest.mark.parametrize("state", ["DOWN", "DOWN+NOT_RESPONDING", "IDLE+DRAIN",
                                   "ALLOCATED+DRAIN", "MIXED+FAIL", "IDLE+NOT_RESPONDING",
                                   "IDLE+POWERED_DOWN", "IDLE+POWERING_DOWN", "FUTURE",
                                   "UNKNOWN", "IDLE+REBOOT_ISSUED", "SOMETHING_NEW"])
def test_unhealthy_states(state):
    assert slurm.parse_scontrol_nodes(SCONTROL_LINE.format(name="n", state=state))[
        "n"].unhealthy_reason()


# State words a live cluster of this Slurm (22.05) cannot show: those of older
# scontrol (suffix characters, +POWER before 21.08), power saving, maintenance
# reservations, cloud nodes. Spellings from Slurm's node_state_string() and
# node_state_string_complete().
@pytest.mark.parametrize("text, words", [
    ("IDLE", {"IDLE"}),
    ("IDLE*", {"IDLE", "NOT_RESPONDING"}),
    ("IDLE*+POWER", {"IDLE", "NOT_RESPONDING", "POWER"}),
    ("DOWN*+DRAIN", {"DOWN", "NOT_RESPONDING", "DRAIN"}),
    ("IDLE~+CLOUD+POWER", {"IDLE", "POWERED_DOWN", "CLOUD", "POWER"}),
    ("MIXED#", {"MIXED", "POWERING_UP"}),
    ("ALLOCATED+", {"ALLOCATED"}),
    ("mixed-", {"MIXED", "PLANNED"}),
    ("DRAINING@", {"DRAINING", "REBOOT_REQUESTED"}),
    ("IDLE+CLOUD+POWERED_DOWN", {"IDLE", "CLOUD", "POWERED_DOWN"}),
])
def test_state_words_with_suffixes_and_flags(text, words):
    assert slurm.parse_state_words(text) == words


@pytest.mark.parametrize("state", [
    "IDLE+CLOUD", "MIXED+CLOUD+COMPLETING", "ALLOCATED+", "IDLE+DYNAMIC_NORM",
    "MIXED@", "ALLOCATED+REBOOT_REQUESTED", "MIXED-", "RESERVED", "PLANNED",
])
def test_more_healthy_states(state):
    assert slurm.parse_scontrol_nodes(SCONTROL_LINE.format(name="n", state=state))[
        "n"].unhealthy_reason() is None


@pytest.mark.parametrize("state, why", [
    ("IDLE+POWER", "POWER"),                     # Slurm < 21.08: powered down by power saving
    ("IDLE*+POWER", "NOT_RESPONDING"),
    ("IDLE*", "NOT_RESPONDING"),
    ("MIXED*", "NOT_RESPONDING"),
    ("IDLE~", "POWERED_DOWN"),
    ("IDLE#", "POWERING_UP"),
    ("IDLE%", "POWERING_DOWN"),
    ("IDLE!", "POWER_DOWN"),
    ("ALLOCATED$", "MAINTENANCE"),
    ("IDLE^", "REBOOT_ISSUED"),
    ("DRAINED*", "DRAINED"),
    ("MAINT", "MAINT"),
    ("REBOOT", "REBOOT"),
    ("INVAL", "INVAL"),
    ("IDLE+POWERED_DOWN", "POWERED_DOWN"),
    ("IDLE+CLOUD+POWERED_DOWN", "POWERED_DOWN"),
    ("IDLE+POWERING_UP", "POWERING_UP"),
    ("IDLE+POWER_UP", "POWER_UP"),
    ("ALLOCATED+POWER_DOWN", "POWER_DOWN"),
    ("MIXED+MAINTENANCE", "MAINTENANCE"),
    ("IDLE+INVALID_REG", "INVALID_REG"),
    ("ERROR", "ERROR"),
    ("FUTURE+CLOUD", "FUTURE"),
])
def test_more_unhealthy_states(state, why):
    reason = slurm.parse_scontrol_nodes(SCONTROL_LINE.format(name="n", state=state))["n"].unhealthy_reason()
    assert reason is not None and why in reason
