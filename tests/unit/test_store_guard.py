"""The driver's rendezvous server under the launcher (elastic_ext.launch.store_guard), against Horovod's real
driver and server: no pickle from the network, the workers' keys unreadable, the launcher's keys only with the
job's secret, bodies bounded, clients only from the job's hosts.

Requests come from 127.0.0.1 (allowed: this machine); the fake hosts resolve to
addresses of 10.9.0.0/24, which this process cannot send from, so the client
rule for other addresses is checked on the server's own ``verify_request``.
"""

import base64
import http.client
import os
import pickle

import pytest

from elastic_ext.control import store
from elastic_ext.launch import job_hosts, noticed_hosts, store_guard, store_serving
from elastic_ext.worker import prestart, round_watch
from tests.unit.horovod_restore import changes  # noqa: F401 - a fixture
from tests.unit.test_horovodrun import Job
from tests.unit.test_prestart import discovered, wait_for

ADDRESSES = {"host-a": frozenset({"10.9.0.1"}), "host-b": frozenset({"10.9.0.2"}), "host-c": frozenset({"10.9.0.3"})}
SECRET = "ab" * store.SECRET_BYTES
PROJECT_KEYS = [(store.ROUND_SCOPE, store.CURRENT), (store.ROUND_SCOPE, store.ASSIGNED),
                (store.ROUND_SCOPE, store.CAPACITY_LEFT_OUT), (store.ROUND_SCOPE, "failed_1"),
                (store.ROUND_SCOPE, "dismissed_host-a:0"), (store.READY_SCOPE, store.MARKER),
                (store.READY_SCOPE, store.ASKED), (store.READY_SCOPE, "0"), (store.NOTICE_SCOPE, "host-b")]


def resolver(host):
    return ADDRESSES.get(host, frozenset())


class MakesDirectory:
    """What an attacker would PUT: loading it runs ``os.mkdir(path)``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def request(job, method, path, body=b"", headers=None, length=None):
    """(status, body) of one raw request; the Content-Length as given (``length``), else the body's."""
    connection = http.client.HTTPConnection("127.0.0.1", job.port, timeout=10)
    try:
        connection.putrequest(method, path)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        if length is not False:
            connection.putheader("Content-Length", str(len(body) if length is None else length))
        connection.endheaders(body or None)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def with_secret(secret=SECRET):
    return {store.SECRET_HEADER: secret}


@pytest.fixture
def job(monkeypatch, changes):
    store.set_job_secret(SECRET)
    # as elastic-horovodrun serves: the rules hold with reused threads
    changes("store_guard", "store_serving", "noticed_hosts", resolver=resolver)
    monkeypatch.setattr(Job, "changed", True)  # the launcher's driver
    started = Job({"host-a": 2, "host-b": 2}, 2, 4)
    started.start(4)
    try:
        assert wait_for(lambda: len(started.started) == 4)
        discovered(started, {"host-a": 2, "host-b": 2})
        yield started
    finally:
        started.stop()
        store.set_job_secret(None)


def snapshot(job):
    with job.server._httpd.cache_lock:
        return {scope: dict(keys) for scope, keys in job.server._httpd.cache.items()}


# ------------------------------------------------------------------ C1: no pickle from the network

def test_a_pickle_put_to_any_scope_creates_nothing_and_worker_addresses_answers_400(job, tmp_path):
    scopes = [store.WORKER_ADDRESSES, "global", "local_host-a", "cross_0", store.RANK_SCOPE, store.ROUND_SCOPE,
              store.READY_SCOPE, store.NOTICE_SCOPE, "anything"]
    payloads = {"base64": base64.b64encode(pickle.dumps(MakesDirectory(str(tmp_path / "b64")))),
                "raw": pickle.dumps(MakesDirectory(str(tmp_path / "raw")))}
    answers = {}
    for scope in scopes:
        for name, payload in payloads.items():
            for headers in ({}, with_secret()):
                answers[(scope, name, bool(headers))], _ = request(job, "PUT", f"/{scope}/host-a:0", payload, headers)
    assert os.listdir(tmp_path) == [], "a pickle from the network was loaded"
    assert {status for (scope, _, _), status in answers.items() if scope == store.WORKER_ADDRESSES} == {400}
    assert job.driver._worker_clients == {}, "nothing registered"
    assert store.WORKER_ADDRESSES not in snapshot(job), "a refused value is not kept"


