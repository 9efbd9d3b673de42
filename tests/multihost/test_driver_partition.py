"""The driver's host cut off from every worker, under ``supervise`` with durable checkpoints.

The workers (eeh1, eeh2) still reach each other; the driver and its
rendezvous server (eeh0) reach nobody. What happens, phase by phase:

1. The workers train on together for a while (their collectives need no
   driver) but cannot reach the rendezvous server: after the driver watch's
   bound each fences itself (a ``fenced`` event, then exit), so no half of
   the job trains on unsupervised and writes checkpoints beside the next.
2. The driver's ssh sessions end once their keepalives go unanswered:
   every worker of the round failed, Horovod's driver ends the job with a
   failure, and ``supervise`` records a ``job_restart``.
3. The partition heals; ``supervise`` starts the job again, which resumes
   from the newest durable checkpoint and finishes.

Every sample is seen exactly once over both runs' committed history, and
both ranks end with the same weights.
"""

import time

import pytest

from tests.multihost import jobs
from tests.multiprocess import analysis

EPOCHS = 2
PARTITION_STEP = 8
STEP_SLEEP_S = 0.4  # training must outlast the fence (about 13 s after the partition): 50 steps left


@pytest.mark.timeout(420)
def test_a_driver_cut_off_from_its_workers_fences_them_and_the_supervised_job_resumes(cluster, tmp_path):
    out = tmp_path / "job"
    ckpt = out / "ckpt"
    env = {"ELASTIC_EXT_CHECKPOINT_DIR": str(ckpt), "ELASTIC_EXT_CHECKPOINT_EVERY": "1"}
    job = jobs.start(cluster, out, ["eeh1:1", "eeh2:1"], 2, 2, 2, "--epochs", str(EPOCHS),
                     "--step-sleep-s", str(STEP_SLEEP_S), worker="train_torch_ckpt.py", env=env,
                     supervise=["--max-restarts", "2", "--backoff-s", "3"])
    driver = cluster.hosts[0]
    try:
        jobs.wait_for(job, f"step {PARTITION_STEP} and a durable checkpoint",
                      lambda: jobs.reached(out, PARTITION_STEP)() and analysis.durable_commit_ids(ckpt))
        partitioned_at = time.time()
        cluster.partition(driver)
        restart = jobs.wait_for(job, "supervise restarting the job", lambda: jobs.events(out, "job_restart"))
        healed_at = time.time()
        cluster.heal(driver)
        jobs.finish(job)
    finally:
        job.kill()

    events = jobs.events(out)
    fenced = [e for e in events if e["event"] == "fenced"]
    assert len(fenced) == 2 and all(e["time"] < restart[0]["time"] for e in fenced), (
        f"phase 1: both workers must fence themselves before the job is restarted: {fenced}, {restart}")
    first_run = [r for r in jobs.steps(out) if not r.get("restart")]
    last_fence = max(e["time"] for e in fenced)
    assert not [r for r in first_run if r["t"] > last_fence], "phase 1: a fenced worker went on training"
    assert len(restart) == 1 and restart[0]["exit_code"] != 0, f"phase 2: job_restart events {restart}"
    resumed = [e for e in events if e["event"] == "checkpoint_resumed"]
    durable_then = [e["commit_id"] for e in events if e["event"] == "checkpoint" and e["time"] < partitioned_at]
    assert resumed and resumed[0]["commit_id"] >= max(durable_then), (
        f"phase 3: resumed from {resumed}, checkpoints durable before the partition {durable_then}")
    report, finals = jobs.assert_exactly_once_and_equal(out, EPOCHS, "both runs")
    assert sorted(finals) == [0, 1]
    jobs.record(out, fault="driver_partition",
                partition_to_fenced_s=[round(e["time"] - partitioned_at, 2) for e in fenced],
                partition_to_driver_exit_s=round(restart[0]["time"] - partitioned_at, 2),
                heal_to_next_step_s=round(jobs.first_step_after(out, healed_at) - healed_at, 2),
                resumed_commit=resumed[0]["commit_id"], lost_steps=report["lost_steps"])
