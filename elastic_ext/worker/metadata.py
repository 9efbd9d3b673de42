"""The clouds' instance metadata endpoints that announce a preemption, one small client each.

Each client asks its endpoint exactly as the cloud documents it and turns
the answer into a :class:`Notice` (or None):

- **AWS** (:class:`AwsImds`), IMDSv2: ``PUT /latest/api/token`` with
  ``X-aws-ec2-metadata-token-ttl-seconds`` gives a session token; every
  ``GET`` carries it as ``X-aws-ec2-metadata-token`` (a 401 means it
  expired: a new one is fetched once). ``/latest/meta-data/spot/instance-action``
  answers 404 until EC2 marks the Spot Instance for interruption, then
  ``{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}`` about two
  minutes ahead ("Spot Instance interruption notices", EC2 User Guide: it
  recommends checking every 5 seconds). ``/latest/meta-data/events/recommendations/rebalance``
  answers 404 until a rebalance recommendation, then ``{"noticeTime": "...Z"}``
  ("EC2 instance rebalance recommendations"): advisory, the instance is
  only at elevated risk, so it is reported and not acted on.
- **GCP** (:class:`GcpMetadata`): ``GET /computeMetadata/v1/instance/preempted``
  with ``Metadata-Flavor: Google`` answers ``FALSE``, then ``TRUE`` once the
  VM is being preempted (about 30 s before it stops); with
  ``?wait_for_change=true&last_etag=E&timeout_sec=S`` the server holds the
  request until the value differs from the one ETag ``E`` named ("Querying
  VM metadata", waiting for changes). Responses carry ``Metadata-Flavor: Google``.
- **Azure** (:class:`AzureScheduledEvents`): ``GET /metadata/scheduledevents?api-version=2020-07-01``
  with ``Metadata: true`` answers ``{"DocumentIncarnation": n, "Events":
  [{"EventId", "EventType", "ResourceType", "Resources", "EventStatus",
  "NotBefore", ...}]}`` ("Azure Metadata Service: Scheduled Events for Linux
  VMs"); a Spot VM eviction is ``EventType`` ``Preempt`` (at least 30 s
  ahead), a scale-set deletion with termination notification ``Terminate``.
  Events of every VM of an availability set or scale-set placement group
  are listed, so only those whose ``Resources`` name this VM count (its name:
  ``/metadata/instance/compute/name?api-version=2021-02-01&format=text``).

Every answer is untrusted (anything that can answer on the link-local
address can): :func:`request` follows no redirect, reads at most
:data:`MAX_BODY_BYTES` and gives up at a total deadline, and each client
checks the documented shape of what it uses, raising :class:`MetadataError`
otherwise.

The base URL of each is the documented link-local address unless
``ELASTIC_EXT_NOTICE_ENDPOINT`` gives another (see :mod:`elastic_ext.worker.notices`).
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import threading
import time
import urllib.parse
from typing import Any, Dict, List, Mapping, Optional, Tuple

from elastic_ext.control.notice import Notice

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 2.0      # for a whole request: connect, headers and body
MAX_BODY_BYTES = 64 << 10    # every documented answer is a few hundred bytes
TOKEN_TEXT = re.compile(r"^[A-Za-z0-9+/=_.-]{1,1024}$")  # an IMDSv2 token: what may go back in a header


class MetadataError(Exception):
    """An endpoint answered something its cloud does not document (or not at all)."""


def request(url: str, headers: Mapping[str, str], method: str = "GET",
            timeout_s: float = REQUEST_TIMEOUT_S) -> Tuple[int, bytes, Mapping[str, str]]:
    """One HTTP request, as a metadata endpoint must be asked: (status, body, headers).

    Bounded in every way an answer could hold a watcher: no proxy
    (link-local addresses must never go through one), no redirect followed
    (a 3xx is returned as it is: the token headers must never reach another
    host), ``timeout_s`` for the whole exchange (an answer that trickles in
    is cut off at the deadline), and a body of at most :data:`MAX_BODY_BYTES`.

    Raises:
        MetadataError: the answer is not well-formed HTTP, is too large, or
            did not complete within ``timeout_s``.
        OSError: the endpoint cannot be reached.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MetadataError(f"{url!r} is not an http(s) URL")
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    timer = threading.Timer(timeout_s, _cut, (connection,))
    timer.daemon = True
    try:
        connection.connect()
        timer.interval = max(0.0, deadline - time.monotonic())
        timer.start()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request(method, target, body=b"" if method == "PUT" else None, headers=dict(headers))
        response = connection.getresponse()
        body = response.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            raise MetadataError(f"{url} answered a body larger than {MAX_BODY_BYTES} bytes")
        return response.status, body, response.headers
    except (http.client.HTTPException, ValueError) as exc:
        late = " (cut off at the deadline)" if time.monotonic() >= deadline else ""
        raise MetadataError(f"{url} answered no well-formed HTTP within {timeout_s}s{late}: "
                            f"{type(exc).__name__}: {str(exc)[:200]}") from None
    except OSError:
        if time.monotonic() >= deadline:
            raise MetadataError(f"{url} gave no complete answer within {timeout_s}s") from None
        raise
    finally:
        timer.cancel()
        connection.close()


