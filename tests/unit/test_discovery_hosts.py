"""Host validation and rendering: what may reach Horovod's parser and ssh."""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ext.discovery import DiscoveryInputError, HostSlots, host_error, render
from elastic_ext.discovery.hosts import parse_slots, usable_hosts

# Horovod 0.28.1's own pattern for --hosts entries (horovod/runner/common/util/hosts.py).
HOROVOD_HOST_SLOTS = re.compile(r"^[\w.-]+:[0-9]+$")


@pytest.mark.parametrize("host", [
    "node01", "gpu-a100-3.cluster.example.com", "ip-10-0-0-7.ec2.internal", "10.0.0.7",
    "255.255.255.255", "compute_12", "a" * 63, "localhost",
])
def test_valid_hosts(host):
    assert host_error(host) is None


@pytest.mark.parametrize("host, rule", [
    ("", "empty"),
    ("node 01", "whitespace"),
    ("node01\n", "whitespace"),
    ("node01;rm", "shell metacharacters"),
    ("$(reboot)", "shell metacharacters"),
    ("`id`", "shell metacharacters"),
    ("-oProxyCommand=x", "'-'"),
    ("a.-b", "'-'"),
    ("node..x", "empty label"),
    (".node", "empty label"),
    ("node.", "empty label"),
    ("a" * 64, "longer than 63"),
    ("999.1.1.1", "IPv4"),
    ("10.0.0", "IPv4"),
    ("fe80::1", "IPv6"),
    ("[fe80::1]", "':'"),
    ("node:2", "':'"),
    ("nöde", "only letters"),
])
def test_invalid_hosts_name_the_rule(host, rule):
    reason = host_error(host)
    assert reason is not None and rule in reason
    assert repr(host) in reason or host == ""


def test_usable_hosts_drops_invalid_zero_slot_and_duplicate_hosts(caplog):
    entries = [HostSlots("a", 2), HostSlots("b;c", 1), HostSlots("d", 0), HostSlots("a", 4),
               HostSlots("e", 1)]
    with caplog.at_level("INFO"):
        kept = usable_hosts(entries)
    assert kept == [HostSlots("a", 2), HostSlots("e", 1)]
    assert "'b;c'" in caplog.text and "duplicate host 'a'" in caplog.text


def test_render_is_exactly_host_slots_lines():
    assert render([HostSlots("n1", 2), HostSlots("10.1.2.3", 8)]) == "n1:2\n10.1.2.3:8\n"
    assert render([]) == ""


@pytest.mark.parametrize("value, expected", [("4", 4), (" 8 ", 8), (0, 0), ("4096", 4096)])
def test_parse_slots(value, expected):
    assert parse_slots(value, "x") == expected


@pytest.mark.parametrize("value", ["two", "-1", "1.5", "", "4097", "0x10"])
def test_parse_slots_rejects_and_quotes(value):
    with pytest.raises(DiscoveryInputError) as err:
        parse_slots(value, "tag 'slots' of i-1")
    assert repr(value) in str(err.value) or f"slot count {value} " in str(err.value)
    assert "tag 'slots' of i-1" in str(err.value)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=string.printable + "äß\u00a0", max_size=40),
       st.integers(min_value=1, max_value=64))
def test_anything_rendered_parses_as_horovod_host_slots(host, slots):
    out = render([HostSlots(host, slots)])
    if out:
        line = out.rstrip("\n")
        assert "\n" not in line and HOROVOD_HOST_SLOTS.match(line), line
        assert not host.startswith("-")
        name, count = line.split(":")  # what Horovod's discovery parser does
        assert (name, int(count)) == (host, slots)


def test_host_slots_is_an_immutable_value():
    entry = HostSlots("node1", 4)
    assert entry == HostSlots("node1", 4) and entry != HostSlots("node1", 2) and entry != ("node1", 4)
    assert len({entry, HostSlots("node1", 4)}) == 1
    assert repr(entry) == "HostSlots(host='node1', slots=4)"
    with pytest.raises(AttributeError, match="immutable"):
        entry.slots = 8
    assert entry.slots == 4
    import copy
    assert copy.deepcopy(entry) == entry and copy.copy(entry) == entry
