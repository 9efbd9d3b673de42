"""prestart_newcomers: newcomers start while the survivors train.

Against Horovod's real ElasticDriver and rendezvous server (the workers are
threads sending the HTTP requests that ``hvd.init()`` sends), and the
commit-level decision on ranks simulated by threads.
"""

import os
import subprocess
import sys
import threading
import time

import pytest

from elastic_ext import exit_codes
from elastic_ext.worker import horovod_changes, newcomer, prestart, round_watch
from elastic_ext.state.host_updates import HOSTS_ADDED, HOSTS_REMOVED, HostUpdates, agreement_vector, read_agreement
from elastic_ext.worker.prestart import Prestart, parse_slot

from tests.unit.horovod_restore import restore_horovod
from elastic_ext.testing import ThreadWorld


# ------------------------------------------------------- Horovod's driver


class Discovery:
    """Horovod's HostDiscovery contract over a dict the test changes."""

    def __init__(self, hosts):
        self.hosts = dict(hosts)

    def find_available_hosts_and_slots(self):
        return dict(self.hosts)


class Job:
    """Horovod's ElasticDriver and rendezvous server, as horovodrun sets them up; workers are threads."""

    def __init__(self, hosts, min_np, max_np):
        from horovod.runner.elastic.driver import ElasticDriver
        from horovod.runner.elastic.rendezvous import create_rendezvous_handler
        from horovod.runner.http.http_server import RendezvousServer

        self.discovery = Discovery(hosts)
        self.server = RendezvousServer()
        self.driver = ElasticDriver(self.server, self.discovery, min_np, max_np, timeout=30)
        self.port = self.server.start(create_rendezvous_handler(self.driver))
        self.url = f"http://127.0.0.1:{self.port}"
        self.started = []           # slot infos of the worker processes the driver started
        self.finish = threading.Event()
        self.newcomer = None        # what a worker started after the first ones does

    def start(self, num_proc):
        self.driver.wait_for_available_slots(num_proc)
        self.driver.start(num_proc, self._create_worker)

    def _create_worker(self, slot_info, events):
        self.started.append(slot_info)
        if len(self.started) > self.first_size and self.newcomer is not None:
            self.newcomer(slot_info)
        self.finish.wait(60)
        return 0, time.time()

    def rank_and_size(self, host, local_rank):
        """What hvd.init() asks: blocks until every worker of the round asked."""
        return parse_slot(prestart.get(f"{self.url}/rank_and_size/{host}:{local_rank}", timeout_s=30))

    def stop(self):
        self.finish.set()
        self.driver.stop()


def in_threads(*calls):
    results, threads = [None] * len(calls), []
    for i, call in enumerate(calls):
        def body(i=i, call=call):
            results[i] = call()
        threads.append(threading.Thread(target=body, daemon=True))
        threads[-1].start()
    return results, threads


