"""host_discovery/aws_spot.py against moto's EC2/Auto Scaling server (a real HTTP API).

moto 5 cannot put a spot request into ``marked-for-termination`` through
its API (it only ever reports ``fulfilled``), so reclaiming is exercised
here with stop and terminate; the marked-for-termination rule is covered
by tests/unit/test_discovery_aws.py on the API's documented response shape.
"""

from __future__ import annotations

import socket
import threading
from typing import Dict, List

import boto3
import pytest

from elastic_ext.discovery import Deadline, DiscoveryTimeoutError
from elastic_ext.discovery import aws, aws_api
from elastic_ext.discovery.cli import EXIT_INPUT, EXIT_OK, EXIT_TIMEOUT, EXIT_UNAVAILABLE
from moto_server import FAKE_AWS_ENV, free_port

# "signal" raises in the test, so fixture teardown still stops the daemons.
pytestmark = pytest.mark.timeout(60, method="signal")

AMI = "ami-12c6146b"  # one of moto's built-in images


def clients(moto):
    kw = dict(endpoint_url=moto.url, region_name=FAKE_AWS_ENV["AWS_REGION"],
              aws_access_key_id="testing", aws_secret_access_key="testing")
    return boto3.client("ec2", **kw), boto3.client("autoscaling", **kw)


def spot_pool(ec2, count: int, itype: str, tags: Dict[str, str]) -> List[str]:
    """Spot instances through RequestSpotInstances, tagged like a launch template would."""
    reqs = ec2.request_spot_instances(InstanceCount=count, LaunchSpecification={
        "ImageId": AMI, "InstanceType": itype})["SpotInstanceRequests"]
    ids = [r["InstanceId"] for r in reqs]
    ec2.create_tags(Resources=ids, Tags=[{"Key": k, "Value": v} for k, v in tags.items()])
    return ids


def private_ips(ec2, ids: List[str]) -> Dict[str, str]:
    res = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return {i["InstanceId"]: i["PrivateIpAddress"] for r in res for i in r["Instances"]}


def lines(stdout: str) -> List[str]:
    return sorted(stdout.splitlines())


def test_tagged_spot_pool_shrinks_on_stop_and_terminate_and_grows_back(moto, run_script):
    ec2, _ = clients(moto)
    ids = spot_pool(ec2, 3, "p3.8xlarge", {"pool": "train", "horovod-slots": "2"})
    spot_pool(ec2, 1, "p3.8xlarge", {"pool": "other"})  # another pool: never listed
    ip = private_ips(ec2, ids)
    args = ("--endpoint-url", moto.url, "--tag", "pool=train")

    proc = run_script("aws_spot", *args, env=moto.env())
    assert proc.returncode == EXIT_OK, proc.stderr
    assert lines(proc.stdout) == sorted(f"{ip[i]}:2" for i in ids)

    ec2.stop_instances(InstanceIds=[ids[0]])          # reclaimed with stop behaviour
    ec2.terminate_instances(InstanceIds=[ids[1]])     # reclaimed with terminate behaviour
    proc = run_script("aws_spot", *args, "--log-level", "INFO", env=moto.env())
    assert (proc.returncode, proc.stdout) == (EXIT_OK, f"{ip[ids[2]]}:2\n"), proc.stderr

    ec2.start_instances(InstanceIds=[ids[0]])         # capacity is back: the job grows
    proc = run_script("aws_spot", *args, env=moto.env())
    assert lines(proc.stdout) == sorted([f"{ip[ids[0]]}:2", f"{ip[ids[2]]}:2"])


