"""elastic_ext.launch.driver: Horovod's real ElasticDriver and rendezvous server, with the launcher's changes.

Workers are threads that send the HTTP request ``hvd.init()`` sends; a
worker "dies" when the function the driver runs for it returns exit code 1.
Each test runs with the changes and, where it shows what they change,
without them (Horovod's own behaviour).
"""

import os
import subprocess
import sys
import threading
import time

import pytest

from elastic_ext import exit_codes
from elastic_ext.control import horovod_seam
from elastic_ext.launch import command_line, driver, driver_state, horovodrun
from elastic_ext.worker import prestart, round_watch
from tests.unit.test_prestart import Discovery, discovered, in_threads, wait_for, waiting_in_the_barrier


class Job:
    """Horovod's driver as horovodrun sets it up, with a worker exit the test triggers per slot; with
    ``changed`` (the fixture of that name), the launcher's driver (elastic_ext.launch.driver.driver_class)."""

    changed = False

    def __init__(self, hosts, min_np, max_np):
        from horovod.runner.elastic.driver import ElasticDriver
        from horovod.runner.elastic.rendezvous import create_rendezvous_handler
        from horovod.runner.http.http_server import RendezvousServer

        self.server = RendezvousServer()
        self.discovery = Discovery(hosts)
        built = driver.driver_class() if self.changed else ElasticDriver
        self.driver = built(self.server, self.discovery, min_np, max_np, timeout=30)
        self.port = self.server.start(create_rendezvous_handler(self.driver))
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = []
        self.exits = {}            # (host, local_rank) -> Event: set it and the slot's newest worker exits with code 1
        self.workers = []          # (slot info it was started with, its exit Event, its exit code box), in start order
        self.handled = []          # (host, local_rank) of each worker exit the driver has finished handling
        self.finish = threading.Event()
        self.driver._handle_worker_exit = self._handle_worker_exit

    def _handle_worker_exit(self, slot_info, exit_code, timestamp):
        # The driver's own handling (Horovod's, or elastic_ext's once installed), then a record of it.
        # Horovod's records a failure, then waits in the round's barrier for the other workers.
        try:
            type(self.driver)._handle_worker_exit(self.driver, slot_info, exit_code, timestamp)
        finally:
            self.handled.append((slot_info.hostname, slot_info.local_rank))

    def _create_worker(self, slot_info, events):
        key = (slot_info.hostname, slot_info.local_rank)
        died = self.exits[key] = threading.Event()  # each worker its own: one started later in the slot lives
        code = [1]
        self.workers.append((slot_info, died, code))
        self.started.append(key)
        while not self.finish.is_set():
            if died.wait(0.05):
                return code[0], time.time()
        return 0, time.time()

    def start(self, num_proc):
        self.driver.wait_for_available_slots(num_proc)
        self.driver.start(num_proc, self._create_worker)

    def rank_and_size(self, host, local_rank):
        return prestart.parse_slot(self.answer(host, local_rank))

    def answer(self, host, local_rank):
        """The whole answer to a rank request: rank, size, local rank, local size, cross rank, cross size."""
        return prestart.get(f"{self.url}/rank_and_size/{host}:{local_rank}", timeout_s=30)

    def store(self, key):
        return prestart.get(f"{self.url}/{round_watch.SCOPE}/{key}")

    def stop(self):
        self.finish.set()
        self.driver.stop()


SLOTS = [("host-a", 0), ("host-a", 1), ("host-b", 0), ("host-b", 1)]


def started_job():
    job = Job({"host-a": 2, "host-b": 2}, 2, 4)
    job.start(4)
    assert wait_for(lambda: len(job.started) == 4)
    return job


@pytest.fixture
def changed(monkeypatch):
    monkeypatch.setattr(Job, "changed", True)


def a_worker_of_host_a_dies_in_a_round(job):
    """host-a[1] fails while the three others ask for their ranks again (as after a collective failure)."""
    asks, threads = in_threads(*[lambda s=s: job.rank_and_size(*s) for s in SLOTS if s != ("host-a", 1)])
    waiting_in_the_barrier(job, 3)
    job.exits[("host-a", 1)].set()
    for thread in threads:
        thread.join(30)
    return asks


