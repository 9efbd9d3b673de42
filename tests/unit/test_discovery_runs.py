"""The launcher's runs of the discovery script (elastic_ext.launch.discovery_runs), against Horovod's HostManager."""

import io
import os
import subprocess
import sys
import threading
import time
import types

import pytest
from horovod.runner.elastic import driver as horovod_driver
from horovod.runner.elastic.discovery import HostDiscoveryScript, HostManager

from elastic_ext.launch import discovery_runs, driver, noticed_hosts, worker_runs
from elastic_ext.launch.discovery_runs import Prefetched
from tests.unit.test_prestart import wait_for


@pytest.fixture
def installed():
    yield
    discovery_runs._refused.clear()  # the hosts it logged, for the next test


def launchers(path, slots):
    """Horovod's discovery by script as the launcher's driver runs it."""
    return discovery_runs.script_discovery(HostDiscoveryScript(path, slots))


def script(tmp_path, body):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_the_script_runs_as_a_plain_child_and_is_parsed_as_horovod_does(tmp_path, installed, monkeypatch):
    monkeypatch.setenv("HOSTS_FOR_TEST", "b")
    discovery = launchers(script(tmp_path, 'echo a:2; echo "$HOSTS_FOR_TEST"; echo log >&2'), 3)
    assert discovery.find_available_hosts_and_slots() == {"a": 2, "b": 3}


@pytest.mark.parametrize("body, code", [("exit 3", 3), ("kill -TERM $$", 143)])
def test_a_failing_script_raises_horovods_error_with_its_exit_status(tmp_path, installed, body, code):
    path = script(tmp_path, body)
    with pytest.raises(RuntimeError, match=f"Failed to execute discovery script: {path}. Exit code: {code}$"):
        launchers(path, 1).find_available_hosts_and_slots()


class Blocking:
    """A discovery whose first call waits until the test lets it answer."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0

    def find_available_hosts_and_slots(self):
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.release.wait(30), "the test never released the discovery"
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def driver_like(discovery):
    """What discover_hosts uses of an ElasticDriver."""
    notified = []
    return types.SimpleNamespace(_shutdown=threading.Event(), _wait_hosts_cond=threading.Condition(),
                                 _host_manager=HostManager(discovery), notified=notified,
                                 _notify_workers_host_changes=lambda hosts, result: notified.append(result))


def slots(driver):
    return driver._host_manager.current_hosts.count_available_slots()


def test_the_host_lock_is_free_while_the_script_runs_and_its_answer_is_applied_under_it(monkeypatch):
    monkeypatch.setattr(horovod_driver, "DISCOVER_HOSTS_FREQUENCY_SECS", 0.01)
    discovery = Blocking([{"a": 2}, {"a": 2, "b": 1}])
    driver = driver_like(discovery)
    thread = threading.Thread(target=discovery_runs.discover_hosts, args=(driver,), daemon=True)
    thread.start()
    assert discovery.entered.wait(30)
    # A round forming now (wait_for_available_slots) takes the lock at once.
    assert driver._wait_hosts_cond.acquire(blocking=False), "the driver held its host lock while the script ran"
    driver._wait_hosts_cond.release()
    discovery.release.set()
    with driver._wait_hosts_cond:
        assert driver._wait_hosts_cond.wait_for(lambda: slots(driver) == 3, timeout=30), slots(driver)
    driver._shutdown.set()
    thread.join(30)
    assert not thread.is_alive()
    assert len(driver.notified) >= 2  # a added, then b added: the workers were told each time


def test_a_failing_first_discovery_ends_the_job_and_a_later_one_is_retried(monkeypatch, caplog):
    monkeypatch.setattr(horovod_driver, "DISCOVER_HOSTS_FREQUENCY_SECS", 0.01)
    first = driver_like(Blocking([RuntimeError("no hosts file")]))
    first._host_manager._discovery.release.set()
    with pytest.raises(RuntimeError, match="no hosts file"):
        discovery_runs.discover_hosts(first)
    assert first._shutdown.is_set()

    later = driver_like(Blocking([{"a": 1}, RuntimeError("scheduler busy"), {"a": 1, "b": 1}]))
    later._host_manager._discovery.release.set()
    thread = threading.Thread(target=discovery_runs.discover_hosts, args=(later,), daemon=True)
    thread.start()
    with later._wait_hosts_cond:
        assert later._wait_hosts_cond.wait_for(lambda: slots(later) == 2, timeout=30), slots(later)
    later._shutdown.set()
    thread.join(30)
    assert "scheduler busy" in caplog.text


def test_the_answer_fetched_outside_the_lock_goes_through_the_notices_filter():
    inner = Blocking([{"a": 1, "b": 1}])
    inner.release.set()
    manager = HostManager(noticed_hosts.WithoutNoticed(inner))
    prefetched = discovery_runs._prefetched(manager)
    assert manager._discovery.discovery is prefetched and prefetched.discovery is inner
    assert discovery_runs._prefetched(manager) is prefetched  # found again, not wrapped twice
    prefetched.fetch()
    noticed_hosts.noticed.add("b")
    try:
        manager.update_available_hosts()
        assert manager.current_hosts.host_slots == {"a": 1}
    finally:
        noticed_hosts.noticed.discard("b")
    assert inner.calls == 1  # the update used the fetched answer; without one it asks the discovery itself
    manager.update_available_hosts()
    assert inner.calls == 2 and manager.current_hosts.host_slots == {"a": 1, "b": 1}


def run_a_job(discovery, commands, launcher=False):
    """Horovod's driver (the launcher's with ``launcher``) with ``discovery``, max 2 workers, each running Horovod's own worker command (a no-op
    script, with HOROVOD_HOSTNAME=host and the rest as Horovod writes them) through the launcher's execute."""
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.rendezvous import create_rendezvous_handler
    from horovod.runner.gloo_run import _slot_info_to_command_fn
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    built = driver.driver_class() if launcher else ElasticDriver
    elastic = built(server, discovery, 1, 2, timeout=30)  # min_np 1, max_np 2
    server.start(create_rendezvous_handler(elastic))
    command_of = _slot_info_to_command_fn("true", {})
    done = threading.Semaphore(0)

    def create_worker(slot_info, events):
        commands.append((slot_info.hostname, command_of(slot_info)))
        code = worker_runs.execute(commands[-1][1], stdout=io.StringIO(), stderr=io.StringIO())
        done.release()
        return code, time.time()

    try:
        elastic.wait_for_available_slots(1)
        elastic.start(1, create_worker)
        assert done.acquire(timeout=30), "no worker ran"
        return elastic._host_manager.current_hosts.available_hosts
    finally:
        elastic.stop()


