"""How the driver's rendezvous server takes connections under the launcher (elastic_ext.launch.store_serving),
against Horovod's real server: a listen queue sized for a job's bursts, a thread reused for request after
request, and a request that waits (a rank request until its round forms) never holding up the others.
"""

import threading

import pytest

from elastic_ext.control import horovod_seam
from elastic_ext.launch import store_serving
from elastic_ext.worker import prestart
from tests.unit.horovod_restore import changes  # noqa: F401 - a fixture


def store_threads():
    return [t for t in threading.enumerate() if t.name == "elastic_ext-store"]


@pytest.fixture
def server(changes):
    from horovod.runner.http.http_server import RendezvousServer
    changes("store_serving")
    started = RendezvousServer(verbose=0)
    port = started.start()
    try:
        yield started, f"http://127.0.0.1:{port}"
    finally:
        started.stop()


def test_the_listen_queue_is_sized_for_a_burst(server):
    from horovod.runner.http.http_server import RendezvousHTTPServer
    started, _ = server
    assert started._httpd.request_queue_size == store_serving.BACKLOG >= 4096
    assert horovod_seam.REPLACED[(RendezvousHTTPServer, "request_queue_size")] == 5  # socketserver's


def test_requests_one_after_another_reuse_one_thread(server):
    """A client has its answer a moment before the thread that sent it waits for the next request: each
    request here goes out once the thread is back (a bounded wait on the pool's count), so every one of
    them must find it and none may start a thread of its own."""
    started, url = server
    before = set(store_threads())
    for i in range(40):
        prestart.put(f"{url}/global/{i}", b"x")
        assert wait_until(lambda: started._httpd._elastic_ext_threads._idle == 1)
        assert prestart.get(f"{url}/global/{i}") == b"x"
        assert wait_until(lambda: started._httpd._elastic_ext_threads._idle == 1)
    assert len(set(store_threads()) - before) == 1, [t.name for t in store_threads()]


def test_a_burst_of_concurrent_requests_is_answered_every_one(server):
    _, url = server
    answers, lock = [], threading.Lock()

    def one(i):
        prestart.put(f"{url}/global/burst{i}", str(i).encode())
        value = prestart.get(f"{url}/global/burst{i}")
        with lock:
            answers.append(value)

    clients = [threading.Thread(target=one, args=(i,)) for i in range(200)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(30)
    assert sorted(answers) == sorted(str(i).encode() for i in range(200))


def test_idle_threads_end_and_every_queued_request_keeps_a_thread(monkeypatch):
    """The invariant of ReusedThreads: an idle thread ends after IDLE_S; a request never waits for a busy one."""
    monkeypatch.setattr(store_serving, "IDLE_S", 0.05)
    served, release = [], threading.Event()

    class Server:
        def process_request_thread(self, request, client_address):
            served.append(request)
            release.wait(10)

    earlier = set(store_threads())  # other tests' servers: their threads are not this one's
    threads = store_serving.ReusedThreads(Server())
    for i in range(5):
        threads.submit(i, None)  # each blocks its thread: the next must get another one
    assert wait_until(lambda: len(served) == 5)
    release.set()
    assert wait_until(lambda: threads._idle == 0 and not set(store_threads()) - earlier)


def wait_until(condition, bound_s=10.0):
    event = threading.Event()
    for _ in range(int(bound_s / 0.01)):
        if condition():
            return True
        event.wait(0.01)
    return condition()
