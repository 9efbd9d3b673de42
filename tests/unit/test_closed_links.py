"""A collective stuck on closed connections (elastic_ext.runtime.closed_links): real TCP connections
for ``all_closed``; the watch's look is called directly, with a clock the test moves."""

import socket
import subprocess
import sys

import pytest

from elastic_ext.exit_codes import PEERS_FAILED
from elastic_ext.runtime import closed_links
from elastic_ext.runtime.closed_links import POLL_S, STUCK_S, ClosedLinksWatch
from elastic_ext.runtime.connections import CollectiveConnections, established


def connected():
    """Two connected TCP sockets of this process (one collective link, seen from both ends)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    return client, accepted


@pytest.fixture
def pairs():
    made = [connected(), connected()]
    yield made
    for pair in made:
        for end in pair:
            end.close()


def links_of(pairs):
    ports = {end.getsockname()[1] for pair in pairs for end in pair}
    links = CollectiveConnections()
    links.known = {k for k in established(skip_ports=set()) if k[1][1] in ports}
    assert len(links.known) == 4, links.known
    return links


def test_all_closed_only_in_a_round_with_no_known_connection_established(pairs):
    links = links_of(pairs)
    assert not links.all_closed(), "not in a round yet"
    links.in_round = True
    assert not links.all_closed(), "every connection is open"
    pairs[0][0].close()  # its other end is no longer established either (CLOSE_WAIT), as after a peer's abort
    assert not links.all_closed(), "the second link is still established"
    pairs[1][1].close()
    assert links.all_closed()
    links.in_round = False
    assert not links.all_closed(), "between rounds nothing counts"
    links.in_round, links.known = True, set()
    assert not links.all_closed(), "a world of one has no connection to lose"


def test_a_reset_ends_the_round_and_an_abort_from_the_driver_watch_does_not(pairs):
    links = links_of(pairs)
    links.in_round = True
    links.abort("the driver reports a member failed")  # from the driver watch's thread
    assert links.in_round and links.all_closed(), "the main thread may still wait in the collective"
    links.before_init()
    assert not links.in_round


class Look:
    """A watch whose conditions, clock, kill and event the test sets and reads."""

    def __init__(self, kill_worker=True):
        self.now, self.waits, self.closed, self.training = 100.0, True, True, True
        self.killed, self.stuck = 0, []
        test = self

        class Links:
            known = {1, 2, 3}

            def all_closed(self):
                return test.closed

        class Liveness:
            @property
            def in_training(self):
                return test.training

        self.watch = ClosedLinksWatch(Links(), Liveness(), lambda waited, killed: self.stuck.append((waited, killed)),
                                      kill_worker, waits=lambda: self.waits, kill=self.kill, clock=lambda: self.now)

    def kill(self):
        self.killed += 1

    def look(self, after_s=POLL_S):
        self.now += after_s
        self.watch.check()


def test_a_wait_on_closed_connections_kills_the_worker_after_stuck_s_once_written():
    look = Look()
    look.look()
    for _ in range(int(STUCK_S / POLL_S) - 1):
        look.look()
        assert look.killed == 0, f"killed at {look.now}, before {STUCK_S}s of waiting"
    look.look()
    assert look.killed == 1 and look.stuck == [(pytest.approx(STUCK_S), True)]


def test_under_plain_horovodrun_the_worker_says_once_that_it_waits_and_is_not_killed():
    look = Look(kill_worker=False)
    for _ in range(3 * int(STUCK_S / POLL_S)):
        look.look()
    assert look.killed == 0 and look.stuck == [(pytest.approx(STUCK_S), False)], look.stuck
    look.closed = False  # the wait ended (Gloo's timeout): a later one is reported again
    look.look()
    look.closed = True
    for _ in range(int(STUCK_S / POLL_S) + 1):
        look.look()
    assert look.killed == 0 and len(look.stuck) == 2, look.stuck


@pytest.mark.parametrize("broken", ["waits", "closed", "training"])
def test_any_look_without_the_three_conditions_starts_the_count_again(broken):
    look = Look()
    look.look()
    look.look(STUCK_S - 1)
    setattr(look, broken, False)
    look.look()
    setattr(look, broken, True)
    look.look()
    look.look(STUCK_S - 1)
    assert look.killed == 0 and not look.stuck, f"{broken} false once must restart the count"
    look.look(1)
    assert look.killed == 1


def test_the_watch_thread_looks_again_and_again_until_stopped(monkeypatch):
    import threading
    monkeypatch.setattr(closed_links, "POLL_S", 0.01)
    look = Look()
    looked, thrice = [], threading.Event()
    look.watch.check = lambda: looked.append(1) or (len(looked) >= 3 and thrice.set())
    look.watch.start()
    assert thrice.wait(30), f"{len(looked)} looks"
    look.watch.stop()
    assert not look.watch._thread.is_alive()


def test_the_watch_ends_its_worker_from_a_thread_with_the_peers_failed_status():
    # The watch's default end, called from a thread while the main thread waits (as in a stuck
    # collective): the process ends with the status the launcher's driver does not charge to the host.
    code = ("import threading\n"
            "from elastic_ext.runtime.closed_links import end_worker\n"
            "threading.Thread(target=end_worker).start()\n"
            "threading.Event().wait()\n")
    ended = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert ended.returncode == PEERS_FAILED == 76, ended.returncode
