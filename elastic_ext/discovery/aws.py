"""Hosts of an AWS EC2 (spot) pool, selected by tags or an Auto Scaling group.

One discovery makes at most three kinds of API calls, each with its own
socket timeout (the per-call bound or what is left of the overall deadline,
whichever is smaller) and no retries (Horovod calls again a second later
anyway): ``autoscaling:DescribeAutoScalingGroups`` (only with an ASG),
``ec2:DescribeInstances`` filtered to running instances, and
``ec2:DescribeSpotInstanceRequests`` for those instances; every page of the
last two is read (``NextToken``). An instance is
left out when it is not ``running`` (stopping, shutting-down, stopped,
terminated, pending), when its ASG lifecycle state is not ``InService`` or
its ASG health is not ``Healthy``, or when its spot request's status code is
``marked-for-termination`` (or any other ``marked-for-*``): the job shrinks
before AWS takes the instance away.

Region, credentials and profile come from boto3's usual configuration
(``AWS_REGION``, ``AWS_PROFILE``, ``~/.aws/config``, instance roles).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from elastic_ext.discovery.deadline import Deadline
from elastic_ext.discovery.hosts import HostSlots, parse_slots
from elastic_ext.errors import DiscoveryInputError, DiscoveryTimeoutError, DiscoveryUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_SLOTS_TAG = "horovod-slots"
# Default bound for one API call's connect and read; the overall deadline may cut it.
API_TIMEOUT_S = 3.0
# AWS accepts at most 200 values per filter.
MAX_FILTER_VALUES = 200
ASG_GROUP_TAG = "aws:autoscaling:groupName"

# GPUs per instance for common GPU instance types: the default slot count.
GPU_SLOTS: Dict[str, int] = {
    **{f"p2.{s}": n for s, n in (("xlarge", 1), ("8xlarge", 8), ("16xlarge", 16))},
    **{f"p3.{s}": n for s, n in (("2xlarge", 1), ("8xlarge", 4), ("16xlarge", 8))},
    "p3dn.24xlarge": 8, "p4d.24xlarge": 8, "p4de.24xlarge": 8, "p5.48xlarge": 8,
    **{f"g4dn.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g4dn.12xlarge": 4, "g4dn.metal": 8,
    **{f"g5.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g5.12xlarge": 4, "g5.24xlarge": 4, "g5.48xlarge": 8,
    **{f"g6.{s}": 1 for s in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    "g6.12xlarge": 4, "g6.24xlarge": 4, "g6.48xlarge": 8,
}


class Address(str, enum.Enum):
    """Which address of an instance to print for Horovod (and ssh)."""

    PRIVATE_IP = "private-ip"
    PRIVATE_DNS = "private-dns"
    PUBLIC_IP = "public-ip"
    PUBLIC_DNS = "public-dns"


_ADDRESS_FIELD = {Address.PRIVATE_IP: "PrivateIpAddress", Address.PRIVATE_DNS: "PrivateDnsName",
                  Address.PUBLIC_IP: "PublicIpAddress", Address.PUBLIC_DNS: "PublicDnsName"}


@dataclass
class SlotPolicy:
    """How an instance's slot count is found: ``slots``, else its tag, else its type."""

    slots: Optional[int] = None
    slots_tag: str = DEFAULT_SLOTS_TAG
    type_slots: Dict[str, int] = field(default_factory=dict)

    def slots_for(self, instance: Mapping[str, Any]) -> int:
        """Raises DiscoveryInputError: a bad tag value, or no rule gives a count."""
        iid = instance.get("InstanceId", "?")
        if self.slots is not None:
            return self.slots
        tags = {t.get("Key"): t.get("Value") for t in instance.get("Tags") or ()}
        if self.slots_tag in tags:
            return parse_slots(tags[self.slots_tag], f"tag {self.slots_tag!r} of {iid}")
        itype = instance.get("InstanceType", "")
        table = {**GPU_SLOTS, **self.type_slots}
        if itype in table:
            return table[itype]
        raise DiscoveryInputError(
            f"no slot count for {iid} (type {itype!r}): tag it {self.slots_tag}=N, "
            f"pass --type-slots {itype}=N, or pass --slots N")


def parse_tag_filters(specs: Iterable[str]) -> Dict[str, List[str]]:
    """``["pool=a", "pool=b", "team=x"]`` -> ``{"pool": ["a", "b"], "team": ["x"]}``.

    Raises:
        DiscoveryInputError: a spec has no ``=`` or an empty key.
    """
    tags: Dict[str, List[str]] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key:
            raise DiscoveryInputError(f"tag filter {spec!r} must look like KEY=VALUE")
        tags.setdefault(key, []).append(value)
    return tags


