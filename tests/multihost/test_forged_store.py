"""Forged store requests from a host outside the job, and from a job host without the secret, change nothing.

The job: one-slot workers on eeh1 and eeh2, the driver (and its store) on
eeh0; eeh3 is a host of the cluster that the job's discovery never
listed. Twice while the job trains, the forger (``forger.py``) runs on
eeh3 without the job's secret and sends a GET and PUTs of the launcher's
keys to the driver's store: a pickle that would create a directory, a
garbage round number, ``failed_`` of the current round and the next, a
dismissal and a preemption notice naming each job host, the early-start
marker. The store closes each of its connections unanswered
(``launch/store_guard.py``: a client that is neither on the driver's
machine nor at a listed host's address). Once, the same forger runs on
eeh1, a job host: its connections are served, which shows the address and
port are the store's, and every write is refused (400 for the pickle, 403
for the rest; the notice naming eeh1 itself, which the design accepts
from eeh1's own address, is not sent from there).

The store's address and port: the test reads them from the driver's ssh
command lines to the workers (``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``), which
every user of the driver's host sees; an attacker elsewhere would scan
for the port.

The job ends normally: exit 0, no rollback, member failure, leave or fence,
two workers from start to end, every sample exactly once, the ranks' final
weights equal, no marker.
"""

import json
import os
import re
import sys

import psutil
import pytest

from devkit.launch import command_line
from tests.multihost import jobs

EPOCHS = 2
FIRST_FORGERY_STEP = 4
SECOND_FORGERY_STEP = 16
FORGER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forger.py")
UNANSWERED = ("RemoteDisconnected", "ConnectionResetError", "BrokenPipeError", "ConnectionAbortedError",
              "BadStatusLine")
FORBIDDEN = ("rollback", "rollback_limit", "member_failed", "leave", "fenced", "links_closed", "reset",
             "recovered", "resize", "prestart", "newcomers_joined", "restarted_in_place")


def store_address(job):
    """(address, port) of the job's store, from a command line of one of the job's processes (the driver's ssh)."""
    for pid in job.members():
        try:
            line = " ".join(command_line(psutil.Process(pid)))
        except psutil.NoSuchProcess:
            continue  # ended since it was listed
        address = re.search(r"HOROVOD_GLOO_RENDEZVOUS_ADDR=(\S+)", line)
        port = re.search(r"HOROVOD_GLOO_RENDEZVOUS_PORT=(\d+)", line)
        if address and port:
            return address.group(1), int(port.group(1))
    return None


def forge(cluster, host, address, round_id, markers, job_hosts):
    """The forger's answers (request -> status or error name) from ``host``."""
    done = cluster.run(cluster.host(host), sys.executable, FORGER, address[0], str(address[1]), str(round_id),
                       str(markers), *job_hosts)
    return json.loads(done.stdout)


@pytest.mark.timeout(420)
def test_forged_store_requests_from_outside_the_job_change_nothing(cluster, tmp_path):
    out = tmp_path / "job"
    markers = tmp_path / "markers"
    markers.mkdir()
    job_hosts = ["eeh1", "eeh2"]
    job = jobs.start(cluster, out, [f"{host}:1" for host in job_hosts], 2, 1, 2, "--epochs", str(EPOCHS),
                     "--step-sleep-s", "0.2")
    try:
        jobs.wait_for(job, f"step {FIRST_FORGERY_STEP}", jobs.reached(out, FIRST_FORGERY_STEP))
        address = jobs.wait_for(job, "the store's address in the driver's ssh command lines",
                                lambda: store_address(job))
        inside = forge(cluster, "eeh1", address, 0, markers, ["eeh2"])
        outside = [forge(cluster, "eeh3", address, inside["round"], markers, job_hosts)]
        jobs.wait_for(job, f"step {SECOND_FORGERY_STEP}", jobs.reached(out, SECOND_FORGERY_STEP))
        outside.append(forge(cluster, "eeh3", address, inside["round"], markers, job_hosts))
        forged_until = max(r["step"] for r in jobs.steps(out))
        try:
            output, ended = jobs.finish(job), None
        except AssertionError as exc:  # failed or timed out: reported with what the forgeries did
            output, ended = open(job.log_path).read(), exc
    finally:
        job.kill()
    print(f"\nstore at {address}; from eeh1 (a job host): {inside}\nfrom eeh3 (outside the job): {outside}")

    # Every way the forgeries showed, together (a store that accepts them shows several).
    problems = []
    loaded = sorted(p.name for p in markers.iterdir())
    if loaded:
        problems.append(f"a forged pickle was loaded (markers made: {loaded})")
    # From a job host the store answers, and refuses each write.
    expected = {name: 400 if "worker_addresses" in name else 403 for name in inside if name.startswith("PUT")}
    if inside["GET /elastic_ext_round/current"] != 200 or inside["round"] < 1:
        problems.append(f"eeh1, a job host, could not read the round from the store: {inside}")
    if {name: inside[name] for name in expected} != expected:
        problems.append(f"eeh1's forged writes were not all refused: {inside}")
    # From outside the job not one request is answered.
    for statuses in outside:
        answered = {name: status for name, status in statuses.items()
                    if name != "round" and status not in UNANSWERED}
        if answered:
            problems.append(f"the store answered eeh3, a host outside the job: {answered}")
    if f"the driver's store closes a connection from {cluster.host('eeh3').address}" not in output:
        problems.append("the driver logged no closed connection from eeh3")
    noticed = re.findall(r"host (\S+) has a preemption notice", output)
    if noticed or "dismissed this worker" in output:
        problems.append(f"hosts dropped on a forged notice: {noticed}; a worker dismissed: "
                        f"{'dismissed this worker' in output}")
    disturbed = [e for e in jobs.events(out) if e["event"] in FORBIDDEN]
    if disturbed:
        problems.append(f"events of a disturbed job: {[(e['event'], e.get('rank')) for e in disturbed][:20]}")
    sizes = sorted({(r["gen"], r["size"]) for r in jobs.steps(out)})
    if len(sizes) != 1 or sizes[0][1] != 2:
        problems.append(f"(generation, world size) of the steps: {sizes}; the job must train on eeh1 and eeh2 "
                        f"from start to end")
    if max(r["step"] for r in jobs.steps(out)) <= forged_until:
        problems.append("the job trained no step after the forgeries")
    if ended is not None:
        problems.append(str(ended)[:3000])
    assert not problems, "the forgeries changed the job:\n- " + "\n- ".join(problems)
    _, finals = jobs.assert_exactly_once_and_equal(out, EPOCHS, "whole job")
    assert sorted(finals) == [0, 1], f"final states of ranks {sorted(finals)}"
