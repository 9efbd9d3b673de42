"""The replica check under real horovodrun: bit flips on one of four ranks are found at the
commit, healed from the majority, and the job ends bitwise equal to the failure-free run.

One job of lifecycle.py (PyTorch, Adam, 4 workers on two 2-slot pseudo-hosts, 29 steps, a
commit every 4 steps, replica check at every commit), with three faults declared up front,
each after the step's update and before the commit that follows (so that no gradient of the
corrupt copy reaches the others before the check):

1. step 8, rank 1: one bit of a parameter (the first layer's weight);
2. step 16, rank 3: one bit of an Adam moment (that weight's exp_avg);
3. step 28, rank 1 again: its host is wrong twice, so rank 1 adds it to the exclude file and
   leaves at the next commit (the job's last), without a rollback.
"""

import pytest

from elastic_ext.testing import FaultSchedule
from tests.multiprocess import analysis, launch
from tests.multiprocess.references import references  # noqa: F401  (the fixture)

DIGITS = 1797
COMMIT_EVERY = 4
FAULTS = "1:8:flip:before_commit:param,3:16:flip:before_commit:moment,1:28:flip:before_commit:param"


def reference_run(directory):
    out, _ = launch.run_job(directory, "lifecycle.py", commit_every=COMMIT_EVERY,
                            env={"ELASTIC_EXT_REPLICA_CHECK_EVERY": "0"})
    finals = analysis.load_finals(str(out))
    analysis.assert_ranks_identical(finals)
    return finals[0]


@pytest.mark.timeout(500)
def test_bit_flips_in_a_parameter_and_an_adam_moment_are_healed_and_a_host_wrong_twice_leaves(tmp_path, references):
    reference = references.get(("lifecycle.py", "failure-free", 1, COMMIT_EVERY, launch.HOSTS), reference_run)
    exclude = tmp_path / "exclude"
    out, output = launch.run_job(tmp_path, "lifecycle.py", "--faults", FAULTS, commit_every=COMMIT_EVERY,
                                 env={"ELASTIC_EXT_REPLICA_CHECK_EVERY": "1", "ELASTIC_EXT_EXCLUDE_FILE": str(exclude)})
    events = analysis.read_events(str(out / "events.jsonl"))
    fired = sorted((f["rank"], f["step"], f["target"])
                   for f in FaultSchedule.parse(FAULTS, str(out / "faults")).fired())
    assert fired == [(1, 8, "param"), (1, 28, "param"), (3, 16, "moment")], fired

    kinds = [e["event"] for e in events]
    assert "rollback" not in kinds and "numeric_rollback" not in kinds, f"a heal is not a rollback: {kinds}"
    found = [e for e in events if e["event"] == "replica_mismatch"]
    by_commit = {}
    for event in found:
        by_commit.setdefault(event["commit_id"], []).append(event)
    assert sorted(by_commit) == [2, 4, 7], f"phase 'found at the next commit': {sorted(by_commit)}"
    expected = {2: ([1], "model['0.weight']"), 4: ([3], "exp_avg"), 7: ([1], "model['0.weight']")}
    for commit_id, (wrong, entry) in expected.items():
        seen = by_commit[commit_id]
        assert sorted(e["rank"] for e in seen) == [0, 1, 2, 3], f"commit {commit_id}: every rank writes the event"
        for event in seen:
            assert event["wrong_ranks"] == wrong and event["healed"], f"commit {commit_id}: {event}"
            assert sorted(event["majority_ranks"] + wrong) == [0, 1, 2, 3], event
            assert entry in event["first_difference"], f"commit {commit_id}: {event['first_difference']}"
            assert event["senders"] == event["majority_ranks"] and event["bytes"] > 0, event
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