def a_host_loses_both_workers(job, lost, other):
    """Both workers of ``lost`` fail while those of ``other`` ask for their ranks again; returns their answers."""
    asks, threads = in_threads(lambda: job.rank_and_size(other, 0), lambda: job.rank_and_size(other, 1))
    waiting_in_the_barrier(job, 2)
    job.exits[(lost, 0)].set()
    job.exits[(lost, 1)].set()
    for thread in threads:
        thread.join(30)
    return asks


def test_horovod_blacklists_a_host_when_one_of_its_workers_fails():
    job = started_job()
    try:
        asks = a_worker_of_host_a_dies_in_a_round(job)
        assert asks == [(-1, -1), (0, 2), (1, 2)]  # host-a[0], alive, is removed from the job
    finally:
        job.stop()


def test_a_failures_round_holds_only_the_survivors_and_the_slot_returns_when_they_ask_again(changed):
    job = started_job()
    try:
        assert job.store(round_watch.CAPACITY_LEFT_OUT) is None, "the job's first round holds every slot"
        asks = a_worker_of_host_a_dies_in_a_round(job)  # (the hosts' order, so the ranks, vary from run to run)
        assert sorted(asks) == [(0, 3), (1, 3), (2, 3)], "host-a[0] stays; nobody waits for a new worker"
        # Written before the survivors' rank answers: each reads it at its sync and starts the early start.
        assert job.store(round_watch.CAPACITY_LEFT_OUT) == b"1"
        assert not job.driver._host_manager.is_blacklisted("host-a")
        assert len(job.started) == 4, f"a worker was started for the survivors' round: {job.started}"
        # The survivors' next rank requests (an early start's, while they train) bring the slot back ...
        asks = survivors_ask_again(job)
        assert len(set(asks)) == 3 and {size for _, size in asks} == {4}, asks  # host-a's new worker: the 4th
        assert job.started.count(("host-a", 1)) == 2, job.started
        assert job.store(round_watch.CAPACITY_LEFT_OUT) is None, "the early start's round took the capacity"
        # ... and the new worker, its model built, resets with them into a round of four.
        asks, threads = in_threads(*[lambda s=s: job.rank_and_size(*s) for s in SLOTS])
        for thread in threads:
            thread.join(30)
        assert sorted(asks) == [(0, 4), (1, 4), (2, 4), (3, 4)], asks
    finally:
        job.stop()


def early_start_asks(job, *slots):
    """An early start's rank requests (the survivors', while they train): what Prestart sends, in threads."""
    prestart.put(f"{job.url}/{prestart.SCOPE}/{prestart.ASKED}")
    return in_threads(*[lambda s=s: job.rank_and_size(*s) for s in slots])


def survivors_ask_again(job, lost=("host-a", 1)):
    """The survivors' rank requests of an early start; returns their answers once the next round formed."""
    asks, threads = early_start_asks(job, *[s for s in SLOTS if s != lost])
    for thread in threads:
        thread.join(30)
    return asks


def test_a_survivor_moves_down_to_the_failed_workers_local_rank_and_keeps_its_name_for_exits(changed):
    job = started_job()
    try:
        asks, threads = in_threads(*[lambda s=s: job.answer(*s) for s in SLOTS if s != ("host-a", 0)])
        waiting_in_the_barrier(job, 3)
        job.exits[("host-a", 0)].set()
        for thread in threads:
            thread.join(30)
        # rank, size, local rank, local size, ...: host-a[1] is now host-a's local rank 0, of 1
        fields = [[int(x) for x in answer.split(b",")] for answer in asks]
        assert [f[1:4] for f in fields] == [[3, 0, 1], [3, 0, 2], [3, 1, 2]], asks
        survivor = next(w for w in job.workers if (w[0].hostname, w[0].local_rank) == ("host-a", 1))
        # Its failure is charged to the slot it holds now, host-a[0], so the round completes.
        asks, threads = in_threads(lambda: job.rank_and_size("host-b", 0), lambda: job.rank_and_size("host-b", 1))
        waiting_in_the_barrier(job, 2)
        survivor[2][0] = 1
        survivor[1].set()
        for thread in threads:
            thread.join(30)
        # Charged to host-a[1], which no round holds, Horovod would ignore it and the barrier never complete.
        assert asks == [(0, 2), (1, 2)], asks
    finally:
        job.stop()


