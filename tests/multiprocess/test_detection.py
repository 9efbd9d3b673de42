"""Failure detection with real horovodrun: hung workers.

Horovod's driver only re-forms the job when a worker exits, so a hung worker
(SIGSTOP, or a step that never ends) wedges a plain Horovod job; these tests
check that elastic_ext turns hangs into failures within the configured bound.
That a SIGTERMed worker leaves at its next commit without a rollback or a
lost step is checked by
test_zoo.py::test_removal_only_resize_with_a_spare_slot_finishes_exactly_once
(and its durable commit by test_lifecycle.py).
That a slow worker is never mistaken for a dead one is checked, with the
other things a healthy job does that look like failures, by
test_lifecycle.py::test_a_slow_rank_and_short_slowdowns_under_the_straggler_policy_kill_and_evict_nobody.

Two workers, one per pseudo-host: what is tested happens in the failing
worker and its peer. That the failure then reaches every survivor at once,
not after Gloo's timeout, needs peers that are not the victim's ring
neighbours: the 4-worker abort job of test_lifecycle.py checks it
(test_the_abort_cuts_only_the_collective_connections: no Gloo timeout).
"""

import json
import os

import pytest

from elastic_ext.testing import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4
HOSTS = ["localhost:1", "127.0.0.1:1"]


def run_job(tmp_path, *worker_args, env=None):
    """One job of train_torch.py on HOSTS (2 workers, 1 to 2), one epoch, to its end; returns (out, output)."""
    return launch.run_job(tmp_path, "train_torch.py", *worker_args, hosts=HOSTS, np_=2, min_np=1, max_np=2,
                          commit_every=COMMIT_EVERY, env=env)


def fired(out):
    marks = [json.load(open(out / "faults" / name)) for name in os.listdir(out / "faults")]
    assert len(marks) == 1, marks
    return marks[0]


def assert_recovered_without_gloo_timeout(out, output):
    """The job re-formed because elastic_ext acted, not because Gloo gave up.

    Gloo's own timeout (30 s) would end in "Timed out" / "Wait timeout"
    messages and would not re-form the job at all: the frozen worker never
    reaches the driver's barrier. The run must show a second generation.
    """
    assert "Timed out" not in output and "Wait timeout" not in output, output[-3000:]
    records = ledger.read(str(out))
    assert {r["gen"] for r in records if "gen" in r} >= {1, 2}


@pytest.mark.exclusive  # a stall or hang timeout of 3 s
@pytest.mark.timeout(300)
def test_a_sigstopped_worker_is_killed_and_the_job_recovers_by_the_guardian(tmp_path):
    hang_timeout_s = 3.0
    out, output = run_job(tmp_path, "--faults", "1:10:stop", env={"ELASTIC_EXT_HANG_TIMEOUT_S": str(hang_timeout_s)})
    kills = [line for line in output.splitlines() if "sent no heartbeat" in line]
    assert len(kills) == 1, f"the guardian must kill exactly the stopped worker: {kills}"
    assert f"sent no heartbeat for {hang_timeout_s:.1f}s" in kills[0], kills[0]
    assert fired(out)["how"] == "stop"
    assert_recovered_without_gloo_timeout(out, output)
    events = analysis.read_events(str(out / "events.jsonl"))
    assert [e for e in events if e["event"] == "rollback"]
    analysis.assert_exactly_once(out, DIGITS, 1)
    assert sorted(analysis.load_finals(out)) == [0]


@pytest.mark.exclusive  # a stall or hang timeout of 3 s
@pytest.mark.timeout(300)
def test_a_step_that_never_ends_kills_only_the_stuck_worker(tmp_path):
    stall_timeout_s = 3.0
    out, output = run_job(tmp_path, "--faults", "1:10:hang", env={"ELASTIC_EXT_STALL_TIMEOUT_S": str(stall_timeout_s)})
    events = analysis.read_events(str(out / "events.jsonl"))
    stalls = [e for e in events if e["event"] == "stall"]
    assert len(stalls) == 1, "exactly the stuck worker must declare itself stuck"
    assert stalls[0]["idle_s"] >= stall_timeout_s
    assert fired(out)["how"] == "hang"
    assert "sent no heartbeat" not in output, "the stuck worker must kill itself, not wait for the guardian"
    assert_recovered_without_gloo_timeout(out, output)
    analysis.assert_exactly_once(out, DIGITS, 1)
    assert sorted(analysis.load_finals(out)) == [0]