@pytest.mark.parametrize("launcher", [True, False])
def test_a_discovered_host_that_would_run_a_command_never_reaches_horovod(tmp_path, caplog, monkeypatch, launcher):
    marker = tmp_path / "marker"
    monkeypatch.setenv("MARKER_FOR_TEST", str(marker))  # in the workers' shell
    host = "x$(touch${IFS}$MARKER_FOR_TEST)"  # no whitespace: the shell-metacharacter rule stops it
    path = script(tmp_path, f"echo localhost:1; echo '{host}:1'")
    if not launcher:  # Horovod's own discovery: the control, showing what the check prevents
        commands = []
        run_a_job(HostDiscoveryScript(path, 1), commands)
        assert wait_for(marker.exists, timeout_s=30), commands
        return
    commands = []
    try:
        with caplog.at_level("ERROR", logger="elastic_ext.launch.discovery_runs"):
            assert Prefetched(launchers(path, 1)).find_available_hosts_and_slots() == {"localhost": 1}
            assert run_a_job(HostDiscoveryScript(path, 1), commands, launcher=True) == {"localhost"}
    finally:
        discovery_runs._refused.clear()
    assert [host for host, _ in commands] == ["localhost"]
    assert not marker.exists()
    refused = [r.getMessage() for r in caplog.records]
    assert len(refused) == 1 and repr(host) in refused[0] and "shell metacharacters" in refused[0], refused


def _gone(pid):
    """No such process, or a zombie (killed; reaped by whoever adopted it, maybe never in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_script_past_its_timeout_is_killed_with_what_it_started(tmp_path, installed, monkeypatch):
    """L6 (audit): Horovod waited for a hung user script forever."""
    monkeypatch.setattr(discovery_runs, "SCRIPT_TIMEOUT_S", 0.5)
    pidfile = tmp_path / "pid"
    path = script(tmp_path, f"sleep 300 & echo $! > {pidfile}; wait")
    with pytest.raises(RuntimeError, match=f"Discovery script {path} did not finish within 0.5s: killed"):
        launchers(path, 1).find_available_hosts_and_slots()
    assert wait_for(lambda: _gone(int(pidfile.read_text())), 10)


def test_a_running_script_ends_when_the_driver_exits(tmp_path):
    """L6 (audit): a script running when the driver ended was left behind."""
    pidfile = tmp_path / "pid"
    path = script(tmp_path, f"sleep 300 & echo $! > {pidfile}; wait")
    driver = subprocess.Popen([sys.executable, "-c", (
        "import os, threading, time\n"
        "from horovod.runner.elastic.discovery import HostDiscoveryScript\n"
        "from elastic_ext.launch import discovery_runs\n"
        f"discovery = discovery_runs.script_discovery(HostDiscoveryScript({path!r}, 1))\n"
        "threading.Thread(target=discovery.find_available_hosts_and_slots, daemon=True).start()\n"
        f"while not os.path.exists({str(pidfile)!r}) or not open({str(pidfile)!r}).read().strip(): time.sleep(0.01)\n"
        "os._exit(0)\n")])
    assert driver.wait(timeout=60) == 0
    assert wait_for(lambda: _gone(int(pidfile.read_text())), 20)
