"""How the driver's rendezvous server takes connections under the launcher (elastic_ext.launch.store_serving and
store_loop), against Horovod's real server: a listen queue sized for a job's bursts, every request read and
answered by the server's one loop, a request that waits on the driver on a thread of its own, a held request
answered without a thread, and a bad or broken client costing only its own connection.
"""

import http.client
import socket
import threading

import pytest

from elastic_ext.control import horovod_seam
from elastic_ext.launch import store_loop, store_serving, store_threads
from elastic_ext.worker import prestart
from tests.unit.horovod_restore import changes  # noqa: F401 - a fixture


def handler_class():
    """Horovod's handler, with what the tests need: a request held (PUT /hold/<s>), one that waits on the
    driver (rank_and_size, until ``release``), one that fails (GET /fail/x)."""
    from horovod.runner.http.http_server import RendezvousHandler

    class Handler(RendezvousHandler):
        timeout = 0.5  # Horovod's is 3 s: how long a request may take to arrive
        held = []
        release = threading.Event()

        def do_PUT(self):
            scope, _, hold_s = self.path[1:].partition("/")
            if scope != "hold":
                return super().do_PUT()
            self.rfile.read(int(self.headers["Content-Length"]))
            self.held.append(self.request.defer(float(hold_s), lambda: (404, b"hold ended")))

        def _get_value(self, scope, key):
            if scope == "fail":
                raise RuntimeError("a handler's own failure")
            if scope == "rank_and_size":
                self.release.wait(30)
                return b"0,1"
            return super()._get_value(scope, key)

    return Handler


@pytest.fixture
def server(changes):
    from horovod.runner.http.http_server import RendezvousServer
    changes("store_serving")
    started = RendezvousServer(verbose=0)
    handler = handler_class()
    port = started.start(handler)
    try:
        yield started, f"http://127.0.0.1:{port}", port, handler
    finally:
        handler.release.set()
        started.stop()


