"""A local HTTP server that answers as AWS, GCP and Azure document their instance metadata endpoints.

No package emulates these (moto's server answers a fixed ``instance-action:
none`` and has no ``spot/instance-action`` to schedule), so the tests of
:mod:`elastic_ext.worker.notices` use this one. It plays several machines at
once: the path's first segment names the machine (the base URL workers get
is ``http://127.0.0.1:PORT/{host}``, :data:`ENV` fills in their host name),
and what follows is exactly a documented path, answered as documented:

- AWS IMDSv2: ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds``
  (1 to 21600, else 400) and answers a token with that header; every ``GET``
  under ``/latest/`` needs a live token in ``X-aws-ec2-metadata-token``
  (else 401). ``spot/instance-action`` and ``events/recommendations/rebalance``
  are 404 until announced, then ``{"action": ..., "time": ...}`` and
  ``{"noticeTime": ...}``.
- GCP: ``/computeMetadata/v1/instance/preempted`` needs ``Metadata-Flavor:
  Google`` (else 403), answers ``FALSE`` or ``TRUE`` with ``Metadata-Flavor``
  and ``ETag`` headers, and with ``wait_for_change=true`` holds the request
  until the value's ETag differs from ``last_etag`` (or ``timeout_sec``).
- Azure: ``/metadata/scheduledevents`` and ``/metadata/instance/compute/name``
  need ``Metadata: true`` and ``api-version`` (else 400); the first answers
  ``{"DocumentIncarnation": n, "Events": [...]}``.

:meth:`MetadataServer.announce` schedules a notice; :attr:`MetadataServer.served`
records when each machine's notice was first answered (the detection time).
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import secrets
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

ENV = "ELASTIC_EXT_NOTICE_ENDPOINT"   # elastic_ext.config.ENV_NOTICE_ENDPOINT
MAX_TTL_S = 21600


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


class Machine:
    """What one machine's metadata endpoints say now."""

    def __init__(self, name: str) -> None:
        self.vm_name = f"vm-{name}"
        self.tokens: Dict[str, float] = {}                    # AWS token -> monotonic expiry
        self.instance_action: Optional[Dict[str, str]] = None
        self.rebalance: Optional[Dict[str, str]] = None
        self.preempted = "FALSE"
        self.incarnation = 1
        self.events: List[Dict[str, Any]] = []


class MetadataServer:
    """The server (see the module docstring); ``with MetadataServer() as server:`` starts and stops it."""

    def __init__(self) -> None:
        self.machines: Dict[str, Machine] = {}
        self.served: Dict[Tuple[str, str], float] = {}        # (machine, cloud) -> first notice answered
        self.announced: Dict[Tuple[str, str], float] = {}     # (machine, cloud) -> announce() time
        self.log: List[Tuple[str, str, str, int]] = []         # (machine, method, path, status)
        self.held = 0                                          # GCP requests held by wait_for_change now
        self.changed = threading.Condition()
        server = self
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"server_state": server}))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="metadata-server",
                                        daemon=True)

    def __enter__(self) -> "MetadataServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.changed:
            self.changed.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/{{host}}"

    def env_value(self, clouds: Tuple[str, ...] = ("aws", "gcp", "azure")) -> str:
        """The value of :data:`ENV` that makes workers watch these clouds here."""
        return ",".join(f"{cloud}={self.base_url}" for cloud in clouds)

    def machine(self, name: str) -> Machine:
        with self.changed:
            return self.machines.setdefault(name, Machine(name))

    def announce(self, name: str, cloud: str, kind: str = "") -> None:
        """Schedules a notice for machine ``name``: aws ``kind`` "terminate" (default), "stop", "hibernate"
        or "rebalance"; gcp: preempted; azure ``kind`` "Preempt" (default) or another EventType, for this VM."""
        machine, now = self.machine(name), time.time()
        with self.changed:
            if cloud == "aws" and kind == "rebalance":
                machine.rebalance = {"noticeTime": _iso(now)}
            elif cloud == "aws":
                machine.instance_action = {"action": kind or "terminate", "time": _iso(now + 120)}
            elif cloud == "gcp":
                machine.preempted = "TRUE"
            elif cloud == "azure":
                self.add_azure_event(machine, kind or "Preempt", [machine.vm_name], now)
            else:
                raise ValueError(f"cloud {cloud!r} must be aws, gcp or azure")
            self.announced[(name, cloud)] = now
            self.changed.notify_all()

    def add_azure_event(self, machine: Machine, kind: str, resources: List[str], now: float) -> None:
        """An Azure Scheduled Event in ``machine``'s document (``resources``: the VMs it names)."""
        machine.events.append({
            "EventId": str(uuid.uuid4()).upper(), "EventType": kind, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": "Scheduled",
            "NotBefore": email.utils.formatdate(now + 30, usegmt=True), "Description": "",
            "EventSource": "Platform", "DurationInSeconds": -1})
        machine.incarnation += 1

    def wait_held(self, timeout_s: float) -> None:
        """Waits until some GCP request is held by ``wait_for_change`` (at most ``timeout_s``)."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.held > 0, timeout_s):
                raise AssertionError(f"no wait_for_change request arrived within {timeout_s}s")

    def wait_served(self, name: str, cloud: str, timeout_s: float) -> float:
        """When machine ``name``'s notice was first answered; waits for it at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while (name, cloud) not in self.served:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no worker asked {cloud} about {name}'s notice within {timeout_s}s")
                self.changed.wait(left)
            return self.served[(name, cloud)]