def test_without_the_guard_horovods_handler_loads_the_pickle(tmp_path):
    """The control: what the guard prevents (Horovod's own server, as plain horovodrun runs it)."""
    started = Job({"host-a": 1}, 1, 1)
    try:
        payload = base64.b64encode(pickle.dumps(MakesDirectory(str(tmp_path / "made"))))
        with pytest.raises(http.client.RemoteDisconnected):  # the handler fails after loading it: too late
            request(started, "PUT", f"/{store.WORKER_ADDRESSES}/host-a:0", payload)
        assert os.path.isdir(tmp_path / "made")
    finally:
        started.stop()


def test_a_workers_own_registration_still_registers_and_its_key_is_never_readable(job):
    from horovod.runner.elastic.worker import WorkerNotificationManager

    manager = WorkerNotificationManager()  # what every elastic worker runs in hvd.elastic.run
    manager.init("127.0.0.1", job.port, None, "host-a", 0)
    updates = []
    manager.register_listener(type("Listener", (), {"on_hosts_updated": lambda self, *update: updates.append(update)})())
    try:
        assert ("host-a", 0) in job.driver._worker_clients  # the driver pinged it: a PingResponse was loaded
        job.driver._worker_clients[("host-a", 0)].notify_hosts_updated(123.0, 1)  # answered by an AckResponse
        assert updates == [(123.0, 1)]
        status, body = request(job, "GET", f"/{store.WORKER_ADDRESSES}/host-a:0")
        assert (status, body) == (404, b"")
        assert store.WORKER_ADDRESSES not in snapshot(job)
    finally:
        manager._service.shutdown()


def hostile_service(path):
    """A service registered as a worker's whose every answer, signed with its key, makes a directory when loaded."""
    from horovod.runner.common.util import network, secret

    class Hostile(network.BasicService):
        def _handle(self, req, client_address):
            return MakesDirectory(path)

    key = secret.make_secret_key()
    return Hostile("worker notification service", key, None), key


@pytest.mark.parametrize("guard", [True, False])
def test_the_driver_loads_no_pickle_from_a_service_registered_as_a_workers(tmp_path, guard, monkeypatch, changes):
    from horovod.runner.common.util import codec

    made = tmp_path / "made"
    service, key = hostile_service(str(made))
    if guard:
        changes("store_guard", resolver=resolver)
    monkeypatch.setattr(Job, "changed", guard)  # the launcher's driver with its guarded store
    started = Job({"host-a": 1}, 1, 1)
    try:
        value = codec.dumps_base64((service.addresses(), key), to_ascii=False)  # only builtins: passes rule 2
        if not guard:  # the control: Horovod's driver pings the service and loads its answer, then fails
            with pytest.raises(http.client.RemoteDisconnected):
                request(started, "PUT", f"/{store.WORKER_ADDRESSES}/host-a:0", value)
            assert made.is_dir()
            return
        assert request(started, "PUT", f"/{store.WORKER_ADDRESSES}/host-a:0", value)[0] == 400
        assert not made.exists()
        assert started.driver._worker_clients == {}
    finally:
        service.shutdown()
        started.stop()


def test_a_registration_is_kept_only_at_its_clients_own_address():
    from horovod.runner.common.util import codec

    value = codec.dumps_base64(({"eth0": [("10.9.0.7", 1), ("10.9.0.8", 2)]}, b"k"), to_ascii=False)
    assert store_guard.worker_addresses("h:0", value, "10.9.0.8") == ("h", 0, {"eth0": [("10.9.0.8", 2)]}, b"k")
    with pytest.raises(store_guard.Refused, match="names no address of its client 10.9.0.9"):
        store_guard.worker_addresses("h:0", value, "10.9.0.9")  # the driver would connect to another machine
    for key, bad in [("h", value), ("h:x", value), ("h:0", b"%%%"), ("h:0", codec.dumps_base64(("a", 1))),
                     ("h:0", codec.dumps_base64(({"eth0": [("10.9.0.8", "1")]}, b"k")))]:
        with pytest.raises(store_guard.Refused):
            store_guard.worker_addresses(key, bad, "10.9.0.8")


# ------------------------------------------------------------------ H1: the launcher's keys

def test_forged_writes_of_every_launcher_key_are_refused_and_change_nothing(job):
    before = snapshot(job)
    current = int(before[store.ROUND_SCOPE][store.CURRENT])
    keys = PROJECT_KEYS + [(store.ROUND_SCOPE, round_watch.failed_key(current))]
    for scope, key in keys:
        for method in ("PUT", "DELETE"):
            status, _ = request(job, method, f"/{scope}/{key}", b"1" if method == "PUT" else b"")
            assert status == 403, (method, scope, key, status)
            status, _ = request(job, method, f"/{scope}/{key}", b"1", with_secret("cd" * store.SECRET_BYTES))
            assert status == 403, ("a wrong secret", method, scope, key, status)
    for scope, key in keys:
        if scope == store.ROUND_SCOPE:  # only the driver writes it, in process: the secret does not help
            assert request(job, "PUT", f"/{scope}/{key}", b"1", with_secret())[0] == 403, key
    assert snapshot(job) == before, "a refused write changed the store"
    assert noticed_hosts.noticed == set()
    assert set(job.driver._host_manager.current_hosts.available_hosts) == {"host-a", "host-b"}
    assert not job.driver._host_manager.is_blacklisted("host-b")