def _cut(connection: http.client.HTTPConnection) -> None:
    """At the deadline: ends the exchange under the reading thread (its recv returns at once)."""
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError as exc:  # already closed: the request ended on its own
            logger.debug("cutting %s off: %s", connection.host, exc)


class AwsImds:
    """EC2's instance metadata service, IMDSv2 (see the module docstring)."""

    source = "aws"
    BASE_URL = "http://169.254.169.254"
    TOKEN_PATH = "/latest/api/token"
    TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aws-ec2-metadata-token"
    TOKEN_TTL_S = 21600           # the longest IMDSv2 allows (6 hours)
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
    POLL_S = 2.0                  # more often than the 5 s EC2 recommends: the notice -> leave time counts

    def __init__(self, base_url: Optional[str] = None) -> None:
        self.base_url = base_url or self.BASE_URL
        self._token: Optional[str] = None
        self._token_until = 0.0
        self._rebalance_reported = False

    def _fresh_token(self) -> str:
        if self._token is None or time.monotonic() > self._token_until:
            status, body, _ = request(self.base_url + self.TOKEN_PATH, {self.TTL_HEADER: str(self.TOKEN_TTL_S)}, "PUT")
            if status != 200 or not body:
                raise MetadataError(f"IMDSv2 token request to {self.base_url} answered {status}")
            token = body.decode("ascii", "replace").strip()
            if not TOKEN_TEXT.match(token):
                raise MetadataError(f"IMDSv2 token request to {self.base_url} answered {body[:64]!r}, not a token")
            self._token = token
            self._token_until = time.monotonic() + self.TOKEN_TTL_S - 60
        return self._token

    def _get_json(self, path: str) -> Optional[Dict[str, Any]]:
        """The JSON at ``path``, or None when IMDS answers 404 (nothing scheduled)."""
        for attempt in (1, 2):
            status, body, _ = request(self.base_url + path, {self.TOKEN_HEADER: self._fresh_token()})
            if status == 401 and attempt == 1:
                self._token = None    # expired or revoked: one new token, then the answer counts
                continue
            if status == 404:
                return None
            if status != 200:
                raise MetadataError(f"IMDS {path} answered {status}")
            return _json(body, path)
        raise MetadataError(f"IMDS {path} refused a fresh token (401)")

    def check(self) -> Optional[Notice]:
        action = self._get_json(self.ACTION_PATH)
        if action is not None:
            return Notice(self.source, "instance-action", True, action)
        if not self._rebalance_reported:
            rebalance = self._get_json(self.REBALANCE_PATH)
            if rebalance is not None:
                self._rebalance_reported = True
                return Notice(self.source, "rebalance", False, rebalance)
        return None


