"""Failure detection with real horovodrun: hung workers.

Horovod's driver only re-forms the job when a worker exits, so a hung worker
(SIGSTOP, or a step that never ends) wedges a plain Horovod job; this job
checks that elastic_ext turns both hangs into failures within the configured
bounds, one after the other: the guardian kills a SIGSTOPped worker, and a
worker whose step never ends (its heartbeat thread alive, so no guardian
kill) declares itself stuck and ends itself.
That a SIGTERMed worker leaves at its next commit without a rollback or a
lost step is checked by
test_zoo.py::test_removal_only_resize_with_a_spare_slot_finishes_exactly_once
(and its durable commit by test_lifecycle.py).
That a slow worker is never mistaken for a dead one is checked, with the
other things a healthy job does that look like failures, by
test_lifecycle.py::test_a_slow_rank_and_short_slowdowns_under_the_straggler_policy_kill_and_evict_nobody.

Three workers, one per pseudo-host: each hang takes one worker (and, under
plain horovodrun, its host). That a failure reaches every survivor at once,
not after Gloo's timeout, needs peers that are not the victim's ring
neighbours: the 4-worker abort job of test_lifecycle.py checks it
(test_the_abort_cuts_only_the_collective_connections: no Gloo timeout).
"""

import json
import os

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4
TIMEOUT_S = 3.0  # the guardian's (hang) and the stall check's


def fired(out):
    """The faults that fired, by how: {"stop": mark, "hang": mark}."""
    return {mark["how"]: mark for mark in (json.load(open(out / "faults" / name))
                                           for name in os.listdir(out / "faults"))}


@pytest.mark.exclusive  # a stall and a hang timeout of 3 s
@pytest.mark.timeout(300)
def test_a_sigstopped_worker_and_a_step_that_never_ends_each_cost_one_worker_and_the_job_recovers(tmp_path):
    # Rank 2 is SIGSTOPped at step 10; in the next generation (ranks 0 and 1), rank 1's step 20 never ends.
    hosts = ["localhost:1", "127.0.0.1:1", f"{launch.third_host()}:1"]
    out, output = launch.run_job(tmp_path, "train_torch.py", "--faults", "2:10:stop,1:20:hang", hosts=hosts,
                                 np_=3, min_np=1, max_np=3, commit_every=COMMIT_EVERY,
                                 env={"ELASTIC_EXT_HANG_TIMEOUT_S": str(TIMEOUT_S),
                                      "ELASTIC_EXT_STALL_TIMEOUT_S": str(TIMEOUT_S)})
    marks = fired(out)
    assert sorted(marks) == ["hang", "stop"], f"the faults that fired: {marks}"
    events = analysis.read_events(str(out / "events.jsonl"))
    records = ledger.read(str(out))
    sizes = analysis.sizes_by_generation(records)

    # Phase "SIGSTOP": the guardian kills exactly the stopped worker, after its timeout; the others roll back.
    kills = [line for line in output.splitlines() if "sent no heartbeat" in line]
    assert len(kills) == 1, f"phase 'SIGSTOP': the guardian must kill exactly the stopped worker: {kills}"
    assert f"sent no heartbeat for {TIMEOUT_S:.1f}s" in kills[0], f"phase 'SIGSTOP': {kills[0]}"
    assert sizes[:2] == [[3], [2]], f"phase 'SIGSTOP': world sizes by generation {sizes}"

    # Phase "hang": the stuck worker declares itself stuck (not killed by its guardian: its heartbeat
    # thread still beats) and ends; rank 0 goes on alone.
    stalls = [e for e in events if e["event"] == "stall"]
    assert len(stalls) == 1, f"phase 'hang': exactly the stuck worker must declare itself stuck: {stalls}"
    assert stalls[0]["idle_s"] >= TIMEOUT_S, f"phase 'hang': {stalls[0]}"
    assert sizes[2:] == [[1]], f"phase 'hang': world sizes by generation {sizes}"

    # Both: elastic_ext acted, not Gloo's own timeout (30 s, which would not re-form the job at all: the
    # frozen worker never reaches the driver's barrier); two rollbacks; every sample once.
    assert "Timed out" not in output and "Wait timeout" not in output, output[-3000:]
    rollbacks = [e for e in events if e["event"] == "rollback" and e["rank"] == 0]
    assert len(rollbacks) == 2, f"rank 0 must roll back once per hang: {rollbacks}"
    analysis.assert_exactly_once(out, DIGITS, 1)
    assert sorted(analysis.load_finals(out)) == [0]


@pytest.mark.timeout(300)
def test_a_host_whose_worker_ended_itself_on_closed_links_beside_a_killed_one_stays_in_the_job(tmp_path):
    # Ranks 0 and 1 share the first pseudo-host. At step 10 rank 0 is SIGKILLed and rank 1 ends as the
    # closed-links watch ends a worker stuck on its dead peers' connections (a send Gloo never wakes,
    # seen on real hosts). Horovod's driver takes a host whose every worker failed in one round for a
    # lost machine; elastic-horovodrun's driver reads rank 1's exit status as "its peers failed" and
    # keeps the host: ranks 2 and 3 go on at once and the host's two slots come back, to 4 workers.
    out, output = launch.run_job(tmp_path, "train_torch.py", "--faults", "0:10:kill,1:10:peers_failed",
                                 np_=4, min_np=2, max_np=4, commit_every=COMMIT_EVERY, launcher=True)
    marks = fired(out)
    assert sorted(marks) == ["kill", "peers_failed"], f"the faults that fired: {marks}"
    sizes = analysis.sizes_by_generation(ledger.read(str(out)))
    assert sizes[0] == [4] and sizes[1] == [2], f"phase 'failure': world sizes by generation {sizes}"
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1, 2, 3], f"phase 'regrow': the host's two slots must come back: {sorted(finals)}"
    assert "not blacklisting" in output and "because its peers failed" in output, (
        f"phase 'failure': the driver must say why it kept the host: {output[-5000:]}")
    assert "removed from elastic job" not in output, output[-5000:]
    analysis.assert_exactly_once(out, DIGITS, 1)
    analysis.assert_ranks_identical(finals)