def test_a_reset_after_a_host_was_added_holds_the_workers_that_asked_and_the_early_start_brings_the_host(changed):
    job = Job({"host-a": 2}, 1, 4)
    job.start(2)
    assert wait_for(lambda: len(job.started) == 2)
    try:
        job.discovery.hosts = {"host-a": 2, "host-b": 2}
        discovered(job, {"host-a": 2, "host-b": 2})
        asks, threads = in_threads(lambda: job.rank_and_size("host-a", 0), lambda: job.rank_and_size("host-a", 1))
        for thread in threads:  # a reset (a removal came with the addition, say): nobody waits for host-b
            thread.join(30)
        assert asks == [(0, 2), (1, 2)] and len(job.started) == 2, (asks, job.started)
        asks, threads = early_start_asks(job, ("host-a", 0), ("host-a", 1))
        for thread in threads:
            thread.join(30)
        assert asks == [(0, 4), (1, 4)]
        assert sorted(job.started[2:]) == [("host-b", 0), ("host-b", 1)]
    finally:
        job.stop()


def test_survivors_fewer_than_min_np_wait_for_the_failed_slots_new_worker(changed):
    job = Job({"host-a": 2, "host-b": 2}, 4, 4)
    job.start(4)
    assert wait_for(lambda: len(job.started) == 4)
    try:
        asks, threads = in_threads(*[lambda s=s: job.rank_and_size(*s) for s in SLOTS if s != ("host-a", 1)])
        waiting_in_the_barrier(job, 3)
        job.exits[("host-a", 1)].set()
        assert wait_for(lambda: job.started.count(("host-a", 1)) == 2), job.started
        for thread in threads:
            thread.join(30)
        assert [size for _, size in asks] == [4, 4, 4]
        assert job.store(round_watch.CAPACITY_LEFT_OUT) is None, "the round holds every slot: nothing to start early"
    finally:
        job.stop()


def test_the_coordinator_is_told_that_capacity_is_back_until_a_round_takes_it(changed):
    from horovod.runner.common.util import secret
    from horovod.runner.elastic.worker import WorkerNotificationService

    class Manager:  # what a worker's notification manager does with a host update: here, record it
        def __init__(self):
            self.updates = []

        def handle_hosts_updated(self, timestamp, update_res):
            self.updates.append(update_res)

    job = started_job()
    manager, key = Manager(), secret.make_secret_key()
    service = WorkerNotificationService(key, None, manager)
    try:
        for host, local_rank in SLOTS:  # whichever survivor is rank 0 of the next round, it is told here
            job.driver.register_worker_server(host, local_rank, service.addresses(), key)
        a_worker_of_host_a_dies_in_a_round(job)
        assert wait_for(lambda: len(manager.updates) >= 2), "rank 0 was never told, or only once"
        from horovod.runner.elastic.worker import HostUpdateResult
        assert set(manager.updates) == {HostUpdateResult.added}
        survivors_ask_again(job)
        regrow = driver_state.state_of(job.driver).regrow_thread
        regrow.join(10)
        assert not regrow.is_alive(), "rank 0 is still told after a round took the capacity back"
    finally:
        service.shutdown()
        job.stop()


def test_the_regrow_checks_the_hosts_once_per_change_and_tells_only_while_they_add_slots():
    """Horovod's check (the assignments of every slot: about 20 ms at 1,024) runs at the first tell and
    after each discovery change or blacklisting; the tells between are one notification each."""
    from horovod.runner.elastic.discovery import DiscoveredHosts
    from horovod.runner.elastic.worker import HostUpdateResult
    from elastic_ext.launch import driver_registry

    class Coordinator:
        hostname, local_rank = "host-a", 0

        def __init__(self):
            self.told = []

        def notify_hosts_updated(self, timestamp, result):
            self.told.append(result)

    class Driver:  # the fields of Horovod's ElasticDriver the regrow reads
        _min_num_proc = 2

        def __init__(self):
            self.coordinator = Coordinator()
            self.hosts = DiscoveredHosts({"host-a": 2, "host-b": 2}, ["host-a", "host-b"])
            self._host_manager = self
            self.host_assignments = {"host-a": [0, 1]}  # the round held host-a only
            self.checks = 0

        @property
        def current_hosts(self):
            return self.hosts

        def _get_host_assignments(self, hosts):
            self.checks += 1
            return {host: list(range(hosts.get_slots(host))) for host in hosts.host_assignment_order}, []

        def get_coordinator_info(self):
            return self.coordinator

        def get_worker_client(self, slot):
            return self.coordinator

    fake = Driver()
    told = driver_registry._Told(fake)
    for _ in range(3):
        told.tell()
    assert (fake.checks, fake.coordinator.told) == (1, [HostUpdateResult.added] * 3)
    fake.hosts._host_assignment_order = ["host-a"]  # host-b blacklisted (Horovod's update, in place)
    told.tell()
    told.tell()
    assert (fake.checks, len(fake.coordinator.told)) == (2, 3), "capacity gone: no more tells"
    fake.hosts = DiscoveredHosts({"host-a": 2, "host-c": 1}, ["host-a", "host-c"])  # discovery found host-c
    told.tell()
    assert (fake.checks, len(fake.coordinator.told)) == (3, 4)
    fake.host_assignments = {"host-a": [0, 1], "host-c": [0]}  # a round took host-c: nothing left out
    told.tell()
    assert (fake.checks, len(fake.coordinator.told)) == (4, 4), "a new round's assignments are checked again"


