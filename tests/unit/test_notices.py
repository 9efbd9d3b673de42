"""Preemption notices: each cloud's client against a server that answers as the cloud documents it,
the detection of the cloud, the worker's leave, and the driver's side (Horovod's real driver and store).

The server (devkit.metadata_server) checks what each cloud
checks: IMDSv2's token, GCP's Metadata-Flavor, Azure's Metadata header and
api-version; the clients are asserted to pass those checks (no 401, 403 or
400 in the server's log) and to turn the documented bodies into notices.
"""

import os
import signal
import threading
import time

import pytest

from elastic_ext.config import ElasticConfig, notice_endpoints
from elastic_ext.errors import ConfigError
from elastic_ext.launch import noticed_hosts
from elastic_ext.worker import metadata, notices
from elastic_ext.liveness import Liveness
from devkit.metadata_server import ENV, MetadataServer
from tests.unit.horovod_restore import changes  # noqa: F401 - a fixture
from tests.unit.test_horovodrun import Job
from tests.unit.test_prestart import wait_for

CONFIG = ElasticConfig(term_grace_s=7.0)


@pytest.fixture
def server():
    with MetadataServer() as running:
        yield running


def base(server, host="m1"):
    return server.base_url.replace("{host}", host)


def refused(server):
    return [entry for entry in server.log if entry[3] in (400, 401, 403)]


# ------------------------------------------------------------------ the three clouds

def test_aws_asks_with_an_imdsv2_token_and_a_scheduled_instance_action_is_a_notice_to_leave(server):
    client = metadata.AwsImds(base(server))
    assert client.check() is None, "404 on both paths: nothing scheduled"
    server.announce("m1", "aws", "rebalance")
    advisory = client.check()
    assert (advisory.kind, advisory.leave, set(advisory.detail)) == ("rebalance", False, {"noticeTime"})
    assert client.check() is None, "a rebalance recommendation is reported once"
    server.machine("m1").tokens.clear()  # the token expired: a 401, then one new token
    server.announce("m1", "aws", "stop")
    notice = client.check()
    assert (notice.source, notice.kind, notice.leave) == ("aws", "instance-action", True)
    assert notice.detail["action"] == "stop" and notice.detail["time"].endswith("Z")
    puts = [entry for entry in server.log if entry[1] == "PUT"]
    assert [entry[3] for entry in puts] == [200, 200], "one token, and a second after the first expired"
    assert [entry[2] for entry in refused(server)] == ["/latest/meta-data/spot/instance-action"]
    status, _, _ = metadata.request(base(server) + metadata.AwsImds.ACTION_PATH, {})
    assert status == 401, "the server, like IMDSv2, refuses a GET without a token"


def test_gcp_holds_the_request_until_the_vm_is_preempted(server):
    client = metadata.GcpMetadata(base(server))
    assert client.check() is None, "FALSE: not preempted"
    found = []
    waiter = threading.Thread(target=lambda: found.append(client.check()))
    waiter.start()
    server.wait_held(10)  # the second request waits for a change (wait_for_change with the first's ETag)
    server.announce("m1", "gcp")
    waiter.join(10)
    assert not waiter.is_alive() and found and found[0].leave and found[0].detail == {"preempted": "TRUE"}
    assert not refused(server)
    status, _, _ = metadata.request(base(server) + metadata.GcpMetadata.PATH, {})
    assert status == 403, "the server, like GCP's, refuses a request without Metadata-Flavor: Google"


def test_azure_acts_on_a_preempt_of_this_vm_only(server):
    client = metadata.AzureScheduledEvents(base(server))
    assert client.check() is None
    assert client.vm_name == "vm-m1"
    machine = server.machine("m1")
    server.add_azure_event(machine, "Preempt", ["vm-other"], time.time())  # another VM of the availability set
    assert client.check() is None
    server.add_azure_event(machine, "Freeze", ["vm-m1"], time.time())
    freeze = client.check()
    assert (freeze.kind, freeze.leave) == ("Freeze", False), "reported, not acted on"
    assert client.check() is None, "each advisory event is reported once"
    server.announce("m1", "azure")
    notice = client.check()
    assert (notice.kind, notice.leave, notice.detail["Resources"]) == ("Preempt", True, ["vm-m1"])
    assert notice.detail["EventStatus"] == "Scheduled" and notice.detail["NotBefore"].endswith("GMT")
    assert not refused(server)
    status, body, _ = metadata.request(base(server) + metadata.AzureScheduledEvents.EVENTS_PATH, {})
    assert status == 400 and b"metadata header" in body