class _Handler(BaseHTTPRequestHandler):
    server_state: MetadataServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass  # the server's own log is self.server_state.log

    def _answer(self, status: int, body: bytes = b"", headers: Optional[Dict[str, str]] = None,
                name: str = "", path: str = "") -> None:
        # logged before the answer goes out: a client that has its answer finds it in the log
        self.server_state.log.append((name, self.command, path, status))
        self.send_response(status)
        for key, value in {"Content-Type": "text/plain", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self) -> Tuple[str, str, Dict[str, str]]:
        parsed = urllib.parse.urlsplit(self.path)
        first, _, rest = parsed.path.lstrip("/").partition("/")
        query = dict(urllib.parse.parse_qsl(parsed.query))
        if first in ("latest", "computeMetadata", "metadata"):
            return "", parsed.path, query  # no machine prefix: the default machine
        return urllib.parse.unquote(first), "/" + rest, query

    def do_PUT(self) -> None:
        name, path, _ = self._route()
        machine = self.server_state.machine(name)
        if path != "/latest/api/token":
            return self._answer(404, name=name, path=path)
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if not ttl.isdigit() or not 1 <= int(ttl) <= MAX_TTL_S:
            return self._answer(400, name=name, path=path)
        token = secrets.token_urlsafe(32)
        machine.tokens[token] = time.monotonic() + int(ttl)
        self._answer(200, token.encode(), {"X-aws-ec2-metadata-token-ttl-seconds": ttl}, name, path)

    def do_GET(self) -> None:
        name, path, query = self._route()
        machine = self.server_state.machine(name)
        if path.startswith("/latest/"):
            return self._aws(name, machine, path)
        if path.startswith("/computeMetadata/"):
            return self._gcp(name, machine, path, query)
        if path.startswith("/metadata/"):
            return self._azure(name, machine, path, query)
        self._answer(404, name=name, path=path)

    def _served(self, name: str, cloud: str) -> None:
        state = self.server_state
        with state.changed:
            if (name, cloud) not in state.served:
                state.served[(name, cloud)] = time.time()
                state.changed.notify_all()

    def _aws(self, name: str, machine: Machine, path: str) -> None:
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        if machine.tokens.get(token, 0.0) < time.monotonic():
            return self._answer(401, name=name, path=path)   # IMDSv2 required: no or expired token
        documents = {"/latest/meta-data/spot/instance-action": machine.instance_action,
                     "/latest/meta-data/events/recommendations/rebalance": machine.rebalance}
        document = documents.get(path)
        if document is None:
            return self._answer(404, name=name, path=path)
        if path.endswith("instance-action"):
            self._served(name, "aws")
        self._answer(200, json.dumps(document).encode(), name=name, path=path)

    def _gcp(self, name: str, machine: Machine, path: str, query: Dict[str, str]) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._answer(403, name=name, path=path)
        if path != "/computeMetadata/v1/instance/preempted":
            return self._answer(404, name=name, path=path)

        def etag() -> str:
            return hashlib.sha1(machine.preempted.encode()).hexdigest()[:16]

        state = self.server_state
        if query.get("wait_for_change") == "true":
            last = query.get("last_etag") or etag()
            deadline = time.monotonic() + float(query.get("timeout_sec", "60"))
            with state.changed:
                state.held += 1
                state.changed.notify_all()
                while etag() == last and time.monotonic() < deadline:
                    state.changed.wait(deadline - time.monotonic())
                state.held -= 1
        if machine.preempted == "TRUE":
            self._served(name, "gcp")
        self._answer(200, machine.preempted.encode(),
                     {"Metadata-Flavor": "Google", "ETag": etag(), "Content-Type": "application/text"}, name, path)

    def _azure(self, name: str, machine: Machine, path: str, query: Dict[str, str]) -> None:
        if self.headers.get("Metadata") != "true":
            return self._answer(400, b'{"error": "Bad request. Required metadata header not specified"}',
                                {"Content-Type": "application/json"}, name, path)
        if "api-version" not in query:
            return self._answer(400, b'{"error": "Bad request. api-version was not specified in the request"}',
                                {"Content-Type": "application/json"}, name, path)
        if path == "/metadata/instance/compute/name" and query.get("format") == "text":
            return self._answer(200, machine.vm_name.encode(), name=name, path=path)
        if path != "/metadata/scheduledevents":
            return self._answer(404, name=name, path=path)
        document = {"DocumentIncarnation": machine.incarnation, "Events": machine.events}
        if any(e["EventType"] == "Preempt" and machine.vm_name in e["Resources"] for e in machine.events):
            self._served(name, "azure")
        self._answer(200, json.dumps(document).encode(), {"Content-Type": "application/json"}, name, path)


__all__ = ["ENV", "Machine", "MetadataServer"]
