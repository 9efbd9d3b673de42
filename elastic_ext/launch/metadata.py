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

The base URL of each is the documented link-local address unless
``ELASTIC_EXT_NOTICE_ENDPOINT`` gives another (see :mod:`elastic_ext.launch.notices`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Mapping, Optional, Tuple

REQUEST_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Notice:
    """What an endpoint (or Slurm's signal) announced: ``leave`` says whether this host goes away."""

    source: str                 # "aws", "gcp", "azure" or "slurm"
    kind: str                   # what announced it: "instance-action", "rebalance", "preempted", "Preempt", ...
    leave: bool                 # True: the host is taken away; False: advisory, only reported
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the endpoint's answer, as documented

    def fields(self) -> Dict[str, Any]:
        """The notice as event fields."""
        return {"source": self.source, "kind": self.kind, "detail": self.detail}


class MetadataError(Exception):
    """An endpoint answered something its cloud does not document (or not at all)."""


def request(url: str, headers: Mapping[str, str], method: str = "GET",
            timeout_s: float = REQUEST_TIMEOUT_S) -> Tuple[int, bytes, Mapping[str, str]]:
    """One HTTP request without proxies (link-local addresses must never go through one): (status, body, headers)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, method=method, headers=dict(headers),
                                 data=b"" if method == "PUT" else None)
    try:
        with opener.open(req, timeout=timeout_s) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read() or b"", exc.headers


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
            self._token = body.decode("ascii").strip()
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
            self.vm_name = self._get(self.NAME_PATH).decode("utf-8").strip()
        document = _json(self._get(self.EVENTS_PATH, self.FIRST_TIMEOUT_S if first else REQUEST_TIMEOUT_S),
                         self.EVENTS_PATH)
        for event in document.get("Events") or []:
            if self.vm_name not in (event.get("Resources") or []):
                continue  # another VM of this availability set or placement group
            kind, event_id = event.get("EventType"), event.get("EventId")
            if kind in self.LEAVE_TYPES:
                return Notice(self.source, kind, True, event)
            if event_id not in self._seen:
                self._seen.add(event_id)
                return Notice(self.source, str(kind), False, event)
        return None


CLIENTS = {"aws": AwsImds, "gcp": GcpMetadata, "azure": AzureScheduledEvents}


def _json(body: bytes, path: str) -> Dict[str, Any]:
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MetadataError(f"{path} answered something that is not JSON: {body[:200]!r}") from exc
    if not isinstance(value, dict):
        raise MetadataError(f"{path} answered {value!r}, not a JSON object")
    return value


__all__ = ["Notice", "MetadataError", "AwsImds", "GcpMetadata", "AzureScheduledEvents", "CLIENTS", "request"]