def test_a_host_that_lost_every_worker_is_still_blacklisted(changed):
    job = started_job()
    try:
        assert a_host_loses_both_workers(job, "host-a", "host-b") == [(0, 2), (1, 2)]
        assert job.driver._host_manager.is_blacklisted("host-a")
    finally:
        job.stop()


def test_a_host_whose_two_workers_fail_in_successive_rounds_is_not_blacklisted(changed):
    """Two process failures in a row are not a lost machine: the second round held only one of the
    host's two slots. (Under a failure every 15 s a job lost its host for good this way.)"""
    job = started_job()
    try:
        a_worker_of_host_a_dies_in_a_round(job)  # host-a[1] dies; host-a[0] survives, the round holds 3
        asks, threads = in_threads(lambda: job.rank_and_size("host-b", 0), lambda: job.rank_and_size("host-b", 1))
        waiting_in_the_barrier(job, 2)
        job.exits[("host-a", 0)].set()  # host-a's last worker of that round dies too
        for thread in threads:
            thread.join(30)
        assert sorted(asks) == [(0, 2), (1, 2)], asks
        assert not job.driver._host_manager.is_blacklisted("host-a")
        asks = survivors_ask_again_from(job, [("host-b", 0), ("host-b", 1)])  # the regrow's early start
        assert {size for _, size in asks} == {4}, asks
    finally:
        job.stop()


def survivors_ask_again_from(job, slots):
    asks, threads = early_start_asks(job, *slots)
    for thread in threads:
        thread.join(30)
    return asks


def test_the_store_says_the_current_round_and_when_a_member_of_it_failed(changed):
    job = started_job()
    try:
        assert job.store(round_watch.CURRENT) == b"1"
        assert job.store(round_watch.failed_key(1)) is None
        job.exits[("host-a", 1)].set()
        assert wait_for(lambda: job.store(round_watch.failed_key(1)) == b"host-a[1]")
    finally:
        job.stop()


def test_no_round_is_published_by_horovods_own_driver():
    job = started_job()
    try:
        assert job.store(round_watch.CURRENT) is None
    finally:
        job.stop()


@pytest.mark.parametrize("with_changes", [False, True])
def test_the_late_exit_of_a_replaced_worker_is_not_charged_to_the_new_worker_in_its_slot(with_changes, monkeypatch):
    monkeypatch.setattr(Job, "changed", with_changes)
    job = started_job()
    try:
        # host-b leaves and comes back before its old workers have exited (as a
        # worker told to go takes up to 10 s to die while a blacklist cooldown may be 1 s).
        job.discovery.hosts = {"host-a": 2}
        discovered(job, {"host-a": 2})
        asks, threads = in_threads(*[lambda s=s: job.rank_and_size(*s) for s in SLOTS])
        for thread in threads:
            thread.join(30)
        assert asks == [(0, 2), (1, 2), (-1, -1), (-1, -1)]
        old = job.exits[("host-b", 0)]
        job.discovery.hosts = {"host-a": 2, "host-b": 2}
        discovered(job, {"host-a": 2, "host-b": 2})
        asks, threads = early_start_asks(job, ("host-a", 0), ("host-a", 1))
        for thread in threads:
            thread.join(30)
        assert asks == [(0, 4), (1, 4)]
        assert wait_for(lambda: job.started.count(("host-b", 0)) == 2), job.started
        round_now = job.driver._worker_registry.last_rendezvous()
        handled = job.handled.count(("host-b", 0))
        old.set()  # the old host-b[0] exits now, in the round of its successor
        def charged():
            return ("host-b", 0) in job.driver._worker_registry.get("FAILURE")

        assert wait_for(lambda: charged() or job.handled.count(("host-b", 0)) == handled + 1), \
            "the driver neither charged nor finished handling the exit"
        charged = charged()
        assert charged is not with_changes
        if with_changes:
            assert job.store(round_watch.failed_key(round_now)) is None
    finally:
        job.stop()


