"""The launcher's use of the driver's store (elastic_ext.control.store): malformed values are read as absent and
stop no reader, each worker receives the job's secret on its stdin, never on a command line, and the store is
reached directly, never through a proxy.

Values are served by Horovod's own KV store server, as a forged write would
have left them in the driver's (without elastic_ext.launch.store_guard).
"""

import io
import logging
import os
import socket
import subprocess
import sys

import pytest

from elastic_ext.events import MEMBER_FAILED, EventLog
from elastic_ext.control import store
from elastic_ext.launch import worker_runs
from elastic_ext.worker import newcomer, prestart, round_watch
from elastic_ext.runtime.driver_watch import DriverWatch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "5e" * store.SECRET_BYTES


@pytest.fixture
def server(monkeypatch):
    """A store at the address a worker of an elastic horovodrun reads (its environment says where)."""
    from horovod.runner.http.http_server import KVStoreServer

    kv = KVStoreServer(verbose=0)
    port = kv.start_server()
    for name, value in {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_HOSTNAME": "a",
                        "HOROVOD_LOCAL_RANK": "0", "HOROVOD_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(store, "_warned", set())
    yield f"http://127.0.0.1:{port}"
    kv.shutdown_server()


def publish(url, scope, key, value):
    prestart.put(f"{url}/{scope}/{key}", value)


@pytest.mark.parametrize("scope, key, good, bad", [
    (store.ROUND_SCOPE, store.CURRENT, b"7", [b"7x", b"", b"-1", b"1" * 19, b" 7", "٧".encode()]),
    (store.ROUND_SCOPE, store.ASSIGNED, b"a:0,b:1", [b"a:0,b", b"a:x", b"a b:0", b"a:0,,b:1"]),
    (store.ROUND_SCOPE, "failed_3", b"b[0]", [b"b", b"b[x]", b"b[0]x"]),
    (store.ROUND_SCOPE, store.CAPACITY_LEFT_OUT, b"1", [b"0", b"yes"]),
    (store.ROUND_SCOPE, "dismissed_a:0", b"1", [b"2"]),
    (store.READY_SCOPE, store.MARKER, b"1", [b"\x00"]),
    (store.READY_SCOPE, "4", b"1", [b"11"]),
])
def test_a_malformed_value_reads_as_absent_and_is_logged_once(server, caplog, scope, key, good, bad):
    publish(server, scope, key, good)
    assert store.get(f"{server}/{scope}/{key}") == good
    with caplog.at_level(logging.WARNING, logger="elastic_ext.control.store"):
        for value in bad:
            publish(server, scope, key, value)
            assert store.get(f"{server}/{scope}/{key}") is None, value
    assert len(caplog.records) == 1 and "malformed" in caplog.records[0].getMessage()


def test_a_malformed_round_stops_no_watch_in_hvd_init(server):
    publish(server, store.ROUND_SCOPE, store.CURRENT, b"7x")
    lost = []
    stop = round_watch.watch(reset=False, on_lost=lost.append)  # raised ValueError inside hvd.init() before
    stop()
    assert lost == []
    publish(server, store.ROUND_SCOPE, store.CURRENT, b"7")
    publish(server, store.ROUND_SCOPE, round_watch.failed_key(7), b"b[0]")
    stop = round_watch.watch(reset=False, on_lost=lost.append)
    try:
        from tests.unit.test_prestart import wait_for
        assert wait_for(lambda: lost == [7], timeout_s=10), "a well-formed round is still watched"
    finally:
        stop()


def test_a_malformed_round_stops_neither_the_driver_watch_nor_a_sync(server):
    events = EventLog(None, lambda: 0, lambda: 0)
    cuts = []
    watch = DriverWatch(f"{server}/{store.ROUND_SCOPE}", lambda why: cuts.append(why) or 1, events,
                        exit_fn=lambda code: pytest.fail(f"fenced ({code}) with a driver that answers"))
    publish(server, store.ROUND_SCOPE, store.CURRENT, b"7x")
    publish(server, store.ROUND_SCOPE, store.ASSIGNED, b"a:0,b:0")
    watch.joined()  # in Recoverer.sync: raised ValueError before
    watch.check()   # the watch thread's poll: raised ValueError, and the thread died, before
    publish(server, store.ROUND_SCOPE, store.CURRENT, b"8")
    watch.joined()
    publish(server, store.ROUND_SCOPE, store.CURRENT, b"9x")
    publish(server, store.ROUND_SCOPE, round_watch.failed_key(8), b"b[0]")
    watch.check()
    assert len(cuts) == 1 and [e["member"] for e in events.history if e["event"] == MEMBER_FAILED] == ["b:0"]


def test_malformed_slots_and_markers_are_read_as_absent(server, monkeypatch):
    publish(server, store.ROUND_SCOPE, store.ASSIGNED, b"a:0,\xff\xfe")
    assert round_watch.slot_assigned() is None, "the keeper does not act on it"
    publish(server, store.ROUND_SCOPE, store.ASSIGNED, b"a:0,b:0")
    assert round_watch.slot_assigned() is True
    publish(server, store.READY_SCOPE, store.MARKER, b"garbage")
    monkeypatch.setattr(newcomer, "_first_init_done", False)
    assert newcomer.early_start_under_way() is False
    publish(server, store.READY_SCOPE, store.MARKER, b"1")
    monkeypatch.setattr(newcomer, "_first_init_done", False)
    assert newcomer.early_start_under_way() is True


# ------------------------------------------------------------------ the job's secret

def worker_command(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("from elastic_ext.control import store\n"
                      f"with open({str(tmp_path / 'seen')!r}, 'w') as out:\n"
                      "    out.write(repr((store.job_secret(), open('/proc/self/cmdline', 'rb').read())))\n")
    return (f"HOROVOD_ELASTIC=1 ELASTIC_EXT_LAUNCHER=1 ELASTIC_EXT_NOTICE_ENDPOINT=off PYTHONPATH={REPO} "
            f"{sys.executable} -m {worker_runs.WORKER_MODULE} {script}")


def test_a_worker_receives_the_jobs_secret_on_its_stdin_and_never_on_its_command_line(tmp_path):
    command = worker_command(tmp_path)
    store.set_job_secret(SECRET)
    try:
        assert worker_runs.execute(command, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    finally:
        store.set_job_secret(None)
    secret, cmdline = eval((tmp_path / "seen").read_text())
    assert secret == SECRET and SECRET.encode() not in cmdline and SECRET not in command


def test_a_worker_of_a_driver_without_a_secret_has_none(tmp_path):
    assert worker_runs.execute(worker_command(tmp_path), stdout=io.StringIO(), stderr=io.StringIO()) == 0
    assert eval((tmp_path / "seen").read_text())[0] is None


def test_a_secret_line_must_be_the_launchers(caplog):
    try:
        assert store.receive_secret(io.BytesIO(SECRET.encode() + b"\nmore")) and store.job_secret() == SECRET
        with caplog.at_level(logging.WARNING, logger="elastic_ext.control.store"):
            for line in (b"", b"x" * 64 + b"\n", SECRET.upper().encode()):
                store.set_job_secret(None)
                assert not store.receive_secret(io.BytesIO(line)) and store.job_secret() is None
        assert len(caplog.records) == 3 and "no job secret" in caplog.records[0].getMessage()
        assert store.secret_matches(None) is False
    finally:
        store.set_job_secret(None)


def test_the_store_is_reached_directly_whatever_proxy_the_environment_names(server):
    # A proxy would see the job's secret on every write. The "proxy" here listens and never answers: a
    # client that went through it would wait in its backlog until the request's timeout. A client reads
    # the environment's proxies when it is made, at import here, hence the fresh process.
    publish(server, store.ROUND_SCOPE, store.CURRENT, b"3")
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        proxy.settimeout(0)
        address = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        env = dict(os.environ, PYTHONPATH=REPO, http_proxy=address, HTTP_PROXY=address, no_proxy="", NO_PROXY="")
        url = f"{server}/{store.ROUND_SCOPE}/{store.CURRENT}"
        read = subprocess.run([sys.executable, "-c", "import sys; from elastic_ext.control import store; "
                               f"sys.stdout.write(repr(store.get({url!r})))"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert read.returncode == 0 and read.stdout == "b'3'", read.stderr[-2000:]
        with pytest.raises(BlockingIOError):
            proxy.accept()  # nobody called on the proxy