def select_hosts(instances: Iterable[Mapping[str, Any]],
                 spot_requests: Iterable[Mapping[str, Any]],
                 policy: SlotPolicy, address: Address = Address.PRIVATE_IP,
                 in_service: Optional[Set[str]] = None) -> List[HostSlots]:
    """Turn API answers into hosts; pure, so it is tested on recorded shapes.

    Args:
        instances: ``Reservations[].Instances[]`` items from DescribeInstances.
        spot_requests: ``SpotInstanceRequests[]`` from DescribeSpotInstanceRequests.
        policy: how to find each instance's slots.
        address: which address to print.
        in_service: when the pool is an ASG, the IDs that are InService and Healthy.

    Raises:
        DiscoveryInputError: an instance's slot count is bad or unknown.
    """
    doomed = {r.get("InstanceId"): r.get("Status", {}).get("Code", "")
              for r in spot_requests
              if str(r.get("Status", {}).get("Code", "")).startswith("marked-for-")}
    hosts: List[HostSlots] = []
    for inst in sorted(instances, key=lambda i: (str(i.get("LaunchTime", "")),
                                                 i.get("InstanceId", ""))):
        iid = inst.get("InstanceId", "?")
        state = inst.get("State", {}).get("Name")
        if state != "running":
            logger.info("leaving out %s: state is %r", iid, state)
            continue
        if in_service is not None and iid not in in_service:
            logger.info("leaving out %s: not InService and Healthy in its Auto Scaling group", iid)
            continue
        if iid in doomed:
            logger.info("leaving out %s: its spot request is %r", iid, doomed[iid])
            continue
        addr = inst.get(_ADDRESS_FIELD[address])
        if not addr:
            logger.warning("leaving out %s: it has no %s", iid, address.value)
            continue
        hosts.append(HostSlots(addr, policy.slots_for(inst)))
    return hosts


def _chunks(items: Sequence[str]) -> Iterable[List[str]]:
    for start in range(0, len(items), MAX_FILTER_VALUES):
        yield list(items[start:start + MAX_FILTER_VALUES])


class Ec2Pool:
    """The live API side: boto3 clients with bounded timeouts and no retries.

    Each API call gets its own timeout, ``call_timeout_s`` or what is left of
    the deadline, whichever is smaller. botocore fixes a client's timeouts
    when the client is made, so a call near the deadline gets a client made
    for its shorter bound (clients with the full ``call_timeout_s`` are
    reused).

    Args:
        page_size: ``MaxResults`` for the paginated calls; None lets AWS
            choose. Every ``NextToken`` is followed either way.
    """

    def __init__(self, deadline: Deadline, region: Optional[str] = None,
                 endpoint_url: Optional[str] = None, profile: Optional[str] = None,
                 call_timeout_s: float = API_TIMEOUT_S, page_size: Optional[int] = None) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise DiscoveryInputError(f"boto3 is needed for AWS discovery: {exc}") from exc
        if page_size is not None and not (type(page_size) is int and 5 <= page_size <= 1000):
            raise DiscoveryInputError(f"page_size ({page_size!r}) must be an integer from 5 to 1000 "
                                      "(the range AWS accepts for MaxResults)")
        self._deadline = deadline
        self._cap_s = call_timeout_s
        self._endpoint_url = endpoint_url
        self._page_size = page_size
        self._config = Config
        self._clients: Dict[Tuple[str, float], Any] = {}
        self.call_timeouts_s: List[Tuple[str, float]] = []  # (operation, timeout) of each call made
        with _api_errors("AWS configuration"):
            self._session = boto3.session.Session(profile_name=profile, region_name=region)

    def _client(self, service: str, what: str) -> Tuple[Any, float]:
        """A client whose connect and read timeouts are this call's bound."""
        timeout_s = self._deadline.call_timeout_s(self._cap_s, what)
        client = self._clients.get((service, timeout_s))
        if client is None:
            config = self._config(connect_timeout=timeout_s, read_timeout=timeout_s,
                                  retries={"total_max_attempts": 1, "mode": "standard"})
            with _api_errors("AWS configuration"):
                client = self._session.client(service, endpoint_url=self._endpoint_url, config=config)
            if timeout_s == self._cap_s:  # the common case; shorter bounds are one-offs
                self._clients[(service, timeout_s)] = client
        self.call_timeouts_s.append((what, timeout_s))
        return client, timeout_s

    def _pages(self, service: str, operation: str, method: str, kwargs: Dict[str, Any]) -> Iterable[Dict[str, Any]]:
        """Every page of a paginated call, each call with its own timeout."""
        token: Optional[str] = None
        seen: Set[str] = set()
        while True:
            call = dict(kwargs)
            if self._page_size is not None:
                call["MaxResults"] = self._page_size
            if token:
                call["NextToken"] = token
            client, timeout_s = self._client(service, operation)
            with _api_errors(operation, timeout_s):
                page = getattr(client, method)(**call)
            yield page
            token = page.get("NextToken")
            if not token:
                return
            if token in seen:
                raise DiscoveryUnavailableError(f"{operation} returned the NextToken {token!r} twice; "
                                                "giving up instead of looping")
            seen.add(token)

    def asg_in_service(self, group: str) -> Set[str]:
        """IDs of the group's instances that are InService and Healthy."""
        client, timeout_s = self._client("autoscaling", "DescribeAutoScalingGroups")
        with _api_errors("DescribeAutoScalingGroups", timeout_s):
            groups = client.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]
        if not groups:
            raise DiscoveryInputError(f"Auto Scaling group {group!r} does not exist")
        return {i["InstanceId"] for i in groups[0].get("Instances", [])
                if i.get("LifecycleState") == "InService" and i.get("HealthStatus") == "Healthy"}

    def running_instances(self, tags: Mapping[str, List[str]]) -> List[Dict[str, Any]]:
        """Running instances carrying all ``tags`` (any listed value per key), from every page."""
        filters = [{"Name": "instance-state-name", "Values": ["running"]}]
        filters += [{"Name": f"tag:{k}", "Values": list(v)} for k, v in tags.items()]
        instances: List[Dict[str, Any]] = []
        for page in self._pages("ec2", "DescribeInstances", "describe_instances", {"Filters": filters}):
            for reservation in page.get("Reservations", []):
                instances.extend(reservation.get("Instances", []))
        return instances

    def spot_requests(self, instance_ids: Sequence[str]) -> List[Dict[str, Any]]:
        """The spot requests behind ``instance_ids`` (on-demand ones have none), from every page."""
        requests: List[Dict[str, Any]] = []
        for chunk in _chunks(instance_ids):
            for page in self._pages("ec2", "DescribeSpotInstanceRequests", "describe_spot_instance_requests",
                                    {"Filters": [{"Name": "instance-id", "Values": chunk}]}):
                requests.extend(page.get("SpotInstanceRequests", []))
        return requests