class GcpMetadata:
    """Compute Engine's metadata server, ``instance/preempted`` (see the module docstring)."""

    source = "gcp"
    BASE_URL = "http://metadata.google.internal"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS = {"Metadata-Flavor": "Google"}
    WAIT_S = 30                   # each hanging GET returns at least this often
    POLL_S = 0.0                  # the server holds the request until the value changes

    def __init__(self, base_url: Optional[str] = None) -> None:
        self.base_url = base_url or self.BASE_URL
        self._etag: Optional[str] = None

    def check(self) -> Optional[Notice]:
        url, timeout_s = self.base_url + self.PATH, REQUEST_TIMEOUT_S
        if self._etag is not None:
            url += f"?wait_for_change=true&last_etag={self._etag}&timeout_sec={self.WAIT_S}"
            timeout_s = self.WAIT_S + REQUEST_TIMEOUT_S
        status, body, headers = request(url, self.HEADERS, timeout_s=timeout_s)
        if status != 200 or headers.get("Metadata-Flavor") != "Google":
            raise MetadataError(f"metadata server {self.PATH} answered {status} "
                                f"(Metadata-Flavor: {headers.get('Metadata-Flavor')!r})")
        self._etag = headers.get("ETag") or self._etag
        value = body.decode("ascii", "replace").strip()
        if value not in ("TRUE", "FALSE"):
            raise MetadataError(f"metadata server {self.PATH} answered {value!r}, not TRUE or FALSE")
        return Notice(self.source, "preempted", True, {"preempted": value}) if value == "TRUE" else None


class AzureScheduledEvents:
    """Azure's Instance Metadata Service, Scheduled Events (see the module docstring)."""

    source = "azure"
    BASE_URL = "http://169.254.169.254"
    EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
    HEADERS = {"Metadata": "true"}
    LEAVE_TYPES = ("Preempt", "Terminate")   # the VM goes away; Reboot, Redeploy and Freeze are not acted on
    POLL_S = 2.0
    FIRST_TIMEOUT_S = 120.0       # the first call turns the service on and may take up to two minutes

    def __init__(self, base_url: Optional[str] = None) -> None:
        self.base_url = base_url or self.BASE_URL
        self.vm_name: Optional[str] = None
        self._seen: set = set()

    def _get(self, path: str, timeout_s: float = REQUEST_TIMEOUT_S) -> bytes:
        status, body, _ = request(self.base_url + path, self.HEADERS, timeout_s=timeout_s)
        if status != 200:
            raise MetadataError(f"Azure IMDS {path} answered {status}: {body[:200]!r}")
        return body

    def check(self) -> Optional[Notice]:
        first = self.vm_name is None
        if first:
            name = self._get(self.NAME_PATH).decode("utf-8", "replace").strip()
            if not name or not name.isprintable():
                raise MetadataError(f"Azure IMDS {self.NAME_PATH} answered {name[:200]!r}, not a VM name")
            self.vm_name = name
        document = _json(self._get(self.EVENTS_PATH, self.FIRST_TIMEOUT_S if first else REQUEST_TIMEOUT_S),
                         self.EVENTS_PATH)
        for event in _azure_events(document):
            if self.vm_name not in event["Resources"]:  # a list of names, matched exactly
                continue  # another VM of this availability set or placement group
            kind, event_id = event["EventType"], event["EventId"]
            if kind in self.LEAVE_TYPES:
                return Notice(self.source, kind, True, event)
            if event_id not in self._seen:
                self._seen.add(event_id)
                return Notice(self.source, str(kind), False, event)
        return None


def _azure_events(document: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The document's ``Events``, each checked for the shape Azure documents (or MetadataError)."""
    events = document.get("Events")
    if events is None:
        return []
    if not isinstance(events, list):
        raise MetadataError(f"Azure scheduled events: Events ({str(events)[:200]!r}) must be a list")
    for event in events:
        if not (isinstance(event, dict) and isinstance(event.get("EventId"), str)
                and isinstance(event.get("EventType"), str) and isinstance(event.get("Resources"), list)
                and all(isinstance(r, str) for r in event["Resources"])):
            raise MetadataError(f"Azure scheduled events: {str(event)[:200]!r} must be an object with EventId and "
                                "EventType strings and Resources a list of strings")
    return events


CLIENTS = {"aws": AwsImds, "gcp": GcpMetadata, "azure": AzureScheduledEvents}


def _json(body: bytes, path: str) -> Dict[str, Any]:
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MetadataError(f"{path} answered something that is not JSON: {body[:200]!r}") from exc
    if not isinstance(value, dict):
        raise MetadataError(f"{path} answered {value!r}, not a JSON object")
    return value


__all__ = ["MAX_BODY_BYTES", "MetadataError", "AwsImds", "GcpMetadata", "AzureScheduledEvents", "CLIENTS", "request"]