def raw(port, data, read=True):
    """What the server answers to the bytes ``data`` sent as they are (b"" if it closed without an answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(data)
        if not read:
            return None
        answer = b""
        while True:
            chunk = client.recv(1 << 16)
            if not chunk:
                return answer
            answer += chunk


def status(answer):
    return int(answer.split(b" ", 2)[1]) if answer else None


def threads_named(name):
    return {t for t in threading.enumerate() if t.name == name}


def test_the_listen_queue_is_sized_for_a_burst(server):
    from horovod.runner.http.http_server import RendezvousHTTPServer
    started = server[0]
    assert started._httpd.request_queue_size == store_serving.BACKLOG >= 4096
    assert horovod_seam.REPLACED[(RendezvousHTTPServer, "request_queue_size")] == 5  # socketserver's


def test_requests_are_served_by_one_loop_without_a_thread_each(server):
    started, url, _, _ = server
    before = set(threading.enumerate())
    for i in range(40):
        prestart.put(f"{url}/global/{i}", b"x%d" % i)
        assert prestart.get(f"{url}/global/{i}") == b"x%d" % i
    assert not set(threading.enumerate()) - before  # served on the thread of serve_forever, no other


def test_a_burst_of_concurrent_requests_is_answered_every_one(server):
    _, url, _, _ = server
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


def test_held_requests_take_no_thread_and_are_answered_when_released_or_when_their_hold_ends(server):
    _, url, port, handler = server
    workers = threads_named("elastic_ext-store")
    answers = {}

    def held(name, hold_s):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        connection.request("PUT", f"/hold/{hold_s}", body=b"x")
        response = connection.getresponse()
        answers[name] = (response.status, response.read())

    clients = [threading.Thread(target=held, args=(f"long{i}", 20)) for i in range(30)]
    clients.append(threading.Thread(target=held, args=("short", 0.2)))
    for client in clients:
        client.start()
    assert wait_until(lambda: len(handler.held) == 31)
    clients[-1].join(10)
    assert answers == {"short": (404, b"hold ended")}  # its hold ended; the others are still held
    prestart.put(f"{url}/global/meanwhile", b"m")      # and the store serves on meanwhile
    assert prestart.get(f"{url}/global/meanwhile") == b"m"
    assert not threads_named("elastic_ext-store") - workers  # no thread was held for any of them
    for i, answer in enumerate(handler.held):
        threading.Thread(target=answer, args=(200, b"released %d" % i)).start()  # from any thread
    for client in clients:
        client.join(10)
    released = sorted(body for name, (code, body) in answers.items() if name != "short" and code == 200)
    assert len(released) == 30 and all(body.startswith(b"released ") for body in released)


def test_a_request_that_waits_on_the_driver_has_a_thread_and_holds_up_no_other(server):
    _, url, port, handler = server
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(prestart.get(f"{url}/rank_and_size/host-a:0")))
    waiting.start()
    assert wait_until(lambda: threads_named("elastic_ext-store"))  # (a thread of its own, waiting)
    prestart.put(f"{url}/global/k", b"v")
    assert prestart.get(f"{url}/global/k") == b"v" and not answers
    handler.release.set()
    waiting.join(10)
    assert answers == [b"0,1"]


@pytest.mark.parametrize("data", [b"PUT /global/k HTTP/1.0\r\nContent-Length: 10\r\n\r\nabc",
                                  b"GET /global/k HTTP/1.0\r\nHost: x"])
def test_a_request_not_complete_within_the_handlers_timeout_is_answered_408_and_stores_nothing(server, data):
    started, url, port, _ = server
    assert status(raw(port, data)) == 408
    assert "global" not in started._httpd.cache
    prestart.put(f"{url}/global/after", b"a")
    assert prestart.get(f"{url}/global/after") == b"a"


def test_a_request_head_over_the_limit_is_answered_431(server):
    _, _, port, _ = server
    answer = raw(port, b"GET /global/k HTTP/1.0\r\nX-Long: " + b"y" * (store_loop.HEAD_MAX + 10))
    assert status(answer) == 431


def test_clients_that_hang_up_or_fail_a_handler_cost_only_their_own_connection(server):
    _, url, port, _ = server
    raw(port, b"PUT /global/k HTTP/1.0\r\nContent-Length: 100\r\n\r\nab", read=False)  # gone mid-body
    raw(port, b"GET /global/k", read=False)                                           # gone mid-head
    assert raw(port, b"GET /fail/x HTTP/1.0\r\n\r\n") == b""  # the handler failed: closed unanswered
    prestart.put(f"{url}/global/k", b"v")
    assert prestart.get(f"{url}/global/k") == b"v"


def test_the_servers_shutdown_ends_its_loop_and_closes_the_requests_it_held(changes):
    from horovod.runner.http.http_server import RendezvousServer
    changes("store_serving")
    started, handler = RendezvousServer(verbose=0), handler_class()
    port = started.start(handler)
    prestart.put(f"http://127.0.0.1:{port}/global/k", b"v")
    answers = []
    held = threading.Thread(target=lambda: answers.append(raw(port, b"PUT /hold/60 HTTP/1.0\r\n"
                                                                     b"Content-Length: 1\r\n\r\nx")))
    held.start()
    assert wait_until(lambda: handler.held)
    started.stop()  # Horovod's: shutdown() and the join of serve_forever's thread
    held.join(10)
    assert answers == [b""]  # closed unanswered: its client asks again
    assert not started._listen_thread.is_alive()


def test_idle_threads_end_and_every_queued_job_keeps_a_thread(monkeypatch):
    """The invariant of ReusedThreads: an idle thread ends after IDLE_S; a job never waits for a busy one."""
    monkeypatch.setattr(store_threads, "IDLE_S", 0.05)
    served, release = [], threading.Event()

    def job(i):
        served.append(i)
        release.wait(10)

    earlier = threads_named("elastic_ext-store")  # other tests' servers: their threads are not this one's
    threads = store_threads.ReusedThreads()
    for i in range(5):
        threads.submit(lambda i=i: job(i))  # each blocks its thread: the next must get another one
    assert wait_until(lambda: len(served) == 5)
    release.set()
    assert wait_until(lambda: threads._idle == 0 and not threads_named("elastic_ext-store") - earlier)


def wait_until(condition, bound_s=10.0):
    event = threading.Event()
    for _ in range(int(bound_s / 0.01)):
        if condition():
            return True
        event.wait(0.01)
    return condition()
