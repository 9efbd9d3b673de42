"""The script contract: bounded time, clean stdout, documented exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_ext.discovery import Deadline, DiscoveryTimeoutError, DiscoveryUnavailableError
from elastic_ext.discovery.cli import (EXIT_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_TIMEOUT,
                                       EXIT_UNAVAILABLE)
from elastic_ext.discovery.deadline import run_command
from devkit.notice_job import wait_gone

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "host_discovery"

pytestmark = pytest.mark.timeout(60)


def run(argv, **kw):
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, **kw)


def test_run_command_kills_a_hung_process_group_at_its_timeout(tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(DiscoveryTimeoutError, match="did not answer within 0.30 s"):
        run_command(["bash", "-c", f"sleep 120 & echo $! $$ > {pids}; sleep 120"], 0.3)
    # The group (the shell and its background child) was sent SIGKILL; a loaded kernel may take
    # a moment to end each process, and wait_gone raises if either still runs after 30 s (left
    # alone, both would run for 120 s).
    wait_gone([int(pid) for pid in pids.read_text().split()], "the killed process group", 30)


def test_run_command_failures_quote_the_command_and_stderr():
    with pytest.raises(DiscoveryUnavailableError, match="not found"):
        run_command(["/nonexistent/tool"], 1)
    with pytest.raises(DiscoveryUnavailableError, match="status 3: boom"):
        run_command(["bash", "-c", "echo boom >&2; exit 3"], 5)
    assert run_command(["bash", "-c", "exit 1"], 5, check=False).returncode == 1


def test_deadline_caps_call_timeouts_and_runs_out():
    now = [0.0]
    d = Deadline(0.2, clock=lambda: now[0])
    assert d.call_timeout_s(10, "x") == 0.2
    assert d.call_timeout_s(0.1, "x") == 0.1
    now[0] = 0.1
    assert d.call_timeout_s(10, "x") == pytest.approx(0.1)
    now[0] = 0.25
    with pytest.raises(DiscoveryTimeoutError, match="no time left for x"):
        d.call_timeout_s(10, "x")


@pytest.mark.parametrize("name", ["slurm", "aws_spot", "static"])
def test_help_documents_exit_codes(name):
    proc = run([str(SCRIPTS / f"{name}.py"), "--help"])
    assert proc.returncode == 0
    for code in ("0 ", "2 ", "3 ", "4 ", "--timeout-s"):
        assert code in proc.stdout


def test_static_script_stdout_is_only_host_lines(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# comment\nnode1:2\nbad$(host):4\nnode2\n")
    proc = run([str(SCRIPTS / "static.py"), str(hosts), "--slots", "3"])
    assert (proc.returncode, proc.stdout) == (EXIT_OK, "node1:2\nnode2:3\n")
    assert "'bad$(host)'" in proc.stderr


def test_static_script_reflects_edits_between_calls(tmp_path):
    hosts, excl = tmp_path / "hosts", tmp_path / "exclude"
    hosts.write_text("localhost:2\n127.0.0.1:2\n")
    argv = [str(SCRIPTS / "static.py"), str(hosts), "--exclude-file", str(excl)]
    assert run(argv).stdout == "localhost:2\n127.0.0.1:2\n"
    excl.write_text("127.0.0.1\n")
    assert run(argv).stdout == "localhost:2\n"
    excl.write_text("")
    assert run(argv).stdout == "localhost:2\n127.0.0.1:2\n"


def test_bad_inputs_exit_2_without_traceback(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1:lots\n")
    cases = [
        [str(SCRIPTS / "static.py"), str(hosts)],
        [str(SCRIPTS / "static.py"), str(tmp_path / "missing")],
        [str(SCRIPTS / "static.py"), str(hosts), "--slots", "0"],
        [str(SCRIPTS / "slurm.py"), "--nodelist", "n[1-", "--slots", "1", "--no-health-check"],
        [str(SCRIPTS / "slurm.py"), "--no-such-flag"],
    ]
    for argv in cases:
        proc = run(argv)
        assert (proc.returncode, proc.stdout) == (EXIT_INPUT, ""), (argv, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stderr.strip(), argv


def test_slurm_flags_work_outside_an_allocation():
    proc = run([str(SCRIPTS / "slurm.py"), "--nodelist", "gpu[1-2],cpu7", "--slots", "4",
                "--no-health-check"])
    assert (proc.returncode, proc.stdout) == (EXIT_OK, "gpu1:4\ngpu2:4\ncpu7:4\n")


def _run_provider(body: str, *flags: str):
    """Run cli.main over a provider written inline, in a fresh interpreter."""
    code = "\n".join([
        "import sys, time",
        "from elastic_ext.discovery.cli import main, make_parser",
        "def discover(args, deadline):",
        textwrap.indent(textwrap.dedent(body), "    "),
        "sys.exit(main(make_parser('probe', 'test'), discover, sys.argv[1:]))",
    ])
    return run([sys.executable, "-c", code, *flags], cwd=str(REPO))


def test_watchdog_ends_a_hung_provider_with_exit_4():
    proc = _run_provider("time.sleep(30)", "--timeout-s", "0.5")
    assert (proc.returncode, proc.stdout) == (EXIT_TIMEOUT, "")
    assert "did not finish within --timeout-s 0.5" in proc.stderr


def test_internal_error_exits_1_with_one_line_and_no_traceback():
    proc = _run_provider("raise KeyError('oops')")
    assert (proc.returncode, proc.stdout) == (EXIT_INTERNAL, "")
    assert "internal error: KeyError" in proc.stderr and "Traceback" not in proc.stderr


def test_empty_host_list_is_exit_0_with_a_warning():
    proc = _run_provider("return []")
    assert (proc.returncode, proc.stdout) == (EXIT_OK, "")
    assert "no usable hosts" in proc.stderr


def test_unavailable_backend_exits_3():
    proc = _run_provider(
        "from elastic_ext.discovery import DiscoveryUnavailableError\n"
        "raise DiscoveryUnavailableError('api said no')")
    assert (proc.returncode, proc.stdout) == (EXIT_UNAVAILABLE, "")
    assert "api said no" in proc.stderr