def worker_env(job, host, local_rank):
    """What horovodrun gives the worker of a slot, as far as round_watch reads it."""
    return {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(job.port), "HOROVOD_HOSTNAME": host, "HOROVOD_LOCAL_RANK": str(local_rank)}


def watch_env(monkeypatch, job):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", str(job.port))


def watched_keys(monkeypatch):
    """The failure keys the round watcher reads, with each answer, in order."""
    reads, real = [], round_watch.get

    def get(url, timeout_s=round_watch.REQUEST_TIMEOUT_S):
        answer = real(url, timeout_s)
        if "/failed_" in url:
            reads.append((url.rsplit("/", 1)[1], answer))
        return answer

    monkeypatch.setattr(round_watch, "get", get)
    return reads


def test_a_worker_waiting_in_its_first_init_learns_that_its_round_lost_a_member(changed, monkeypatch):
    job = started_job()
    try:
        watch_env(monkeypatch, job)
        reads, lost = watched_keys(monkeypatch), []
        stop = round_watch.watch(reset=False, on_lost=lost.append)
        assert wait_for(lambda: len(reads) >= 2), "the watcher never read its round's key"
        assert lost == [] and reads[:2] == [(round_watch.failed_key(1), None)] * 2
        job.exits[("host-b", 0)].set()
        assert wait_for(lambda: lost == [1], 10)
        stop()
    finally:
        job.stop()


def test_a_resetting_worker_watches_the_next_round_not_the_one_whose_failure_it_recovers_from(changed, monkeypatch):
    job = started_job()
    try:
        watch_env(monkeypatch, job)
        job.exits[("host-a", 1)].set()  # round 1 lost a member: the others reset
        assert wait_for(lambda: job.store(round_watch.failed_key(1)) is not None)
        reads, lost = watched_keys(monkeypatch), []
        stop = round_watch.watch(reset=True, on_lost=lost.append)
        assert wait_for(lambda: len(reads) >= 2), "the watcher never read its round's key"
        assert lost == [], "round 1's failure is why this worker resets; its round is 2"
        assert reads[:2] == [(round_watch.failed_key(2), None)] * 2
        stop()
    finally:
        job.stop()


def test_without_the_drivers_rounds_nothing_is_watched(monkeypatch):
    job = started_job()
    try:
        watch_env(monkeypatch, job)
        before = set(threading.enumerate())
        stop = round_watch.watch(reset=False, on_lost=lambda round_id: None)
        started = [t.name for t in set(threading.enumerate()) - before]
        assert "elastic_ext-round-watch" not in started, started
        stop()
    finally:
        job.stop()


@pytest.mark.parametrize("environ, expected", [
    ({"ELASTIC_EXT_CHECKPOINT_DIR": "/ckpt"}, "1"),
    ({}, "0"),                                                                   # nothing to restart from
    ({"ELASTIC_EXT_CHECKPOINT_DIR": "  "}, "0"),
    ({"ELASTIC_EXT_RESTART_IN_PLACE": "1"}, "0"),                                # not a setting: the launcher decides
])
def test_workers_restart_in_place_exactly_when_the_job_has_checkpoints(environ, expected):
    assert horovodrun.restart_in_place_when_checkpointing(environ) is (expected == "1")
    assert environ["ELASTIC_EXT_RESTART_IN_PLACE"] == expected


def test_a_keeper_can_tell_whether_its_slot_is_still_in_the_job(changed, monkeypatch):
    job = started_job()
    try:
        watch_env(monkeypatch, job)
        assert sorted(job.store(round_watch.ASSIGNED).decode().split(",")) == [f"{h}:{s}" for h, s in SLOTS]
        env = worker_env(job, "host-b", 1)
        assert round_watch.slot_assigned(env) is True
        # host-b loses both workers in a round: it is blacklisted and its slots leave the job
        assert a_host_loses_both_workers(job, "host-b", "host-a") == [(0, 2), (1, 2)]
        assert round_watch.slot_assigned(env) is False
        assert round_watch.slot_assigned({**env, "HOROVOD_HOSTNAME": "host-a"}) is True
    finally:
        job.stop()