class _api_errors:
    """Map botocore's exceptions onto the discovery error kinds (exit codes)."""

    def __init__(self, what: str, timeout_s: Optional[float] = None) -> None:
        self.what = what
        self.timeout_s = timeout_s

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, DiscoveryUnavailableError):
            return False
        from botocore import exceptions as bex

        msg = f"{self.what}: {exc}"
        if isinstance(exc, (bex.ConnectTimeoutError, bex.ReadTimeoutError)):
            bound = f" (timeout {self.timeout_s:.2f} s)" if self.timeout_s is not None else ""
            raise DiscoveryTimeoutError(msg + bound) from exc
        if isinstance(exc, (bex.NoRegionError, bex.NoCredentialsError,
                            bex.PartialCredentialsError, bex.ProfileNotFound)):
            raise DiscoveryInputError(
                f"{msg} (set AWS_REGION/AWS_PROFILE or credentials, or pass --region)") from exc
        if isinstance(exc, bex.ClientError):
            err = exc.response.get("Error", {})
            raise DiscoveryUnavailableError(
                f"{self.what} failed: {err.get('Code', '?')}: {err.get('Message', exc)}") from exc
        if isinstance(exc, (bex.BotoCoreError, ValueError)):
            raise DiscoveryUnavailableError(msg) from exc
        return False


def discover(deadline: Deadline, *, tags: Mapping[str, List[str]] = {},
             asg: Optional[str] = None, policy: Optional[SlotPolicy] = None,
             address: Address = Address.PRIVATE_IP, spot_check: bool = True,
             region: Optional[str] = None, endpoint_url: Optional[str] = None,
             profile: Optional[str] = None,
             call_timeout_s: float = API_TIMEOUT_S,
             page_size: Optional[int] = None) -> List[HostSlots]:
    """The pool's usable instances with their slots, oldest first.

    Raises:
        DiscoveryInputError: no pool selector, bad configuration or slot counts.
        DiscoveryUnavailableError: the API is unreachable or answered an error.
        DiscoveryTimeoutError: an API call exceeded its bound.
    """
    if not tags and not asg:
        raise DiscoveryInputError("select the pool with --tag KEY=VALUE and/or --asg NAME")
    pool = Ec2Pool(deadline, region, endpoint_url, profile, call_timeout_s, page_size)
    in_service: Optional[Set[str]] = None
    filters = dict(tags)
    if asg:
        in_service = pool.asg_in_service(asg)
        filters[ASG_GROUP_TAG] = [asg]
    instances = pool.running_instances(filters)
    ids = [i["InstanceId"] for i in instances if "InstanceId" in i]
    requests = pool.spot_requests(ids) if spot_check and ids else []
    return select_hosts(instances, requests, policy or SlotPolicy(), address, in_service)


__all__ = ["Address", "SlotPolicy", "GPU_SLOTS", "DEFAULT_SLOTS_TAG", "parse_tag_filters",
           "select_hosts", "Ec2Pool", "discover"]
