"""Network faults on real hosts, one job of three one-slot hosts over ssh: a slow, lossy link, then a partition.

1. eeh2's link delays every frame 50 ms and drops 1 % of them, each way,
   from before the job starts until step 8: the job trains through it,
   nothing rolls back and no worker is killed.
2. At step 12 every packet to and from eeh3 starts to vanish (no reset,
   nothing refused). The driver's ssh to eeh3 ends once its keepalives go
   unanswered; the survivors read the failed member from the driver, cut
   their collective links and roll back, and the job goes on on two hosts.
   eeh3's worker, stuck in its collective and unable to reach its driver,
   fences itself (it exits; it neither trains on alone nor hangs).
3. The partition heals. Once Horovod's blacklist cooldown for eeh3 is
   over, the driver offers it again; at step 32 rank 0 waits for that, and
   a new worker on eeh3 joins as a newcomer.

Every sample is seen exactly once over the committed history, and every
rank ends with the same weights.
"""

import json
import time

import psutil
import pytest

from tests.multihost import jobs
from tests.multihost.jobs import COMMIT_EVERY

EPOCHS = 2
SLOW_UNTIL_STEP = 8
PARTITION_STEP = 12
REJOIN_STEP = 32
COOLDOWN_RANGE = ("3", "6")  # Horovod's blacklist cooldown, s: the healed host is offered again 6 s after
DELAY_MS, LOSS_PERCENT = 50, 1


def connect_time_s(cluster, source, target):
    """Seconds for a TCP handshake from ``source`` to ``target``'s sshd (one round trip)."""
    code = (f"import socket, time; t = time.monotonic(); socket.create_connection(('{target.address}', 22), 10)"
            f".close(); print(time.monotonic() - t)")
    return float(cluster.run(source, "python3", "-c", code).stdout)


@pytest.mark.timeout(480)
def test_a_slow_link_then_a_partitioned_host_that_heals_and_rejoins(cluster, tmp_path):
    near, slow, cut = cluster.host("eeh1"), cluster.host("eeh2"), cluster.host("eeh3")
    mechanism = cluster.degrade(slow, DELAY_MS, LOSS_PERCENT)
    rtt = connect_time_s(cluster, near, slow)
    assert rtt >= 2 * DELAY_MS / 1000 * 0.9, f"eeh2's link is not slow ({mechanism}): a handshake took {rtt:.3f}s"
    out = tmp_path / "job"
    hosts = ["eeh1:1", "eeh2:1", "eeh3:1"]
    job = jobs.start(cluster, out, hosts, 3, 2, 3, "--epochs", str(EPOCHS), "--step-sleep-s", "0.2",
                     "--resize-at", f"{REJOIN_STEP}:{out / 'hosts'}:{','.join(hosts)}",
                     horovodrun_args=["--blacklist-cooldown-range", *COOLDOWN_RANGE])
    try:
        jobs.wait_for(job, f"step {SLOW_UNTIL_STEP} over the slow link", jobs.reached(out, SLOW_UNTIL_STEP))
        slow_until = time.time()
        cluster.restore(slow)
        jobs.wait_for(job, f"step {PARTITION_STEP}", jobs.reached(out, PARTITION_STEP))
        partitioned_at = time.time()
        cluster.partition(cut)
        at = max(r["step"] for r in jobs.steps(out))
        assert at < REJOIN_STEP - COMMIT_EVERY, f"the partition came too late (step {at}) to test the rejoin"
        fenced = jobs.wait_for(job, "the partitioned worker fencing itself", lambda: jobs.events(out, "fenced"))
        jobs.wait_for(job, "the survivors' recovery without eeh3",
                      lambda: [e for e in jobs.events(out, "recovered") if e["time"] > partitioned_at])
        fenced_pid = fenced[0]["pid"]
        jobs.wait_for(job, "the fenced worker's exit", lambda: not psutil.pid_exists(fenced_pid), timeout_s=10)
        healed_at = time.time()
        cluster.heal(cut)
        jobs.finish(job)
    finally:
        job.kill()

    events = jobs.events(out)
    before = [e for e in events if e["time"] < partitioned_at]
    assert not [e for e in before if e["event"] in ("rollback", "stall", "fenced", "member_failed")], (
        f"phase 1 (slow link, {mechanism}): the job recovered from something before the partition: "
        f"{[e for e in before if e['event'] in ('rollback', 'stall', 'fenced', 'member_failed')]}")
    slow_steps = [r for r in jobs.steps(out) if r["t"] < slow_until]
    assert max(r["step"] for r in slow_steps) >= SLOW_UNTIL_STEP and {r["size"] for r in slow_steps} == {3}, (
        "phase 1: the three workers did not train together over the slow link")

    failed = [e for e in events if e["event"] == "member_failed"]
    assert failed and {e["member"] for e in failed} == {"eeh3:0"}, f"phase 2: survivors' member_failed: {failed}"
    assert len(fenced) == 1 and fenced[0]["unreachable_s"] > 0, f"phase 2: fenced events: {fenced}"
    # Steps it finished after the test's clock read the partition's time are steps whose collective
    # completed before the cut took hold (their peers finished them too, in the same generation and
    # world); a step the others never trained in that generation and world would be training alone.
    own, others = [], set()
    for path in out.glob("steps-*.jsonl"):
        with open(path) as handle:
            records = [json.loads(line) for line in handle if line.strip()]
        if path.name == f"steps-{fenced_pid}.jsonl":
            own = [r for r in records if "gen" in r]
        else:
            others |= {(r["gen"], r["step"], r["size"]) for r in records if "gen" in r}
    late = [(r["gen"], r["step"], r["size"]) for r in own if r["t"] > partitioned_at]
    alone = [key for key in late if key not in others]
    assert own and not alone, (
        f"phase 2: the partitioned worker trained on alone: (generation, step, size) {alone} of its late "
        f"steps {late}")

    sizes = [size for size in (sorted({r["size"] for r in jobs.steps(out) if r["gen"] == g})
                               for g in sorted({r["gen"] for r in jobs.steps(out)}))]
    assert [2] in sizes, f"phase 2: world sizes by generation {sizes}; the job did not go on without eeh3"
    # eeh3's new worker joins at a commit once it has started (early start): on a loaded machine that
    # may be the job's last commit, where a newcomer is taken in and trains no step.
    back = [e["time"] for e in events if e["event"] == "recovered" and e["time"] > healed_at and e["size"] == 3]
    assert back, f"phase 3: no reset to 3 workers after the heal; world sizes by generation {sizes}"
    report, finals = jobs.assert_exactly_once_and_equal(out, EPOCHS, "whole job")
    assert sorted(finals) == [0, 1, 2], f"phase 3: eeh3's worker is not in the job at its end: {sorted(finals)}"
    rejoined = min(back)
    jobs.record(out, fault="network", slow_link=mechanism, slow_link_handshake_s=round(rtt, 3),
                partition_to_next_step_s=round(jobs.first_step_after(out, partitioned_at) - partitioned_at, 2),
                partition_to_member_failed_s=round(min(e["time"] for e in failed) - partitioned_at, 2),
                partition_to_fenced_s=round(fenced[0]["time"] - partitioned_at, 2),
                heal_to_rejoined_s=round(rejoined - healed_at, 2), lost_steps=report["lost_steps"])
