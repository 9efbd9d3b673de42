"""Hosts of an AWS EC2 (spot) pool, selected by tags or an Auto Scaling group.

Owns the pool's rules: which instances are usable hosts, where each one's
slot count comes from, which address is printed. The answers come from
:class:`~elastic_ext.discovery.aws_api.Ec2Pool` (the API calls, their
timeouts and paging); :func:`select_hosts` turns them into hosts. An
instance is left out when it is not ``running`` (stopping, shutting-down,
stopped, terminated, pending), when its ASG lifecycle state is not
``InService`` or its ASG health is not ``Healthy``, or when its spot
request's status code is ``marked-for-termination`` (or any other
``marked-for-*``): the job shrinks before AWS takes the instance away.

Region, credentials and profile come from boto3's usual configuration
(``AWS_REGION``, ``AWS_PROFILE``, ``~/.aws/config``, instance roles).
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set

from elastic_ext.discovery.aws_api import API_TIMEOUT_S, Ec2Pool
from elastic_ext.discovery.deadline import Deadline
from elastic_ext.discovery.hosts import HostSlots, parse_slots
from elastic_ext.errors import DiscoveryInputError

logger = logging.getLogger(__name__)

DEFAULT_SLOTS_TAG = "horovod-slots"
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
           "select_hosts", "discover"]
