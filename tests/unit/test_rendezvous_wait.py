"""The driver's rendezvous server holds a Gloo peer's read of a missing key until it is written
(elastic_ext/launch/rendezvous_wait.py), on Horovod's own server and HTTP handler."""

import threading
import urllib.error
import urllib.request

import pytest
from horovod.runner.http.http_server import RendezvousServer

from elastic_ext.launch import rendezvous_wait


@pytest.fixture
def server():
    """Horovod's rendezvous server on a free port of this machine: its base URL."""
    rendezvous = RendezvousServer()
    port = rendezvous.start()
    yield f"http://127.0.0.1:{port}"
    rendezvous.stop()


@pytest.fixture
def installed():
    rendezvous_wait.install()
    yield
    rendezvous_wait.uninstall()


def get(url):
    """(status, body) of a GET, as the C++ client sees it."""
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, b""


def put(url, body):
    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Length": str(len(body))})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.status


def read_in_thread(url):
    answers = []
    thread = threading.Thread(target=lambda: answers.append(get(url)), daemon=True)
    thread.start()
    return thread, answers


@pytest.mark.parametrize("scope", ["global", "local_localhost", "cross_0",
                                   "global_process_set_hash_512d4d557435ff2d",
                                   "cross_1_process_set_hash_512d4d557435ff2d"])
def test_a_gloo_read_of_a_missing_key_is_answered_with_the_value_once_it_is_written(server, installed, scope):
    thread, answers = read_in_thread(f"{server}/{scope}/1")
    assert rendezvous_wait.wait_for_readers(1, 30), "the read was answered before the key was written"
    assert put(f"{server}/{scope}/1", b"peer 1's address") == 200
    thread.join(30)
    assert answers == [(200, b"peer 1's address")]


def test_without_the_launcher_horovods_server_answers_404_at_once(server):
    """What the change is for: Horovod's own answer, after which its client sleeps 10 ms and asks again."""
    assert get(f"{server}/global/1") == (404, b"")


def test_a_read_of_a_key_never_written_is_404_after_the_hold(server, installed, monkeypatch):
    monkeypatch.setattr(rendezvous_wait, "HOLD_S", 0.2)
    assert get(f"{server}/global/7") == (404, b"")


def test_a_write_of_another_key_does_not_answer_the_held_read(server, installed, monkeypatch):
    thread, answers = read_in_thread(f"{server}/global/2")
    assert rendezvous_wait.wait_for_readers(1, 30)
    assert put(f"{server}/global/3", b"peer 3") == 200
    assert rendezvous_wait.wait_for_readers(1, 30), "the read stopped waiting on another key's write"
    assert answers == []
    assert put(f"{server}/global/2", b"peer 2") == 200
    thread.join(30)
    assert answers == [(200, b"peer 2")]


@pytest.mark.parametrize("scope", ["rank_and_size", "elastic_ext_round"])
def test_other_scopes_are_answered_at_once(server, installed, monkeypatch, scope):
    """A hold longer than the join below: a held read would fail the test, not slow it."""
    monkeypatch.setattr(rendezvous_wait, "HOLD_S", 600.0)
    thread, answers = read_in_thread(f"{server}/{scope}/current")
    thread.join(30)
    assert answers == [(404, b"")]


def test_uninstall_gives_horovods_answers_back(server):
    rendezvous_wait.install()
    rendezvous_wait.uninstall()
    assert get(f"{server}/global/1") == (404, b"")
