"""The preemption-notice clients and their watcher against endpoints that answer garbage (audit M1, L2).

A raw socket server answers each request with crafted bytes: garbled HTTP,
wrongly shaped JSON, a huge body, a redirect, an answer that trickles in.
The watcher must log the first failure once and keep watching; the clients
must follow no redirect, read at most MAX_BODY_BYTES and give up at their
deadline; Azure's ``Resources`` must name this VM exactly.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from elastic_ext.worker import metadata, notices
from elastic_ext.worker.metadata import MAX_BODY_BYTES, AzureScheduledEvents, MetadataError


def http(status, body=b"", headers=()):
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class RawServer:
    """Answers each request with ``respond(path)``: bytes, or a list of bytes sent ``gap_s`` apart."""

    def __init__(self, respond, gap_s=0.0):
        self.respond, self.gap_s, self.paths = respond, gap_s, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            path = data.split(b" ", 2)[1].decode()
            self.paths.append(path)
            answer = self.respond(path)
            try:
                for piece in answer if isinstance(answer, list) else [answer]:
                    conn.sendall(piece)
                    if self.gap_s:
                        time.sleep(self.gap_s)  # the trickle under test, not synchronisation
            except OSError:
                pass  # the client hung up: what a bounded client does

    def close(self):
        self.sock.close()


@pytest.fixture
def servers():
    made = []
    yield lambda *a, **k: made.append(RawServer(*a, **k)) or made[-1]
    for server in made:
        server.close()


def azure_answers(bad_answers):
    """Azure: the VM name, then each of ``bad_answers`` for the events, then a Preempt of this VM for ever."""
    queue = list(bad_answers)
    preempt = {"DocumentIncarnation": 2, "Events": [{"EventId": "E1", "EventType": "Preempt",
                                                     "Resources": ["vm-a"], "EventStatus": "Scheduled"}]}

    def respond(path):
        if path.startswith("/metadata/instance/compute/name"):
            return http(200, b"vm-a")
        return queue.pop(0) if queue else http(200, json.dumps(preempt).encode())
    return respond


BAD_ANSWERS = [
    b"HELLO\r\n\r\n",                                                   # not HTTP
    http(200, b'{"Events": 5}'),                                        # wrong shape
    http(200, b'{"Events": ["x"]}'),
    http(200, b'{"Events": [{"EventId": [1], "EventType": "Preempt", "Resources": ["vm-a"]}]}'),
    http(200, b"[" * 100_000),                                         # over the cap, and too deep
    http(200, b"x" * (10 << 20)),                                      # 10 MB
    b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",             # too many headers
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",             # a body cut short
]


def test_the_watcher_survives_every_bad_answer_logs_once_and_acts_on_the_real_notice(servers, caplog):
    server = servers(azure_answers(BAD_ANSWERS))
    seen, stop = [], threading.Event()
    watcher = notices.Watcher(AzureScheduledEvents(server.url), seen.append, stop, retry_s=0.01)
    with caplog.at_level(logging.DEBUG, logger="elastic_ext.worker.notices"):
        watcher.start()
        watcher.join(60)
    stop.set()
    assert not watcher.is_alive(), "the watcher returns once it acted on the Preempt"
    assert [(n.kind, n.leave) for n in seen] == [("Preempt", True)]
    assert watcher.failures == len(BAD_ANSWERS)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_a_body_over_the_cap_is_an_error_and_is_not_read_whole(servers):
    server = servers(lambda path: http(200, b"x" * (10 << 20)))
    with pytest.raises(MetadataError, match=f"larger than {MAX_BODY_BYTES}"):
        metadata.request(server.url + "/latest/x", {})


def test_no_redirect_is_followed_so_the_token_never_leaves(servers):
    elsewhere = servers(lambda path: http(200, b'{"action": "terminate"}'))
    imds = servers(lambda path: http(200, b"TOKEN") if path == "/latest/api/token"
                   else http(302, b"", [f"Location: {elsewhere.url}/steal"]))
    status, _, headers = metadata.request(imds.url + "/latest/meta-data/spot/instance-action",
                                          {"X-aws-ec2-metadata-token": "TOKEN"})
    assert status == 302 and headers["Location"].endswith("/steal")
    with pytest.raises(MetadataError, match="302"):
        metadata.AwsImds(imds.url).check()
    assert elsewhere.paths == [], "the redirect was followed, with the token"


def test_an_answer_that_trickles_in_is_cut_off_at_the_deadline(servers):
    answer = http(200, b'{"a": 1}')
    server = servers(lambda path: [answer[i:i + 1] for i in range(len(answer))], gap_s=0.2)
    with pytest.raises(MetadataError, match="within 0.5s"):
        metadata.request(server.url + "/x", {}, timeout_s=0.5)


def test_azure_resources_must_name_this_vm_exactly(servers):
    event = {"EventId": "E1", "EventType": "Preempt", "Resources": "vm-a0"}   # a string, not a list
    server = servers(lambda path: http(200, b"vm-a") if "compute/name" in path
                     else http(200, json.dumps({"Events": [event]}).encode()))
    with pytest.raises(MetadataError, match="Resources a list of strings"):
        AzureScheduledEvents(server.url).check()
    event["Resources"] = ["vm-a0", "xvm-a"]
    assert AzureScheduledEvents(server.url).check() is None


def test_an_imds_token_that_could_inject_a_header_is_refused(servers):
    server = servers(lambda path: http(200, b"abc\r\nX-Evil: 1"))
    with pytest.raises(MetadataError, match="not a token"):
        metadata.AwsImds(server.url).check()
