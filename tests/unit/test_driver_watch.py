"""The driver watch (elastic_ext.runtime.driver_watch) against Horovod's real rendezvous server.

The keys are those the launcher's driver publishes (elastic_ext.worker.round_watch);
the watch's poll is called directly, with a clock the test moves, and its exit
recorded instead of ending the test process.
"""

import socket

import pytest

from elastic_ext.events import FENCED, MEMBER_FAILED, EventLog
from elastic_ext.worker import prestart, round_watch
from elastic_ext.runtime import driver_watch
from elastic_ext import exit_codes
from elastic_ext.runtime.driver_watch import FENCE_MIN_ATTEMPTS, FENCE_S, DriverWatch


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def server():
    from horovod.runner.http.http_server import KVStoreServer
    server = KVStoreServer(verbose=0)
    port = server.start_server()
    yield f"http://127.0.0.1:{port}/{round_watch.SCOPE}"
    server.shutdown_server()


def publish(base, key, value):
    prestart.put(f"{base}/{key}", value)


class Watched:
    """A DriverWatch whose cuts, exits and events the test reads."""

    def __init__(self, base):
        self.cuts, self.exits, self.clock = [], [], Clock()
        self.events = EventLog(None, lambda: 3, lambda: 4)
        self.watch = DriverWatch(base, self.cut, self.events, exit_fn=self.exits.append, clock=self.clock)

    def cut(self, reason):
        self.cuts.append(reason)
        return 2

    def named(self, name):
        return [e for e in self.events.history if e["event"] == name]


def test_a_failed_member_of_the_round_cuts_the_links_once(server):
    publish(server, round_watch.CURRENT, b"3")
    publish(server, round_watch.ASSIGNED, b"a:0,a:1,b:0")
    w = Watched(server)
    w.watch.joined()
    w.watch.check()
    assert w.cuts == []
    publish(server, round_watch.failed_key(3), b"b[0]")
    w.watch.check()
    assert len(w.cuts) == 1 and "b:0" in w.cuts[0] and "round 3" in w.cuts[0], w.cuts
    assert [(e["round"], e["member"], e["links_cut"]) for e in w.named(MEMBER_FAILED)] == [(3, "b:0", 2)]
    w.watch.check()  # the main thread has not joined a new round yet: nothing more to cut
    assert len(w.cuts) == 1


def test_a_worker_that_left_its_round_cuts_nothing(server):
    publish(server, round_watch.CURRENT, b"3")
    w = Watched(server)
    w.watch.joined()
    w.watch.left()  # handling a failure already: the links may be the next round's
    publish(server, round_watch.failed_key(3), b"b[0]")
    w.watch.check()
    assert w.cuts == []


class Driver:
    """What publish_failed reads of Horovod's driver: its registry's round (it writes through store_write)."""

    def __init__(self):
        self.round = 3
        self._worker_registry = self

    def last_rendezvous(self):
        return self.round


def test_during_an_early_start_only_a_failed_member_of_this_workers_round_counts(server, monkeypatch):
    """The driver is a round ahead while newcomers start: a newcomer that dies is not a reason to roll back,
    a member of this worker's round is, and the watch finds it in one read of its own round's key."""
    from elastic_ext.launch import driver_slots, driver_state

    driver = Driver()
    monkeypatch.setattr(driver_slots, "store_write", lambda _, key, value: publish(server, key, value))
    driver_state.state_of(driver).rounds = {3: {"a:0", "a:1"}}
    publish(server, round_watch.CURRENT, b"3")
    w = Watched(server)
    w.watch.joined()
    reads = []
    get = w.watch._get
    monkeypatch.setattr(w.watch, "_get", lambda key: reads.append(key) or get(key))
    driver.round = 4  # the early start's round: a, b and the newcomer c
    driver_state.state_of(driver).rounds[4] = {"a:0", "a:1", "c:0"}
    publish(server, round_watch.CURRENT, b"4")
    driver_slots.publish_failed(driver, "c", 0)
    w.watch.check()
    assert w.cuts == []
    driver_slots.publish_failed(driver, "a", 1)
    w.watch.check()
    assert len(w.cuts) == 1 and "a:1" in w.cuts[0]
    assert reads == [round_watch.failed_key(3)] * 2  # one request per poll


