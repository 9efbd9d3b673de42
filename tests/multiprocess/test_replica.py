"""The replica check under real horovodrun: a bit flipped at any step between two commits is found,
every rank replays from the last agreed commit, and the job ends bitwise equal to the failure-free run;
a deterministic divergence stops the job and strikes no host.

One job of lifecycle.py (PyTorch, Adam, 4 workers on two 2-slot pseudo-hosts, 29 steps, a commit every
4 steps, replica check at every commit), with three faults declared up front, each before a step's
forward pass, two steps before the next commit: the corrupt copy's gradients go into every rank's
allreduce of those two steps before the check sees anything:

1. step 6, rank 1: one bit of a parameter (the first layer's weight);
2. step 14, rank 3: one bit of an Adam moment (that weight's exp_avg);
3. step 26, rank 1 again: its host is struck twice, so rank 1 adds it to the exclude file and
   leaves at the next commit (the job's last), without a rollback.

A second job plants a divergence: rank 2 steps its LR scheduler twice per step from step 9 on. The
check at every 2nd commit finds it at commit 4 (step 16), the replay from commit 2 finds the same rank
again, and every rank stops with StateDivergenceError; no host is struck, nothing is excluded.
"""

import pytest

from devkit.faults import FaultSchedule
from tests.multiprocess import analysis, launch
from tests.multiprocess.references import references  # noqa: F401  (the fixture)

DIGITS = 1797
COMMIT_EVERY = 4
FAULTS = "1:6:flip:step:param,3:14:flip:step:moment,1:26:flip:step:param"


def reference_run(directory):
    out, _ = launch.run_job(directory, "lifecycle.py", commit_every=COMMIT_EVERY,
                            env={"ELASTIC_EXT_REPLICA_CHECK_EVERY": "0"})
    finals = analysis.load_finals(str(out))
    analysis.assert_ranks_identical(finals)
    return finals[0]


@pytest.mark.timeout(500)
def test_bit_flips_two_steps_before_a_commit_are_undone_by_a_replay_and_a_host_struck_twice_leaves(tmp_path,
                                                                                                    references):
    reference = references.get(("lifecycle.py", "failure-free", 1, COMMIT_EVERY, launch.HOSTS), reference_run)
    exclude = tmp_path / "exclude"
    out, output = launch.run_job(tmp_path, "lifecycle.py", "--faults", FAULTS, commit_every=COMMIT_EVERY,
                                 env={"ELASTIC_EXT_REPLICA_CHECK_EVERY": "1", "ELASTIC_EXT_EXCLUDE_FILE": str(exclude)})
    events = analysis.read_events(str(out / "events.jsonl"))
    fired = sorted((f["rank"], f["step"], f["target"])
                   for f in FaultSchedule.parse(FAULTS, str(out / "faults")).fired())
    assert fired == [(1, 6, "param"), (1, 26, "param"), (3, 14, "moment")], fired

    kinds = [e["event"] for e in events]
    assert "rollback" not in kinds and "numeric_rollback" not in kinds, f"a replay is not a failure's rollback: {kinds}"
    replays = [e for e in events if e["event"] == "replica_replay"]
    assert sorted({(e["commit_id"], e["back_to"]) for e in replays}) == [(2, 1), (4, 3), (7, 6)], replays
    found = [e for e in events if e["event"] == "replica_mismatch"]
    by_commit = {}
    for event in found:
        by_commit.setdefault(event["commit_id"], []).append(event)
    assert sorted(by_commit) == [2, 4, 7], f"phase 'explained at the commit that differed': {sorted(by_commit)}"
    expected = {2: ([1], "model['0.weight']"), 4: ([3], "exp_avg"), 7: ([1], "model['0.weight']")}
    for commit_id, (wrong, entry) in expected.items():
        seen = by_commit[commit_id]
        assert sorted(e["rank"] for e in seen) == [0, 1, 2, 3], f"commit {commit_id}: every rank writes the event"
        for event in seen:
            assert event["cause"] == "transient" and event["healed"], f"commit {commit_id}: {event}"
            assert event["wrong_ranks"] == wrong and event["replayed_from"] == commit_id - 1, event
            assert sorted(event["majority_ranks"] + wrong) == [0, 1, 2, 3], event
            assert entry in event["first_difference"] or "model['0.weight']" in event["first_difference"], event
            assert event["struck_hosts"] == event["wrong_hosts"], event
        assert len({tuple(e["wrong_hosts"]) for e in seen}) == 1, f"commit {commit_id}: hosts differ by rank"
    host_1 = by_commit[2][0]["wrong_hosts"][0]
    assert by_commit[7][0]["wrong_hosts"] == [host_1] and by_commit[4][0]["wrong_hosts"] != [host_1]
    assert all(e["repeat_hosts"] == [] for c in (2, 4) for e in by_commit[c]), "phase 'first offence'"
    assert all(e["repeat_hosts"] == [host_1] for e in by_commit[7]), "phase 'second offence of the same host'"

    leaves = [e for e in events if e["event"] == "leave"]
    assert [(e["rank"], e["cause"]) for e in leaves] == [(1, "replica")], f"phase 'leave': {leaves}"
    assert exclude.read_text().split()[0] == host_1, "phase 'exclude file'"

    analysis.assert_exactly_once(out, DIGITS, 1)
    finals = analysis.load_finals(str(out))
    assert finals, "no survivor wrote its final state"
    for rank, final in finals.items():
        analysis.assert_bitwise_equal(final, reference, f"phase 'end state': rank {rank} vs the failure-free run")


@pytest.mark.timeout(300)
def test_a_rank_stepping_its_scheduler_twice_stops_the_job_and_strikes_no_host(tmp_path):
    exclude = tmp_path / "exclude"
    with pytest.raises(AssertionError) as failed:  # run_job asserts the job exits 0: it must not
        launch.run_job(tmp_path, "lifecycle.py", "--twice", "2:9", commit_every=COMMIT_EVERY,
                       env={"ELASTIC_EXT_REPLICA_CHECK_EVERY": "2", "ELASTIC_EXT_EXCLUDE_FILE": str(exclude)})
    assert "StateDivergenceError" in str(failed.value) and "deterministic" in str(failed.value), str(failed.value)
    events = analysis.read_events(str(tmp_path / "job" / "events.jsonl"))
    replays = [e for e in events if e["event"] == "replica_replay"]
    assert {(e["commit_id"], e["back_to"], tuple(e["wrong_ranks"])) for e in replays} == {(4, 2, (2,))}, replays
    found = [e for e in events if e["event"] == "replica_mismatch"]
    assert sorted(e["rank"] for e in found) == [0, 1, 2, 3], found
    assert all(e["cause"] == "divergence" and e["struck_hosts"] == [] and e["commit_id"] == 4 for e in found), found
    assert not [e for e in events if e["event"] == "leave"] and not exclude.exists()