def test_an_endpoint_that_answers_what_no_cloud_documents_is_an_error_not_a_notice(server):
    # A GCP client pointed at the AWS paths' server answers 404: never read as "not preempted".
    wrong = metadata.GcpMetadata(base(server) + "/nothing")
    with pytest.raises(metadata.MetadataError, match="404"):
        wrong.check()


# ------------------------------------------------------------------ which cloud

@pytest.mark.parametrize("files, cloud", [
    ({"sys_vendor": "Amazon EC2"}, "aws"),
    ({"board_vendor": "Amazon EC2", "sys_vendor": "Amazon"}, "aws"),
    ({"product_name": "Google Compute Engine", "sys_vendor": "Google"}, "gcp"),
    ({"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": notices.AZURE_ASSET_TAG}, "azure"),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine"}, None),  # Hyper-V at home
    ({"sys_vendor": "QEMU"}, None),
    ({}, None),
])
def test_the_cloud_is_read_from_the_firmware(tmp_path, files, cloud):
    for name, text in files.items():
        (tmp_path / name).write_text(text + "\n")
    assert notices.cloud_from_dmi(str(tmp_path), str(tmp_path / "no-hypervisor")) == cloud


def test_the_endpoint_variable_names_clouds_and_urls_and_bad_values_are_named(tmp_path):
    assert notice_endpoints({}) is None
    assert notice_endpoints({ENV: "off"}) == []
    assert notice_endpoints({ENV: "aws=http://[fd00:ec2::254]/"}) == [("aws", "http://[fd00:ec2::254]")]
    assert notice_endpoints({ENV: "GCP, azure=http://x:1"}) == [("gcp", None), ("azure", "http://x:1")]
    for bad in ("ibm", "aws=ftp://x", "aws=,gcp"):
        with pytest.raises(ConfigError, match=f"{ENV} .*{bad.split(',')[0].split('=')[0]}"):
            notice_endpoints({ENV: bad})
    watched = notices.clients({ENV: "aws=http://127.0.0.1:9/{host},azure", "HOROVOD_HOSTNAME": "10.0.0.7"},
                              str(tmp_path))
    assert [(type(c).__name__, c.base_url) for c in watched] == [
        ("AwsImds", "http://127.0.0.1:9/10.0.0.7"), ("AzureScheduledEvents", metadata.AzureScheduledEvents.BASE_URL)]
    assert notices.clients({}, str(tmp_path)) == [], "no cloud in the firmware, none named: nothing to watch"


# ------------------------------------------------------------------ the worker

def test_a_notice_makes_the_worker_leave_at_its_next_commit_and_an_advisory_one_does_not(server):
    liveness = Liveness()
    seen = []

    def on_notice(notice):
        seen.append(notice)
        notices.act(notice, CONFIG, liveness, environ={})

    watcher = notices.Watcher(metadata.AwsImds(base(server)), on_notice)
    watcher.client.POLL_S = 0.05
    watcher.start()
    server.announce("m1", "aws", "rebalance")
    assert wait_for(lambda: len(seen) == 1, timeout_s=10)
    assert not liveness.leaving(), "a rebalance recommendation is advisory"
    server.announce("m1", "aws")
    watcher.join(10)
    assert not watcher.is_alive(), "the watcher stops after the notice that takes the host"
    assert liveness.leaving() and liveness.leave_cause == "preemption"
    assert 0 < liveness.leave_time_left() <= CONFIG.term_grace_s
    assert liveness.leave_notice["source"] == "aws" and liveness.leave_notice["detail"]["action"] == "terminate"