def test_a_worker_reads_whether_its_round_left_capacity_out(changed):
    job = started_job()
    try:
        env = worker_env(job, "host-b", 1)
        assert round_watch.capacity_left_out(env) is False
        a_worker_of_host_a_dies_in_a_round(job)
        assert round_watch.capacity_left_out(env) is True
        assert round_watch.capacity_left_out({**env, "HOROVOD_GLOO_RENDEZVOUS_PORT": "1"}) is False  # unreachable
        assert round_watch.capacity_left_out({}) is False  # outside an elastic horovodrun
    finally:
        job.stop()


def test_without_the_drivers_rounds_a_keeper_is_not_told(monkeypatch):
    job = started_job()
    try:
        env = worker_env(job, "host-b", 1)
        assert round_watch.slot_assigned(env) is None
    finally:
        job.stop()


def horovodrun_args(*argv):
    """horovodrun's own parse of ``argv`` (it reads sys.argv)."""
    from unittest import mock

    from horovod.runner import launch
    with mock.patch("sys.argv", ["horovodrun", *argv]):
        return launch.parse_args()


@pytest.mark.parametrize("argv, environ, crashes", [
    (["--cycle-time-ms", "5"], {"HOROVOD_FUSION_THRESHOLD": "0"}, True),
    (["--fusion-threshold-mb", "0", "--cycle-time-ms", "5"], {}, True),
    ([], {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "5"}, True),
    ([], {"HOROVOD_FUSION_THRESHOLD": "0"}, False),                          # one fixed: no crash
    (["--cycle-time-ms", "5"], {}, False),
    ([], {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": ""}, False),  # empty is unset
])
def test_an_elastic_job_whose_workers_would_crash_at_a_reset_is_refused(argv, environ, crashes):
    # Found by the job tiers: with both set, each survivor of a SIGKILL died in its next hvd.init().
    args = horovodrun_args("-np", "2", "--min-np", "1", "--host-discovery-script", "d.sh", *argv, "python", "t.py")
    why = command_line.crashing_tuning(args, environ, patches=())
    assert (why is not None) is crashes, why
    if crashes:
        assert "--cycle-time-ms" in why or "HOROVOD_CYCLE_TIME" in why, why
        assert "set one of them" in why and horovod_seam.TUNING_FIX in why
    # A Horovod built with the fix (tools/horovod_patches/) takes both.
    assert command_line.crashing_tuning(args, environ, patches=("01-x", horovod_seam.TUNING_FIX)) is None


def test_the_launcher_refuses_both_tuning_values_exactly_where_its_horovod_lacks_the_fix(tmp_path):
    """Against the installed Horovod: one built by tools/setup.sh with the fix runs the job (its one worker
    joins the elastic job and writes the marker); one without it exits before starting a worker."""
    marker = tmp_path / "started"
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:1\n")
    discover.chmod(0o755)
    script = tmp_path / "worker.py"
    script.write_text(f"import horovod.torch as hvd\nhvd.init()\nopen({str(marker)!r}, 'w')\n")
    env = dict(os.environ, HOROVOD_FUSION_THRESHOLD="0", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-m", "elastic_ext.launch.horovodrun", "-np", "1", "--min-np", "1",
                           "--network-interfaces", "lo", "--host-discovery-script", str(discover),
                           "--cycle-time-ms", "5", sys.executable, str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    if horovod_seam.TUNING_FIX in horovod_seam.build_patches():
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert marker.exists()
    else:
        assert proc.returncode != 0
        assert "HOROVOD_FUSION_THRESHOLD and --cycle-time-ms are both set" in proc.stderr, proc.stderr
        assert not marker.exists()


# ------------------------------------------- a failure while a newcomer starts

def a_newcomer_starts_in_host_b_1(job, typical_start_s):
    """host-b[1] fails; the survivors' round forms, and their early start starts its new worker.
    The job's workers took ``typical_start_s`` to start (what the driver measured, set here)."""
    asks, threads = in_threads(*[lambda s=s: job.rank_and_size(*s) for s in SLOTS if s != ("host-b", 1)])
    waiting_in_the_barrier(job, 3)
    job.exits[("host-b", 1)].set()
    for thread in threads:
        thread.join(30)
    assert sorted(asks) == [(0, 3), (1, 3), (2, 3)], asks
    survivors_ask_again(job, lost=("host-b", 1))
    assert job.started.count(("host-b", 1)) == 2, job.started
    ext = driver_state.state_of(job.driver)
    with ext.lock:  # instead of the threads' starts, which took milliseconds
        ext.starts.clear()
        ext.other_starts.clear()
        ext.starts.append(typical_start_s)
    return next(w for w in reversed(job.workers) if (w[0].hostname, w[0].local_rank) == ("host-b", 1))


def host_a_1_fails_while_the_others_reset(job):
    """host-a[1] fails while host-a[0] and host-b[0] ask for their ranks (their reset); returns the threads."""
    asks, threads = in_threads(lambda: job.rank_and_size("host-a", 0), lambda: job.rank_and_size("host-b", 0))
    waiting_in_the_barrier(job, 2)
    job.exits[("host-a", 1)].set()
    return asks, threads


def test_a_failure_does_not_wait_for_a_newcomer_that_has_just_started(changed):
    job = started_job()
    try:
        newcomer = a_newcomer_starts_in_host_b_1(job, typical_start_s=30.0)
        asks, threads = host_a_1_fails_while_the_others_reset(job)
        key = round_watch.dismissed_key("host-b", 1)
        assert wait_for(lambda: job.store(key) == b"1"), "the starting newcomer was not dismissed"
        _, died, code = newcomer
        code[0] = exit_codes.DISMISSED  # what the newcomer does when it reads its key
        died.set()
        for thread in threads:
            thread.join(30)
        assert sorted(asks) == [(0, 2), (1, 2)], asks
        assert not job.driver._host_manager.is_blacklisted("host-b"), "a dismissal is not a lost host"
        assert driver_state.state_of(job.driver).regrow, "the dismissed slot and the failed one come back later"
    finally:
        job.stop()


@pytest.mark.parametrize("why", ["far into its start", "announced"])
def test_a_failure_waits_for_a_newcomer_far_into_its_start_or_that_announced_itself(changed, why):
    job = started_job()
    try:
        newcomer = a_newcomer_starts_in_host_b_1(job, typical_start_s=0.01 if why == "far into its start" else 30.0)
        if why == "announced":
            prestart.put(f"{job.url}/{prestart.SCOPE}/{newcomer[0].rank}")
        asks, threads = host_a_1_fails_while_the_others_reset(job)
        # recorded after the driver decided about the newcomer
        assert wait_for(lambda: len(job.driver._worker_registry.get("FAILURE")) == 1), "the failure was not recorded"
        late, late_thread = in_threads(lambda: job.rank_and_size("host-b", 1))  # the newcomer asks: it joins
        for thread in threads + late_thread:
            thread.join(30)
        assert sorted(asks + late) == [(0, 3), (1, 3), (2, 3)], asks + late
        assert job.store(round_watch.dismissed_key("host-b", 1)) is None
    finally:
        job.stop()


@pytest.mark.parametrize("elapsed, typical, going_on, expected", [
    ([0.5], 3.0, 2, True),          # 2 idle for 2.5 s against 0.5 s of one slot
    ([2.2], 3.0, 2, False),         # 2 idle for 0.8 s against 2.2 s
    ([1.0, 1.0], 3.0, 2, True),     # 2 x 2 s against 2 x 1 s
    ([0.2, 2.9], 3.0, 2, True),     # the round waits for the least advanced: 2 x 2.8 s against 0.2 + 2.9 s
    ([2.5, 2.9], 3.0, 2, False),    # 2 x 0.5 s against 5.4 s
    ([0.1], 3.0, 0, False),         # nobody goes on
    ([], 3.0, 2, False),
])
def test_a_starting_worker_is_dismissed_when_waiting_costs_more_than_starting_it_again(elapsed, typical, going_on,
                                                                                        expected):
    assert driver.worth_dismissing(elapsed, typical, going_on) is expected


def test_the_wait_for_the_successors_early_start_counts_against_a_dismissal():
    assert driver.worth_dismissing([1.0], 3.0, 2, regrow_wait_s=2.0) is True    # 2 x 2 s against 1 + 2 s
    assert driver.worth_dismissing([1.0], 3.0, 2, regrow_wait_s=3.5) is False   # 2 x 2 s against 1 + 3.5 s
