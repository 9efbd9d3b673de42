"""Crashes on real hosts, one job over ssh: a worker SIGKILLed, every process of a host killed, a host added.

Hosts: eeh1 with two slots, eeh2 with one; eeh3 joins through the
discovery script. Horovod orders ranks its own way, so the faults pick
hosts, not ranks. The phases, in order:

1. once the job reached step 6, one of eeh1's two workers is SIGKILLed:
   the kernel resets its connections and every rank rolls back to the last
   commit; its host mate stays, and a new worker takes the slot;
2. once a later generation reached step 12, every process of eeh2 but its
   sshd is killed (a crashed machine whose connections reset): the job
   rolls back again and goes on without eeh2, which stays out;
3. at step 20 rank 0 adds eeh3 to the host file: its worker joins.

Every sample is seen exactly once over the committed history, no
generation resumed more than one commit back, and every rank ends with
the same weights.
"""

import json
import time

import pytest

from devkit import ledger
from tests.multihost import jobs
from tests.multiprocess import analysis, launch

KILL_STEP = 6
HOST_KILL_STEP = 12
ADD_STEP = 20
EPOCHS = 2


@pytest.mark.timeout(420)
def test_a_killed_worker_a_killed_host_and_an_added_host(cluster, tmp_path):
    out = tmp_path / "job"
    hosts_file = out / "hosts"
    job = jobs.start(cluster, out, ["eeh1:2", "eeh2:1"], 3, 2, 4, "--epochs", str(EPOCHS), "--step-sleep-s", "0.2",
                     "--resize-at", f"{ADD_STEP}:{hosts_file}:eeh1:2,eeh2:1,eeh3:1")
    try:
        jobs.wait_for(job, f"step {KILL_STEP}", jobs.reached(out, KILL_STEP))
        victims = jobs.workers_on(cluster, cluster.host("eeh1"))
        assert len(victims) == 2, f"eeh1 must run two workers, found {victims}"
        killed_at = time.time()
        launch.kill_worker(victims[0])
        jobs.wait_for(job, "the recovery from the SIGKILL",
                      lambda: [e for e in jobs.events(out, "recovered") if e["time"] > killed_at])
        jobs.wait_for(job, f"step {HOST_KILL_STEP} after the first recovery",
                      jobs.reached(out, HOST_KILL_STEP, after_gen=1))
        host_killed_at = time.time()
        killed = cluster.kill_host(cluster.host("eeh2"))
        jobs.finish(job)
    finally:
        job.kill()

    records = ledger.read(str(out))
    starts = ledger.starts(records)
    rollbacks = [e for e in jobs.events(out, "rollback") if killed_at < e["time"] < host_killed_at]
    assert rollbacks, "phase 1 (a worker of eeh1 SIGKILLed): no rollback followed"
    analysis.assert_no_step_went_back_past_a_commit(str(out), jobs.COMMIT_EVERY)
    assert killed, "phase 2: no process ran on eeh2 to kill"
    rollbacks = [e for e in jobs.events(out, "rollback") if e["time"] > host_killed_at]
    assert rollbacks, "phase 2 (eeh2's processes killed): no rollback followed"
    events = jobs.events(out)
    added = [e for e in events if e["event"] in ("prestart", "resize") and e["time"] > killed_at]
    assert added, f"phase 3 (eeh3 added at step {ADD_STEP}): no early start nor resize followed"
    finals = {}
    for path in sorted(out.glob("final-*.json")):
        with open(path) as handle:
            finals[path.name] = json.load(handle)
    assert sorted(finals) == ["final-0.json", "final-1.json", "final-2.json"] and \
        {f["size"] for f in finals.values()} == {3}, (
        f"phase 3: the job must end on eeh1's two workers and eeh3's (eeh2 stays out): {finals}")
    report, _ = jobs.assert_exactly_once_and_equal(out, EPOCHS, "whole job")
    newcomer_joined = min(e["time"] for e in events if e["event"] == "recovered" and e["time"] > host_killed_at
                          and e["size"] == 3)
    jobs.record(out, fault="crashes",
                sigkill_to_next_step_s=round(jobs.first_step_after(out, killed_at) - killed_at, 2),
                host_kill_to_next_step_s=round(jobs.first_step_after(out, host_killed_at) - host_killed_at, 2),
                host_kill_to_newcomer_in_s=round(newcomer_joined - host_killed_at, 2),
                lost_steps=report["lost_steps"], generations=len(starts))
