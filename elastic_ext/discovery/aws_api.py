"""The live AWS side of EC2 pool discovery: boto3 calls with bounded timeouts.

Owns :class:`Ec2Pool`, the only code that talks to AWS: at most three kinds
of API calls per discovery, ``autoscaling:DescribeAutoScalingGroups`` (only
with an ASG), ``ec2:DescribeInstances`` filtered to running instances, and
``ec2:DescribeSpotInstanceRequests`` for those instances; every page of the
last two is read (``NextToken``). Each call gets its own socket timeout (the
per-call bound or what is left of the overall deadline, whichever is
smaller) and no retries (Horovod calls again a second later anyway).
botocore's exceptions are mapped onto the discovery error kinds (exit
codes). Which instances count as usable hosts is decided from the answers
by :mod:`elastic_ext.discovery.aws`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from elastic_ext.discovery.deadline import Deadline
from elastic_ext.errors import DiscoveryInputError, DiscoveryTimeoutError, DiscoveryUnavailableError

# Default bound for one API call's connect and read; the overall deadline may cut it.
API_TIMEOUT_S = 3.0
# AWS accepts at most 200 values per filter.
MAX_FILTER_VALUES = 200


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


__all__ = ["API_TIMEOUT_S", "MAX_FILTER_VALUES", "Ec2Pool"]