def test_writes_with_the_jobs_secret_are_taken(job):
    for key in (store.MARKER, "0"):
        assert request(job, "PUT", f"/{store.READY_SCOPE}/{key}", b"1", with_secret())[0] == 200
        assert prestart.get(f"{job.url}/{store.READY_SCOPE}/{key}") == b"1"
    prestart.put(f"{job.url}/{store.READY_SCOPE}/1")  # the workers' own writer sends the secret of its process
    assert prestart.get(f"{job.url}/{store.READY_SCOPE}/1") == b"1"
    assert request(job, "PUT", f"/{store.NOTICE_SCOPE}/host-z", b"1", with_secret())[0] == 200
    assert noticed_hosts.noticed == set(), "a host discovery never listed is not recorded"
    assert request(job, "PUT", f"/{store.NOTICE_SCOPE}/host-b", b"1", with_secret())[0] == 200
    assert noticed_hosts.noticed == {"host-b"}
    assert wait_for(lambda: set(job.driver._host_manager.current_hosts.available_hosts) == {"host-a"})


def test_a_notice_without_the_secret_is_taken_only_from_an_address_of_the_host_it_names(job):
    assert store_guard.refusal("PUT", store.NOTICE_SCOPE, "host-b", "10.9.0.2", None) is None
    assert store_guard.refusal("PUT", store.NOTICE_SCOPE, "host-b", "::ffff:10.9.0.2", None) is None
    refused = store_guard.refusal("PUT", store.NOTICE_SCOPE, "host-b", "10.9.0.1", None)
    assert refused.status == 403 and "not from that host" in str(refused)
    assert store_guard.refusal("PUT", store.READY_SCOPE, store.MARKER, "10.9.0.2", None).status == 403


# ------------------------------------------------------------------ bodies, clients, Gloo's own traffic

def test_bodies_are_bounded_and_gloos_own_writes_still_work(job):
    assert request(job, "PUT", "/global/0", b"", length=store_guard.MAX_BODY_BYTES + 1)[0] == 413
    assert request(job, "PUT", "/global/0", b"x", length="-1")[0] == 400
    assert request(job, "PUT", "/global/0", b"", length=False)[0] == 400
    assert "global" not in snapshot(job)
    value = os.urandom(4096)
    assert request(job, "PUT", "/global/1", value)[0] == 200
    assert request(job, "GET", "/global/1") == (200, value)
    assert request(job, "DELETE", "/global/1")[0] == 200  # Gloo's finalize


def test_only_this_machine_and_the_listed_hosts_addresses_may_connect(job):
    verify = job.server._httpd.verify_request
    assert verify(None, ("127.0.0.1", 1)) and verify(None, ("10.9.0.1", 1)) and verify(None, ("10.9.0.2", 1))
    assert not verify(None, ("10.9.0.3", 1)) and not verify(None, ("192.0.2.1", 1))
    job.discovery.hosts = {"host-a": 2, "host-b": 2, "host-c": 1}
    assert wait_for(lambda: verify(None, ("10.9.0.3", 1))), "a host discovery lists is resolved and allowed"
    job.discovery.hosts = {"host-a": 2}
    discovered(job, {"host-a": 2})
    assert verify(None, ("10.9.0.3", 1)), "a host that left stays allowed: its workers leave through the store"


def test_a_connection_from_an_address_of_no_job_host_is_closed_unanswered(job, monkeypatch):
    monkeypatch.setattr(job_hosts.hosts, "_local", frozenset())
    monkeypatch.setattr(job_hosts.hosts, "on_this_machine", lambda address: False)  # 127.0.0.1 is no job's now
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        request(job, "GET", f"/{store.ROUND_SCOPE}/{store.CURRENT}")


def test_a_static_jobs_store_keeps_horovods_clients_and_still_bounds_bodies(job):
    from horovod.runner.http.http_server import RendezvousServer

    static = RendezvousServer()  # gloo_run without --min-np: no discovery lists its hosts
    port = static.start()
    try:
        assert static._httpd.verify_request(None, ("192.0.2.1", 1))
        assert request(type("Static", (), {"port": port}), "PUT", "/global/0", b"",
                       length=store_guard.MAX_BODY_BYTES + 1)[0] == 413
    finally:
        static.stop()