def wait_for(predicate, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def discovered(job, host_slots):
    """Waits until the driver's host discovery has seen ``host_slots`` (it polls every second)."""
    assert wait_for(lambda: job.driver._host_manager.current_hosts.host_slots == host_slots), \
        f"the driver never saw {host_slots}: {job.driver._host_manager.current_hosts}"


def waiting_in_the_barrier(job, count):
    """Waits until ``count`` workers asked for their ranks and wait in the driver's barrier for the others."""
    from horovod.runner.elastic.registration import READY
    assert wait_for(lambda: job.driver._worker_registry.count(READY) == count), \
        f"{count} workers never waited in the barrier: {job.driver._worker_registry.get_recorded_slots()}"


@pytest.fixture
def job():
    job = Job({"host-a": 2}, 2, 4)
    job.first_size = 2
    job.start(2)
    ranks, threads = in_threads(lambda: job.rank_and_size("host-a", 0), lambda: job.rank_and_size("host-a", 1))
    for thread in threads:
        thread.join(20)
    assert sorted(ranks) == [(0, 2), (1, 2)]
    yield job
    job.stop()


def test_horovods_driver_starts_newcomers_only_after_every_worker_asks_again(job):
    """The reason survivors stand idle: without a new rank request, no newcomer is started."""
    job.discovery.hosts["host-b"] = 2
    discovered(job, {"host-a": 2, "host-b": 2})
    assert len(job.started) == 2


def test_newcomers_start_and_announce_while_the_survivors_have_not_reset(job):
    newcomer_ranks = []

    def new_worker(slot_info):  # a newcomer: announce itself (model built), then its reset asks for its rank
        def body():
            prestart.put(f"{job.url}/{prestart.SCOPE}/{slot_info.rank}")
            newcomer_ranks.append(job.rank_and_size(slot_info.hostname, slot_info.local_rank))
        threading.Thread(target=body, daemon=True).start()

    job.newcomer = new_worker
    job.discovery.hosts["host-b"] = 2
    discovered(job, {"host-a": 2, "host-b": 2})
    survivors = [Prestart(job.url, "host-a", lr, poll=(lr == 0), timeout_s=60).start() for lr in (0, 1)]
    assert wait_for(lambda: survivors[0].ready()), "rank 0 never saw every rank of the next world"
    assert survivors[0].why == "all_there"
    assert [(p.next_rank, p.next_size) for p in survivors] == [(0, 4), (1, 4)]
    assert not survivors[1].ready()  # only rank 0 polls; the commit's allreduce tells the others
    assert sorted((s.hostname, s.local_rank) for s in job.started[2:]) == [("host-b", 0), ("host-b", 1)]
    waiting_in_the_barrier(job, 2)
    assert newcomer_ranks == []  # the newcomers wait in hvd.init() for the survivors' reset
    # The reset: the survivors' hvd.init() asks again and meets the waiting newcomers.
    ranks, threads = in_threads(lambda: job.rank_and_size("host-a", 0), lambda: job.rank_and_size("host-a", 1))
    for thread in threads:
        thread.join(20)
    assert wait_for(lambda: len(newcomer_ranks) == 2)
    assert sorted(ranks + newcomer_ranks) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert len(job.started) == 4  # no worker was started twice


def test_a_survivor_whose_slot_goes_away_learns_it_at_once(job):
    job.newcomer = lambda slot_info: prestart.put(f"{job.url}/{prestart.SCOPE}/{slot_info.rank}")
    job.discovery.hosts = {"host-a": 1, "host-b": 2}  # host-a shrinks while host-b comes
    discovered(job, {"host-a": 1, "host-b": 2})
    survivors = [Prestart(job.url, "host-a", lr, poll=(lr == 0), timeout_s=60).start() for lr in (0, 1)]
    assert wait_for(lambda: survivors[0].ready() and survivors[1].ready())
    assert (survivors[1].why, survivors[1].next_rank) == ("removed", -1)  # it leaves at the resize
    assert (survivors[0].why, survivors[0].next_size) == ("all_there", 3)


# ------------------------------------------------------- the newcomer side


def newcomer_env(job, rank, host, local_rank):
    return {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(job.port), "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "3",
            "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "2",
            "HOROVOD_CROSS_SIZE": "3", "HOROVOD_HOSTNAME": host}


@pytest.fixture
def solo_state(monkeypatch):
    """Puts back what a newcomer's start changes in this process."""
    from horovod.common.process_sets import global_process_set
    monkeypatch.setattr(global_process_set, "ranks", global_process_set.ranks)
    monkeypatch.setattr(newcomer, "_first_init_done", False)
    monkeypatch.setattr(newcomer, "_launch", None)


def test_without_an_early_start_a_first_init_starts_as_launched(job, solo_state):
    env = newcomer_env(job, 2, "host-b", 0)
    assert newcomer.early_start_under_way(env) is False  # a job's start: no marker in the store


def test_a_round_watch_is_paced_by_the_size_of_the_job_it_watches(monkeypatch, solo_state):
    """The first init's round watch reads at the pace of the size the worker was launched with; a reset's,
    at the pace of the size the last init gave (round_watch.poll_interval)."""
    from elastic_ext.worker import keeper
    monkeypatch.setattr(newcomer, "_round_size", None)
    monkeypatch.setattr(keeper, "active", lambda: True)
    monkeypatch.setattr(newcomer, "early_start_under_way", lambda environ=None: False)
    monkeypatch.setenv("HOROVOD_SIZE", "1024")
    paced = []
    monkeypatch.setattr(round_watch, "watch",
                        lambda reset, on_lost, size: paced.append((reset, size)) or (lambda: None))
    sizes = iter([1000, 600])
    for _ in range(2):
        newcomer.init(lambda: None, lambda: 0, lambda: next(sizes), lambda size: None)
    assert paced == [(False, 1024), (True, 1000)]


class ResettingBinding:
    """What binding.reset() does in Horovod's C++: the rank request of a re-initialisation."""

    def __init__(self, job, env):
        self.job, self.env, self.answer = job, env, None

    def reset(self):
        self.answer = self.job.rank_and_size(self.env["HOROVOD_HOSTNAME"], int(self.env["HOROVOD_LOCAL_RANK"]))


def test_a_newcomer_builds_its_model_solo_then_joins_the_survivors_reset(job, solo_state):
    from horovod.common.process_sets import global_process_set
    seen, bindings = {}, {}

    def new_worker(slot_info):
        # A real newcomer starts Python and imports its framework first
        # (seconds), by which time the survivors have put the early-start marker.
        assert wait_for(lambda: prestart.get(f"{job.url}/{prestart.SCOPE}/{prestart.MARKER}") is not None)
        env = newcomer_env(job, slot_info.rank, slot_info.hostname, slot_info.local_rank)
        assert newcomer.early_start_under_way(env) is True
        # Horovod's init, as a world of one, as the worker's init wrapper runs it (horovod_changes)
        newcomer.start_solo(lambda: seen.update(init_env=dict(env)), env, horovod_changes.hold_global_ranks)
        seen.update(after=dict(env), ranks=list(global_process_set.ranks))
        # (It builds its model here: the survivors go on training and do not see it yet.)
        seen["ready_before_join"] = prestart.get(f"{job.url}/{prestart.SCOPE}/{slot_info.rank}")
        bindings[slot_info.rank] = ResettingBinding(job, env)
        assert newcomer.join(bindings[slot_info.rank], env) is True

    job.newcomer = lambda slot_info: threading.Thread(target=new_worker, args=(slot_info,), daemon=True).start()
    job.discovery.hosts["host-b"] = 1
    discovered(job, {"host-a": 2, "host-b": 1})
    survivors = [Prestart(job.url, "host-a", lr, poll=(lr == 0), timeout_s=60).start() for lr in (0, 1)]
    assert wait_for(lambda: survivors[0].ready()) and survivors[0].why == "all_there"
    init_env = seen["init_env"]
    assert (init_env["HOROVOD_RANK"], init_env["HOROVOD_SIZE"]) == ("0", "1")  # solo
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in init_env  # Gloo's in-memory store, not the job's server
    assert seen["after"] == newcomer_env(job, 2, "host-b", 0)  # the launch environment is back
    assert seen["ranks"] == [0, 1, 2] and seen["ready_before_join"] is None
    ranks, threads = in_threads(lambda: job.rank_and_size("host-a", 0), lambda: job.rank_and_size("host-a", 1))
    for thread in threads:
        thread.join(20)
    assert sorted(ranks) == [(0, 3), (1, 3)]
    assert wait_for(lambda: 2 in bindings and bindings[2].answer is not None)
    assert bindings[2].answer == (2, 3)  # the newcomer's reset met the survivors' in one round
    assert newcomer.join(bindings[2]) is False  # joined once


DISMISSAL_CHILD = """
import sys, time
from elastic_ext.worker import newcomer
print(newcomer.watch_dismissal(), flush=True)
if sys.argv[1] == "announce":
    newcomer.stop_watching()  # what join() does before the newcomer announces itself
    print("announced", flush=True)
sys.stdin.readline()  # until the test is done with it (or dismissed before)
"""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def starting_newcomer(job, then):
    env = dict(os.environ, PYTHONPATH=REPO, **newcomer_env(job, 2, "host-b", 0))
    child = subprocess.Popen([sys.executable, "-c", DISMISSAL_CHILD, then], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return child, child.stdout.readline().strip()


def dismiss(job, host, local_rank):
    """What the launcher's driver writes when it dismisses a starting worker (elastic_ext.launch.driver)."""
    prestart.put(f"{job.url}/{round_watch.SCOPE}/{round_watch.dismissed_key(host, local_rank)}")


def test_a_starting_newcomer_exits_when_the_driver_dismisses_it(job):
    prestart.put(f"{job.url}/{prestart.SCOPE}/{prestart.MARKER}")  # the survivors started it early
    child, watching = starting_newcomer(job, "start")
    try:
        assert watching == "True"
        dismiss(job, "host-a", 1)  # another slot's dismissal is not its own
        dismiss(job, "host-b", 0)
        child.wait(timeout=30)  # its stdin stays open: only the dismissal ends it
        err = child.stderr.read()
    finally:
        child.kill()
    assert child.returncode == exit_codes.DISMISSED, err
    assert "dismissed this worker of host-b[0] while it started" in err


def test_a_newcomer_that_announced_itself_or_a_worker_of_the_jobs_start_is_never_dismissed(job):
    child, watching = starting_newcomer(job, "start")  # no marker: the job's start, no early start
    child.communicate("\n", timeout=30)
    assert (watching, child.returncode) == ("False", 0)
    prestart.put(f"{job.url}/{prestart.SCOPE}/{prestart.MARKER}")
    child, watching = starting_newcomer(job, "announce")
    try:
        assert watching == "True" and child.stdout.readline().strip() == "announced"
        dismiss(job, "host-b", 0)
        # Its reading thread has stopped: the key is there, and the process goes on until told.
        assert wait_for(lambda: child.poll() is not None, timeout_s=1.0) is False
        child.communicate("\n", timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0


def test_while_solo_horovods_queries_answer_the_launch_values(monkeypatch, solo_state):
    import horovod.torch as hvd
    from horovod.common import basics
    env = {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1"}
    before = [getattr(owner, name) for owner in (basics.HorovodBasics, hvd) for name in ("init", *newcomer.QUERIES)]
    try:
        assert horovod_changes.install_worker(env)
        wrapped = basics.HorovodBasics.init
        assert horovod_changes.install_worker(env) and basics.HorovodBasics.init is wrapped  # once only
        monkeypatch.setattr(newcomer, "_launch", dict(zip(newcomer.SLOT_VARIABLES, ("5", "8", "1", "2", "2", "4"))))
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) \
            == (5, 8, 1, 2, 2, 4)
        monkeypatch.setattr(newcomer, "_launch", None)
        with pytest.raises(ValueError, match="not been initialized"):
            hvd.rank()  # after joining, Horovod's own answer (here: not initialised)
    finally:
        restore_horovod()
    names = ("init", *newcomer.QUERIES)
    assert before == [getattr(owner, name) for owner in (basics.HorovodBasics, hvd) for name in names]


def test_outside_an_elastic_horovodrun_the_worker_wraps_only_init_for_the_collective_wait():
    from horovod.common import basics
    before = {name: getattr(basics.HorovodBasics, name) for name in ("init", *newcomer.QUERIES)}
    try:
        assert horovod_changes.install_worker({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"})
        wrapped = basics.HorovodBasics.init
        assert wrapped is not before["init"] and wrapped.__wrapped__ is before["init"]
        assert all(getattr(basics.HorovodBasics, name) is before[name] for name in newcomer.QUERIES)
    finally:
        restore_horovod()
    assert basics.HorovodBasics.init is before["init"]


def test_a_bad_rank_answer_names_the_value():
    with pytest.raises(ValueError, match="'garbage'"):
        parse_slot(b"garbage")
    assert parse_slot(b"-1,-1,-1,-1,-1,-1") == (-1, -1)


def test_an_early_start_gives_up_after_its_timeout():
    now = [0.0]
    waiting = Prestart("http://127.0.0.1:1", "h", 0, poll=True, timeout_s=5.0, clock=lambda: now[0])
    assert not waiting.ready()
    now[0] = 5.5
    assert waiting.ready() and waiting.why == "timeout"


def test_a_failed_request_makes_it_ready_so_the_job_resets():
    failed = Prestart("http://127.0.0.1:1", "h", 0, poll=True, timeout_s=60).start()  # nothing listens on port 1
    assert wait_for(failed.ready, 15) and failed.why.startswith("error: ")


# ------------------------------------------------------- the commit decision


class Manual(Prestart):
    """A Prestart whose readiness the test sets (no rendezvous server)."""

    def __init__(self, rank):
        super().__init__("http://unused", "h", rank, poll=rank == 0, timeout_s=1e9)
        self.cancelled = False

    def start(self):
        return self

    def cancel(self):
        self.cancelled = True


def ranks_with_prestart(size, overlap):
    world = ThreadWorld(size)
    made = [[] for _ in range(size)]

    def factory(rank):
        def make():
            made[rank].append(Manual(rank))
            return made[rank][-1]
        return make

    hosts = [HostUpdates(overlap=overlap, prestart=factory(r)) for r in range(size)]
    bindings = [world.binding(r) for r in range(size)]
    commit_id = [0]

    def commit():
        commit_id[0] += 1
        return world.run(lambda r: hosts[r].agree(bindings[r], commit_id[0], False)[0])

    return hosts, made, commit


@pytest.mark.parametrize("overlap", [False, True])
def test_an_addition_keeps_training_until_every_newcomer_waits(overlap):
    hosts, made, commit = ranks_with_prestart(3, overlap)
    hosts[0].put(100, HOSTS_ADDED)  # Horovod notifies the coordinator only
    lag = 1 if overlap else 0
    for _ in range(2 + lag):
        assert commit() == [None] * 3  # no reset: training goes on
    assert [len(m) for m in made] == [1, 1, 1]  # every rank started one early start, at the same commit
    for _ in range(3):
        assert commit() == [None] * 3
    # While the early start is under way no collective is left in flight: the commit that carries
    # "all there" resizes at once, with or without overlapped commits.
    assert all(h._in_flight is None for h in hosts)
    made[0][0].finish("all_there")  # rank 0 saw every newcomer
    assert commit() == [False] * 3  # every rank resizes at the same commit, with a sync for the newcomers
    assert [h.joined.why for h in hosts] == ["all_there", "agreed", "agreed"]
    assert all(m[0].cancelled for m in made)
    assert commit() == [None] * 3  # acted on once


def test_a_removal_during_an_early_start_resizes_at_once_with_a_sync():
    hosts, made, commit = ranks_with_prestart(2, False)
    hosts[0].put(100, HOSTS_ADDED)
    assert commit() == [None, None]
    hosts[0].put(200, HOSTS_REMOVED)
    assert commit() == [False, False]  # the newcomers are counted in the next world: they need the state
    assert [h.joined.why for h in hosts] == ["interrupted", "interrupted"]


def test_a_second_addition_joins_the_early_start_under_way():
    hosts, made, commit = ranks_with_prestart(2, False)
    hosts[0].put(100, HOSTS_ADDED)
    assert commit() == [None, None]
    hosts[0].put(200, HOSTS_ADDED)
    assert commit() == [None, None]
    assert [len(m) for m in made] == [1, 1]


def test_a_reset_cancels_the_early_start():
    hosts, made, commit = ranks_with_prestart(2, False)
    hosts[0].put(100, HOSTS_ADDED)
    assert commit() == [None, None]
    for h in hosts:
        h.clear()  # a failure's reset: the driver already counts the newcomers in
    assert all(m[0].cancelled for m in made) and all(h.prestart is None for h in hosts)
    assert commit() == [None, None]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_round_that_left_capacity_out_starts_the_newcomers_at_the_sync_not_at_a_commit(overlap):
    hosts, made, commit = ranks_with_prestart(3, overlap)
    for h in hosts:
        h.capacity_left_out = lambda: True  # the driver formed the survivors' round without the failed slot
    assert [h.start_for_capacity_left_out() for h in hosts] == [True] * 3
    assert [len(m) for m in made] == [1, 1, 1], "every rank starts the early start before its first commit"
    assert [h.start_for_capacity_left_out() for h in hosts] == [False] * 3, "one under way: no second"
    hosts[0].put(100, HOSTS_ADDED)  # the driver's notification of the same capacity, arriving later
    for _ in range(3):
        assert commit() == [None] * 3  # it joins the early start under way; training goes on
    assert [len(m) for m in made] == [1, 1, 1]
    made[0][0].finish("all_there")
    assert commit() == [False] * 3  # the resize with the newcomers, at one commit on every rank


def test_a_round_with_all_its_capacity_starts_nothing_at_the_sync():
    hosts, made, _ = ranks_with_prestart(2, False)
    hosts[0].capacity_left_out = lambda: False
    assert hosts[0].start_for_capacity_left_out() is False
    assert hosts[1].start_for_capacity_left_out() is False  # outside the launcher: nobody to ask
    assert made == [[], []]


def test_without_an_elastic_horovodrun_an_addition_resizes_at_once():
    world = ThreadWorld(2)
    hosts = [HostUpdates(prestart=lambda: None) for _ in range(2)]
    hosts[0].put(100, HOSTS_ADDED)
    assert world.run(lambda r: hosts[r].agree(world.binding(r), 1, False)[0]) == [False, False]


def test_the_vector_carries_the_ready_flag_before_the_extra():
    reduced = agreement_vector(7, 100, HOSTS_ADDED, False, extra=[5, 6], newcomers_ready=True)
    agreed = read_agreement(reduced, 7, has_extra=True)
    assert (agreed.newest, agreed.added, agreed.removed, agreed.newcomers_ready) == (100, True, False, True)
    assert list(agreed.extra) == [5, 6]