def test_slots_from_instance_type_table_and_private_dns(moto, run_script):
    ec2, _ = clients(moto)
    ids = spot_pool(ec2, 1, "p3.8xlarge", {"pool": "p"})
    ids += spot_pool(ec2, 1, "t3.large", {"pool": "p"})
    proc = run_script("aws_spot", "--endpoint-url", moto.url, "--tag", "pool=p",
                      "--type-slots", "t3.large=1", "--address", "private-dns", env=moto.env())
    assert proc.returncode == EXIT_OK, proc.stderr
    dns = {i["InstanceType"]: i["PrivateDnsName"]
           for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]}
    assert lines(proc.stdout) == sorted([f"{dns['p3.8xlarge']}:4", f"{dns['t3.large']}:1"])


def test_unknown_type_without_tag_or_flag_exits_2(moto, run_script):
    ec2, _ = clients(moto)
    spot_pool(ec2, 1, "t3.large", {"pool": "p"})
    proc = run_script("aws_spot", "--endpoint-url", moto.url, "--tag", "pool=p", env=moto.env())
    assert (proc.returncode, proc.stdout) == (EXIT_INPUT, "")
    assert "'t3.large'" in proc.stderr and "--type-slots" in proc.stderr


def test_non_integer_slot_tag_exits_2_quoting_the_value(moto, run_script):
    ec2, _ = clients(moto)
    ids = spot_pool(ec2, 1, "p3.2xlarge", {"pool": "p", "horovod-slots": "two"})
    proc = run_script("aws_spot", "--endpoint-url", moto.url, "--tag", "pool=p", env=moto.env())
    assert (proc.returncode, proc.stdout) == (EXIT_INPUT, "")
    assert "'two'" in proc.stderr and ids[0] in proc.stderr
    assert "Traceback" not in proc.stderr


def test_auto_scaling_group_keeps_only_in_service_healthy_instances(moto, run_script):
    ec2, asg = clients(moto)
    ec2.create_launch_template(LaunchTemplateName="workers", LaunchTemplateData={
        "ImageId": AMI, "InstanceType": "g5.12xlarge",
        "InstanceMarketOptions": {"MarketType": "spot"}})
    asg.create_auto_scaling_group(AutoScalingGroupName="train", MinSize=0, MaxSize=4,
                                  DesiredCapacity=3, AvailabilityZones=["us-east-1a"],
                                  LaunchTemplate={"LaunchTemplateName": "workers"})
    ids = [i["InstanceId"] for i in asg.describe_auto_scaling_groups(
        AutoScalingGroupNames=["train"])["AutoScalingGroups"][0]["Instances"]]
    asg.set_instance_health(InstanceId=ids[0], HealthStatus="Unhealthy")
    asg.enter_standby(AutoScalingGroupName="train", InstanceIds=[ids[1]],
                      ShouldDecrementDesiredCapacity=True)
    proc = run_script("aws_spot", "--endpoint-url", moto.url, "--asg", "train", env=moto.env())
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == f"{private_ips(ec2, ids)[ids[2]]}:4\n"   # g5.12xlarge: 4 GPUs

    missing = run_script("aws_spot", "--endpoint-url", moto.url, "--asg", "nope", env=moto.env())
    assert missing.returncode == EXIT_INPUT and "'nope' does not exist" in missing.stderr


@pytest.fixture
def aws_env(monkeypatch):
    """Fake credentials for in-process boto3 calls (the scripts get them via moto.env())."""
    for key, value in FAKE_AWS_ENV.items():
        monkeypatch.setenv(key, value)


def test_library_discover_matches_script(moto, aws_env):
    ec2, _ = clients(moto)
    ids = spot_pool(ec2, 2, "g5.xlarge", {"team": "ml"})
    hosts = aws.discover(Deadline(10), tags={"team": ["ml"]}, endpoint_url=moto.url,
                         region=FAKE_AWS_ENV["AWS_REGION"])
    ip = private_ips(ec2, ids)
    assert sorted((h.host, h.slots) for h in hosts) == sorted((ip[i], 1) for i in ids)


def test_unreachable_endpoint_exits_3(run_script, moto):
    proc = run_script("aws_spot", "--endpoint-url", f"http://127.0.0.1:{free_port()}",
                      "--tag", "pool=p", env=moto.env())
    assert (proc.returncode, proc.stdout) == (EXIT_UNAVAILABLE, "")
    assert "Could not connect" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture
def hung_endpoint():
    """A server that accepts connections and never answers (a stuck proxy); yields its URL."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        held = []
        stop = threading.Event()

        def accept():
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    held.append(listener.accept()[0])
                except OSError:
                    pass

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(2)
            for conn in held:
                conn.close()


def test_hung_endpoint_is_bounded_by_the_timeout(run_script, moto, aws_env, hung_endpoint):
    proc = run_script("aws_spot", "--endpoint-url", hung_endpoint, "--tag", "pool=p",
                      "--timeout-s", "1.5", env=moto.env())
    with pytest.raises(DiscoveryTimeoutError):
        aws.discover(Deadline(0.5), tags={"pool": ["p"]}, endpoint_url=hung_endpoint, region="us-east-1")
    assert (proc.returncode, proc.stdout) == (EXIT_TIMEOUT, ""), proc.stderr
    assert "timeout" in proc.stderr.lower()  # its own --timeout-s ended it (exit 4), not a failed request (3)


def test_each_call_gets_the_time_left_not_the_time_left_when_the_client_was_made(aws_env, hung_endpoint):
    """Before, the timeout was fixed when the pool made its clients: here 3 s, past the deadline."""
    now = [0.0]
    deadline = Deadline(10, clock=lambda: now[0])
    pool = aws_api.Ec2Pool(deadline, region="us-east-1", endpoint_url=hung_endpoint, call_timeout_s=3.0)
    now[0] = 9.7  # an earlier call (or page) used up most of the deadline
    with pytest.raises(DiscoveryTimeoutError, match=r"DescribeInstances.*\(timeout 0\.30 s\)") as caught:
        pool.running_instances({"pool": ["p"]})
    # What urllib3 itself was told, under botocore's ReadTimeoutError.
    assert "read timeout=0.3" in str(caught.value.__cause__.kwargs["error"])
    assert pool.call_timeouts_s == [("DescribeInstances", pytest.approx(0.3))]


def test_every_page_is_read(moto, aws_env):
    """DescribeInstances pages (moto honours MaxResults); DescribeSpotInstanceRequests with MaxResults."""
    ec2, _ = clients(moto)
    ids = spot_pool(ec2, 7, "g5.xlarge", {"pool": "big"})
    pool = aws_api.Ec2Pool(Deadline(30), region=FAKE_AWS_ENV["AWS_REGION"], endpoint_url=moto.url, page_size=5)
    instances = pool.running_instances({"pool": ["big"]})
    assert sorted(i["InstanceId"] for i in instances) == sorted(ids)
    assert [op for op, _ in pool.call_timeouts_s] == ["DescribeInstances"] * 2, "7 instances, 5 a page"
    requests = pool.spot_requests(ids)
    assert sorted(r["InstanceId"] for r in requests) == sorted(ids)
    hosts = aws.discover(Deadline(30), tags={"pool": ["big"]}, endpoint_url=moto.url,
                         region=FAKE_AWS_ENV["AWS_REGION"], page_size=5)
    ip = private_ips(ec2, ids)
    assert sorted(h.host for h in hosts) == sorted(ip.values())


def test_missing_region_exits_2(run_script, moto):
    env = {k: v for k, v in moto.env().items() if k not in ("AWS_REGION", "AWS_DEFAULT_REGION")}
    proc = run_script("aws_spot", "--endpoint-url", moto.url, "--tag", "pool=p", env=env)
    assert (proc.returncode, proc.stdout) == (EXIT_INPUT, ""), proc.stderr
    assert "region" in proc.stderr.lower()


def test_no_pool_selector_exits_2(run_script, moto):
    proc = run_script("aws_spot", "--endpoint-url", moto.url, env=moto.env())
    assert proc.returncode == EXIT_INPUT and "--tag KEY=VALUE" in proc.stderr