def test_between_rounds_the_driver_watch_waits_while_the_round_watch_reads(server, monkeypatch):
    """In hvd.init() of a reset the keeper's round watch alone reads the store: at a thousand workers the
    driver watch's reads of ``current`` would compete with the reset's own rendezvous. In a round, and
    between rounds without a round watch, the driver watch reads as before."""
    host_port = server.split("/")[2]
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", host_port.split(":")[0])
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", host_port.split(":")[1])
    publish(server, round_watch.CURRENT, b"3")
    w = Watched(server)
    reads = []
    get = w.watch._get
    monkeypatch.setattr(w.watch, "_get", lambda key: reads.append(key) or get(key))
    w.watch.check()
    assert reads == [round_watch.CURRENT]
    stop = round_watch.watch(reset=True, on_lost=lambda round_id: None)
    try:
        assert round_watch.watching()
        w.watch.check()
        assert reads == [round_watch.CURRENT], "the driver watch read while the round watch ran"
    finally:
        stop()
    stop()  # a second stop changes nothing
    assert not round_watch.watching()
    w.watch.check()
    w.watch.joined()
    w.watch.check()
    assert reads == [round_watch.CURRENT] * 3 + [round_watch.failed_key(3)]


def test_the_job_s_round_watches_read_the_store_at_most_about_job_reads_per_s():
    for size in (None, 1, 8, 64, 256, 1024, 4096):
        interval = round_watch.poll_interval(size)
        assert interval >= round_watch.POLL_S
        assert (size or 0) / interval <= round_watch.JOB_READS_PER_S
    assert round_watch.poll_interval(64) == round_watch.POLL_S  # a small job notices a dead peer as before
    assert round_watch.poll_interval(1024) == 1024 / round_watch.JOB_READS_PER_S


def closed_port_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/{round_watch.SCOPE}"  # nothing listens there now: refused at once


def test_a_driver_out_of_reach_fences_the_worker_after_fence_s_and_a_few_attempts():
    w = Watched(closed_port_url())
    w.watch.joined()  # cannot read the round: only the fence is left
    for step in range(FENCE_MIN_ATTEMPTS + 1):
        w.watch.check()
        assert w.exits == [], f"fenced after {step + 1} attempts within {w.clock.now - 1000.0}s"
        w.clock.now += FENCE_S / FENCE_MIN_ATTEMPTS - 0.01
    w.clock.now += 0.1
    w.watch.check()
    assert w.exits == [exit_codes.FENCED]
    fenced = w.named(FENCED)
    assert len(fenced) == 1 and fenced[0]["unreachable_s"] >= FENCE_S and fenced[0]["attempts"] > FENCE_MIN_ATTEMPTS


def test_a_long_gap_between_two_attempts_is_not_enough_to_fence():
    """A job suspended as a whole wakes with its clock far ahead: one or two failed attempts fence nobody."""
    w = Watched(closed_port_url())
    w.watch.check()
    w.clock.now += 10 * FENCE_S
    w.watch.check()
    assert w.exits == []


def test_an_answer_resets_the_count(server):
    w = Watched(server)
    reachable = w.watch.base_url
    w.watch.base_url = closed_port_url()
    for _ in range(FENCE_MIN_ATTEMPTS - 1):
        w.watch.check()
        w.clock.now += FENCE_S
    w.watch.base_url = reachable
    w.watch.check()  # the driver answers (404: no round published)
    w.watch.base_url = closed_port_url()
    w.watch.check()
    w.clock.now += FENCE_S
    w.watch.check()
    assert w.exits == []