def test_an_endpoint_that_cannot_be_reached_is_asked_again_later_and_warned_about_once(caplog, monkeypatch):
    monkeypatch.setattr(notices, "RETRY_S", 0.01)
    stop = threading.Event()
    watcher = notices.Watcher(metadata.AwsImds("http://127.0.0.1:9"), lambda notice: None, stop)  # nothing listens
    with caplog.at_level("DEBUG", logger="elastic_ext.worker.notices"):
        watcher.start()
        assert wait_for(lambda: watcher.failures >= 3, timeout_s=20)
        stop.set()
        watcher.join(10)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "aws at http://127.0.0.1:9 failed" in warnings[0].getMessage()


@pytest.fixture
def service_class():
    """Horovod's WorkerNotificationService, given its own _handle back after the test."""
    from horovod.runner.elastic.worker import WorkerNotificationService

    original = WorkerNotificationService._handle
    try:
        yield WorkerNotificationService
    finally:
        WorkerNotificationService._handle = original


def test_sigusr1_is_a_notice_in_a_worker_of_an_elastic_job(tmp_path, service_class, monkeypatch):
    monkeypatch.setattr(notices, "_accepting", [])  # what install() sets for the driver's notices
    liveness = Liveness()
    env = {"HOROVOD_ELASTIC": "1", "SLURM_JOB_ID": "42", ENV: "off"}
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    try:
        assert notices.install(env, liveness, str(tmp_path)) == []
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(liveness.leaving, timeout_s=5)
        assert liveness.leave_notice["source"] == "slurm" and liveness.leave_notice["detail"] == {"slurm_job_id": "42"}
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert notices.install({}, liveness, str(tmp_path)) == [], "nothing outside an elastic horovodrun"
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


# ------------------------------------------------------------------ the driver

@pytest.fixture
def job(monkeypatch, changes):
    changes("noticed_hosts")
    monkeypatch.setattr(Job, "changed", True)  # the launcher's driver: its discovery leaves noticed hosts out
    started = Job({"host-a": 2, "host-b": 2}, 2, 4)
    started.start(4)
    try:
        yield started
    finally:
        started.stop()


def test_the_driver_drops_a_host_whose_worker_reported_a_notice(job):
    assert wait_for(lambda: set(job.driver._host_manager.current_hosts.available_hosts) == {"host-a", "host-b"})
    env = {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
           "HOROVOD_GLOO_RENDEZVOUS_PORT": str(job.port), "HOROVOD_HOSTNAME": "host-b"}
    assert notices.report_host(env)
    assert noticed_hosts.noticed == {"host-b"}
    # The discovery still lists host-b; the driver's next look leaves it out.
    assert wait_for(lambda: set(job.driver._host_manager.current_hosts.available_hosts) == {"host-a"}, timeout_s=10)
    assert job.discovery.find_available_hosts_and_slots() == {"host-a": 2, "host-b": 2}


def test_the_drivers_signal_reaches_every_worker_and_those_that_register_later(job, service_class, monkeypatch):
    from horovod.runner.common.util import secret
    from horovod.runner.elastic.worker import WorkerNotificationManager

    liveness, acted = Liveness(), []
    real_act = notices.act
    monkeypatch.setattr(notices, "act", lambda notice, *args, **kwargs: acted.append(notice) or real_act(
        notice, *args, **kwargs))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(notices, "_accepting", [])
    notices._accept_job_notices(CONFIG, liveness)
    # as the worker entry installs it (horovod_changes.install_worker); service_class puts Horovod's back
    service_class._handle = notices.job_notice_handler(service_class._handle)
    services = []

    def register(local_rank):
        key = secret.make_secret_key()
        services.append(service_class(key, None, WorkerNotificationManager()))
        job.driver.register_worker_server("host-a", local_rank, services[-1].addresses(), key)

    try:
        register(0)
        noticed_hosts.on_signal(signal.SIGUSR1, None)  # what the driver's handler runs
        assert wait_for(lambda: len(acted) == 1, timeout_s=10)
        register(1)  # a worker that was still starting when the signal came
        assert wait_for(lambda: len(acted) == 2, timeout_s=10)
    finally:
        for service in services:
            service.shutdown()
    assert [(n.source, n.kind, n.leave, n.detail) for n in acted] == [("slurm", "SIGUSR1", True,
                                                                        {"slurm_job_id": "77"})] * 2
    assert liveness.leaving() and liveness.leave_cause == "preemption"
