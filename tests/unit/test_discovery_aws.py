"""AWS host selection on the shapes of EC2 API answers (no network).

The live API is exercised in tests/discovery/test_discovery_aws_live.py with
moto; moto cannot produce ``marked-for-termination``, so that rule is pinned
here on the documented DescribeSpotInstanceRequests shape.
"""

from __future__ import annotations

import pytest

from elastic_ext.discovery import Deadline, DiscoveryInputError, DiscoveryUnavailableError, HostSlots
from elastic_ext.discovery import aws, aws_api
from elastic_ext.discovery.commands import parse_type_slots


def inst(iid, state="running", itype="p3.8xlarge", tags=None, ip=None, launch="2026-01-01"):
    return {"InstanceId": iid, "State": {"Name": state}, "InstanceType": itype,
            "PrivateIpAddress": ip or f"10.0.0.{iid[-1]}", "PrivateDnsName": f"ip-{iid}.internal",
            "LaunchTime": launch, "Tags": [{"Key": k, "Value": v} for k, v in (tags or {}).items()]}


def spot(iid, code):
    return {"InstanceId": iid, "State": "active", "Status": {"Code": code}}


def test_leaves_out_non_running_and_marked_for_termination():
    instances = [inst("i-1"), inst("i-2", "stopping"), inst("i-3", "shutting-down"),
                 inst("i-4"), inst("i-5"), inst("i-6", "stopped")]
    requests = [spot("i-1", "fulfilled"), spot("i-4", "marked-for-termination"),
                spot("i-5", "marked-for-stop")]
    assert aws.select_hosts(instances, requests, aws.SlotPolicy()) == [HostSlots("10.0.0.1", 4)]


def test_asg_membership_and_address_choice_and_oldest_first():
    instances = [inst("i-2", launch="2026-02-01"), inst("i-1", launch="2026-01-01"),
                 inst("i-3")]
    hosts = aws.select_hosts(instances, [], aws.SlotPolicy(slots=1), aws.Address.PRIVATE_DNS,
                             in_service={"i-1", "i-2"})
    assert hosts == [HostSlots("ip-i-1.internal", 1), HostSlots("ip-i-2.internal", 1)]


def test_instance_without_the_requested_address_is_left_out():
    no_public = inst("i-1")
    assert aws.select_hosts([no_public], [], aws.SlotPolicy(), aws.Address.PUBLIC_IP) == []


def test_slot_precedence_flag_then_tag_then_type_table():
    tagged = inst("i-1", tags={"horovod-slots": "3"})
    assert aws.SlotPolicy(slots=2).slots_for(tagged) == 2
    assert aws.SlotPolicy().slots_for(tagged) == 3
    assert aws.SlotPolicy().slots_for(inst("i-2", itype="g5.48xlarge")) == 8
    assert aws.SlotPolicy(type_slots={"g5.48xlarge": 4}).slots_for(
        inst("i-2", itype="g5.48xlarge")) == 4


def test_bad_slot_tag_and_unknown_type_are_input_errors():
    with pytest.raises(DiscoveryInputError, match="'two'.*i-1"):
        aws.SlotPolicy().slots_for(inst("i-1", tags={"horovod-slots": "two"}))
    with pytest.raises(DiscoveryInputError, match="'m5.large'"):
        aws.SlotPolicy().slots_for(inst("i-2", itype="m5.large"))


def test_tag_and_type_slot_specs():
    assert aws.parse_tag_filters(["pool=a", "pool=b", "team=x"]) == {"pool": ["a", "b"],
                                                                     "team": ["x"]}
    assert aws.parse_tag_filters(["empty="]) == {"empty": [""]}
    with pytest.raises(DiscoveryInputError, match="'pool'"):
        aws.parse_tag_filters(["pool"])
    assert parse_type_slots(["t3.large=2"]) == {"t3.large": 2}
    with pytest.raises(DiscoveryInputError, match="'t3.large=x'"):
        parse_type_slots(["t3.large=x"])


def test_no_pool_selector_is_input_error():
    with pytest.raises(DiscoveryInputError, match="--tag"):
        aws.discover(Deadline(1))


# moto's server ignores MaxResults and never returns a NextToken for
# DescribeSpotInstanceRequests (moto 5.2), so following its pages is pinned
# here with botocore's own Stubber, which checks every request and response
# against the EC2 service model. The same paging loop reads DescribeInstances
# pages from moto in tests/discovery/test_discovery_aws_live.py.
def test_spot_request_pages_are_all_read_and_a_reclaim_on_page_two_counts(monkeypatch):
    from botocore.stub import Stubber

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}.items():
        monkeypatch.setenv(key, value)
    pool = aws_api.Ec2Pool(Deadline(60), region="us-east-1", endpoint_url="http://127.0.0.1:9",
                           call_timeout_s=3.0, page_size=5)
    client, _ = pool._client("ec2", "setup")  # the client every call within the bound reuses
    ids = [f"i-{n}" for n in range(1, 8)]
    query = {"Filters": [{"Name": "instance-id", "Values": ids}], "MaxResults": 5}
    with Stubber(client) as stub:
        stub.add_response("describe_spot_instance_requests",
                          {"SpotInstanceRequests": [spot(i, "fulfilled") for i in ids[:5]],
                           "NextToken": "page-2"}, query)
        stub.add_response("describe_spot_instance_requests",
                          {"SpotInstanceRequests": [spot("i-6", "fulfilled"),
                                                    spot("i-7", "marked-for-termination")]},
                          dict(query, NextToken="page-2"))
        requests = pool.spot_requests(ids)
        stub.assert_no_pending_responses()
    assert [r["InstanceId"] for r in requests] == ids
    hosts = aws.select_hosts([inst(i) for i in ids], requests, aws.SlotPolicy(slots=1))
    assert "10.0.0.7" not in [h.host for h in hosts] and len(hosts) == 6


def test_a_repeated_next_token_ends_the_paging(monkeypatch):
    from botocore.stub import Stubber

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    pool = aws_api.Ec2Pool(Deadline(60), region="us-east-1", endpoint_url="http://127.0.0.1:9")
    client, _ = pool._client("ec2", "setup")
    with Stubber(client) as stub:
        for _ in range(2):
            stub.add_response("describe_spot_instance_requests",
                              {"SpotInstanceRequests": [], "NextToken": "same"})
        with pytest.raises(DiscoveryUnavailableError, match="NextToken 'same' twice"):
            pool.spot_requests(["i-1"])


def test_page_size_outside_what_aws_accepts_is_an_input_error():
    with pytest.raises(DiscoveryInputError, match=r"page_size \(2\) must be an integer from 5 to 1000"):
        aws_api.Ec2Pool(Deadline(5), region="us-east-1", page_size=2)
