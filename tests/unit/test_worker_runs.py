"""The driver's runs of worker commands without Horovod's Python middleman (elastic_ext/launch/worker_runs.py):
the same output and exit status as Horovod's, the driver's events and the driver's death still end the worker."""

import io
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from horovod.runner.common.util import safe_shell_exec

from devkit.launch import command_line
from elastic_ext.control import horovod_seam
from elastic_ext.launch import horovod_changes, worker_runs
from tests.unit.horovod_restore import restore_horovod

COMMANDS = [
    "echo out one; echo err one >&2; printf 'no newline'; exit 3",
    "printf 'progress 1\\rprogress 2\\r'; echo done; echo 'ünïcode' >&2",
    "kill -9 $$",  # the shell itself killed: 128 + 9, as a shell reports it
    "true",
]


def run(execute, command, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    code = execute(command, stdout=out, stderr=err, index=2, **kwargs)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", COMMANDS)
def test_the_same_output_and_exit_status_as_horovods_execute(command):
    ours = run(worker_runs.execute, command)
    assert ours == run(safe_shell_exec.execute, command)
    assert ours[0] == {0: 3, 2: 137, 3: 0}.get(COMMANDS.index(command), ours[0])


def test_lines_carry_horovods_prefix_with_a_timestamp_when_asked():
    code, out, _ = run(worker_runs.execute, "echo hello", prefix_output_with_timestamp=True)
    assert code == 0
    assert out.endswith("[2]<stdout>:hello\n") and not out.startswith("[2]"), out


def wait_for_file(path, timeout_s=60):
    """The file's text once it holds a line (polled: it is written by another process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            if text.endswith("\n"):
                return text.strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} was not written within {timeout_s} s")


def test_an_event_of_the_driver_ends_the_command_and_its_children(tmp_path):
    pid_file = tmp_path / "pid"
    stop = threading.Event()
    result = []
    thread = threading.Thread(target=lambda: result.append(worker_runs.execute(
        f"sleep 600 & echo $! > {pid_file}; wait $!", events=[stop], stdout=io.StringIO(), stderr=io.StringIO())))
    thread.start()
    child = psutil.Process(int(wait_for_file(pid_file)))
    stop.set()
    thread.join(60)
    assert not thread.is_alive(), "the command outlived the driver's event"
    assert result == [128 + signal.SIGTERM], "the command's child did not end on the SIGTERM of Horovod's termination"
    gone, alive = psutil.wait_procs([child], timeout=30)
    assert not alive, "the command's child outlived the driver's event"


def test_the_driver_s_death_ends_the_worker_s_processes(tmp_path):
    pid_file = tmp_path / "pid"
    driver = subprocess.Popen([sys.executable, "-c", (
        "from elastic_ext.launch import worker_runs; "
        f"worker_runs.execute('sleep 600 & echo $! > {pid_file}; wait')")])
    try:
        child = psutil.Process(int(wait_for_file(pid_file)))
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        gone, alive = psutil.wait_procs([child], timeout=worker_runs.GRACE_S + 30)
        assert not alive, "the worker outlived its driver"
    finally:
        if driver.poll() is None:
            driver.kill()


def test_after_a_normal_end_no_guard_is_left_and_nothing_is_signalled(tmp_path):
    marker = tmp_path / "marker"
    # A process of the command's group that outlives the shell: a guard's signal would end it.
    code, _, _ = run(worker_runs.execute, f"(trap 'echo term >> {marker}' TERM; sleep 2) & echo started")
    assert code == 0
    guards = [p for p in psutil.Process().children(recursive=True)
              if "elastic_ext-worker-guard" in " ".join(command_line(p))]
    assert guards == []
    assert not marker.exists(), "the worker's group was signalled after its normal end"


def test_the_launchers_changes_replace_horovods_execute_and_record_its_original():
    original = safe_shell_exec.execute
    try:
        horovod_changes.install_launcher(parts=("worker_runs",))
        assert safe_shell_exec.execute is worker_runs.execute
        assert horovod_seam.REPLACED[(safe_shell_exec, "execute")] is original
    finally:
        restore_horovod()
    assert safe_shell_exec.execute is original


def test_the_termination_keeps_the_shell_s_exit_status_for_its_popen(tmp_path):
    """What the driver's event and an interrupt run: the shell's status stays with the ``Popen`` that waits for it
    (psutil's wait, in Horovod's function, reaps the driver's own child and its ``Popen`` then reports 0)."""
    pid_file = tmp_path / "pid"
    shell = subprocess.Popen(f"sleep 600 & echo $! > {pid_file}; wait $!", shell=True, start_new_session=True)
    child = psutil.Process(int(wait_for_file(pid_file)))
    worker_runs.terminate(shell)
    assert shell.wait(30) in (128 + signal.SIGTERM, -signal.SIGTERM), f"the terminated shell's status: {shell.returncode}"
    gone, alive = psutil.wait_procs([child], timeout=30)
    assert not alive, "the shell's child outlived the termination"