def test_outside_an_elastic_horovodrun_there_is_no_watch(monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    assert DriverWatch.for_this_worker(lambda reason: 0, None) is None
    assert driver_watch.POLL_S <= FENCE_S / FENCE_MIN_ATTEMPTS


# ------------------------------------------------------------------ a partition, not a busy driver

@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setattr(driver_watch, "CONNECT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(driver_watch, "REQUEST_TIMEOUT_S", 0.2)


def polled_past_the_fence(w):
    """Polls as the thread would, the clock past every bound of the fence."""
    for _ in range(FENCE_MIN_ATTEMPTS + 2):
        w.watch.check()
        w.clock.now += FENCE_S


def test_a_driver_that_accepts_and_never_answers_fences_nobody(short_timeouts):
    """A stopped or busy driver: its kernel completes the handshake, the answer never comes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # never accepted, as by a SIGSTOPped driver
        w = Watched(f"http://127.0.0.1:{listener.getsockname()[1]}/{round_watch.SCOPE}")
        polled_past_the_fence(w)
    assert w.exits == [] and w.named(FENCED) == []


def test_a_driver_that_reads_the_request_and_never_answers_fences_nobody(short_timeouts):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        w = Watched(f"http://127.0.0.1:{listener.getsockname()[1]}/{round_watch.SCOPE}")
        accepted = []
        for _ in range(FENCE_MIN_ATTEMPTS + 2):
            w.watch.check()  # the handshake completes in the kernel; the request waits in the queue
            conn, _ = listener.accept()
            accepted.append(conn)
            assert conn.recv(1024).startswith(b"GET ")  # read, and left unanswered
            w.clock.now += FENCE_S
        for conn in accepted:
            conn.close()
    assert w.exits == [] and w.named(FENCED) == []


def full_listener():
    """A listening socket whose accept queue is full: the kernel drops every further SYN (a blackhole, local)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address, fillers = listener.getsockname(), []
    for _ in range(16):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(address)
        fillers.append(filler)
    probe = socket.socket()
    probe.settimeout(0.3)
    try:
        probe.connect(address)
        raise AssertionError("the accept queue of the test's listener did not fill")
    except socket.timeout:
        pass
    finally:
        probe.close()
    return listener, fillers


def test_a_blackholed_driver_fences_the_worker_as_before(short_timeouts):
    listener, fillers = full_listener()
    try:
        w = Watched(f"http://127.0.0.1:{listener.getsockname()[1]}/{round_watch.SCOPE}")
        for step in range(FENCE_MIN_ATTEMPTS - 1):
            w.watch.check()
            assert w.exits == [], f"fenced after {step + 1} unanswered handshakes"
            w.clock.now += FENCE_S / (FENCE_MIN_ATTEMPTS - 1)
        w.watch.check()
    finally:
        for sock in fillers + [listener]:
            sock.close()
    assert w.exits == [exit_codes.FENCED]
    assert "timed out" in w.named(FENCED)[0]["error"], w.named(FENCED)


def test_a_driver_whose_name_does_not_resolve_is_unreachable(short_timeouts, monkeypatch):
    def no_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_name)  # no resolver is asked: nothing leaves the machine
    w = Watched(f"http://driver-host:1/{round_watch.SCOPE}")
    while not w.exits and w.clock.now < 1000.0 + 10 * FENCE_S:
        w.watch.check()
        w.clock.now += FENCE_S / (FENCE_MIN_ATTEMPTS - 1)
    assert w.exits == [exit_codes.FENCED] and "gaierror" in w.named(FENCED)[0]["error"]


def test_an_accepted_connection_clears_the_count_of_unreachable_attempts(short_timeouts):
    w = Watched(closed_port_url())
    for _ in range(FENCE_MIN_ATTEMPTS - 1):
        w.watch.check()
        w.clock.now += FENCE_S
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        refused = w.watch.base_url
        w.watch.base_url = f"http://127.0.0.1:{listener.getsockname()[1]}/{round_watch.SCOPE}"
        w.watch.check()  # accepted, never answered: reachable
        w.watch.base_url = refused
    w.watch.check()
    w.clock.now += FENCE_S
    w.watch.check()
    assert w.exits == []
