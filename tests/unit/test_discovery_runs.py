"""The launcher's runs of the discovery script (elastic_ext.launch.discovery_runs), against Horovod's HostManager."""

import threading
import types

import pytest
from horovod.runner.elastic import driver as horovod_driver
from horovod.runner.elastic.discovery import HostDiscoveryScript, HostManager

from elastic_ext.launch import discovery_runs, noticed_hosts


@pytest.fixture
def installed():
    discovery_runs.install()
    yield
    discovery_runs.uninstall()


def script(tmp_path, body):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_the_script_runs_as_a_plain_child_and_is_parsed_as_horovod_does(tmp_path, installed, monkeypatch):
    monkeypatch.setenv("HOSTS_FOR_TEST", "b")
    discovery = HostDiscoveryScript(script(tmp_path, 'echo a:2; echo "$HOSTS_FOR_TEST"; echo log >&2'), 3)
    assert discovery.find_available_hosts_and_slots() == {"a": 2, "b": 3}


@pytest.mark.parametrize("body, code", [("exit 3", 3), ("kill -TERM $$", 143)])
def test_a_failing_script_raises_horovods_error_with_its_exit_status(tmp_path, installed, body, code):
    path = script(tmp_path, body)
    with pytest.raises(RuntimeError, match=f"Failed to execute discovery script: {path}. Exit code: {code}$"):
        HostDiscoveryScript(path, 1).find_available_hosts_and_slots()


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
