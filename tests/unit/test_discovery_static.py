"""The static provider: host file parsing, exclusions, re-reading on every call."""

from __future__ import annotations

import pytest

from elastic_ext.discovery import DiscoveryInputError, HostSlots
from elastic_ext.discovery import static


def test_all_line_forms_comments_and_default_slots(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# pool A\n\nnode1\nnode2:4   # fat node\n10.0.0.5 slots=8\n  node3 slots = 2\n")
    assert static.read_host_file(f, default_slots=3) == [
        HostSlots("node1", 3), HostSlots("node2", 4), HostSlots("10.0.0.5", 8),
        HostSlots("node3", 2)]


@pytest.mark.parametrize("line, needle", [
    ("node1:two", "'two'"),
    ("node1 extra words", "'node1 extra words'"),
    ("node1:-2", "'-2'"),
    ("node1 slots=", "'node1 slots='"),
])
def test_malformed_line_names_file_line_and_value(tmp_path, line, needle):
    f = tmp_path / "hosts"
    f.write_text(f"ok:1\n{line}\n")
    with pytest.raises(DiscoveryInputError) as err:
        static.read_host_file(f)
    assert "line 2" in str(err.value) and needle in str(err.value)


def test_missing_host_file_is_input_error(tmp_path):
    with pytest.raises(DiscoveryInputError, match="cannot read host file"):
        static.read_host_file(tmp_path / "nope")


def test_exclude_list_and_file_are_reread_each_call(tmp_path):
    hosts, excl = tmp_path / "hosts", tmp_path / "exclude"
    hosts.write_text("a:2\nb:2\nc:2\n")
    assert [h.host for h in static.discover(hosts, exclude=["c"], exclude_file=excl)] == ["a", "b"]
    excl.write_text("b  # draining for maintenance\n")
    assert [h.host for h in static.discover(hosts, exclude=["c"], exclude_file=excl)] == ["a"]
    hosts.write_text("a:2\nb:2\nc:2\nd:1\n")
    excl.unlink()
    assert [h.host for h in static.discover(hosts, exclude_file=excl)] == ["a", "b", "c", "d"]


def test_the_static_script_imports_only_what_it_uses(tmp_path):
    # Horovod's driver runs the script every second: what it imports is paid once a second.
    import os
    import subprocess
    import sys
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.1:2\n")
    script = os.path.join(static.__file__.rsplit(os.sep + "elastic_ext" + os.sep, 1)[0], "host_discovery", "static.py")
    done = subprocess.run([sys.executable, "-X", "importtime", script, str(hosts)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "localhost:2\n127.0.0.1:2\n"
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "elastic_ext.discovery.static" in imported, done.stderr[-2000:]
    assert not imported & {"dataclasses", "typing", "subprocess", "shutil", "pathlib", "inspect"}, \
        sorted(imported & {"dataclasses", "typing", "subprocess", "shutil", "pathlib", "inspect"})
