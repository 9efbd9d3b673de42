"""Under elastic-horovodrun (the early start of newcomers): at a host addition the two
survivors keep training while Horovod's driver starts the newcomers, and the
job resizes at the first commit after the newcomers wait in hvd.init().
Also a SIGKILL of a survivor while the newcomers start: with two members going
on (three survivors) the driver dismisses the starting newcomer, with one it
waits for it. A round that leaves a failed slot out starts its new worker at
the survivors' sync."""

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4
# The newcomers must join before training ends: their start (Python, the framework, Horovod, the
# model) took 1.5 epochs of 0.2 s steps on a loaded machine, and 3 (torch) and 5 (TensorFlow) on a
# slower day with two tests at once, when 3 epochs ended before they joined; the last runs on 4 workers.
EPOCHS = 6
BASE = ["localhost:1", "127.0.0.1:1"]


def run_job(tmp_path, faults, worker="train_torch.py", extra=(), base=tuple(BASE), added_slots=2, paced_below=4):
    """Grows from the ``base`` hosts' workers to 4 (a third pseudo-host with ``added_slots``) at step 8,
    with ``faults``; returns the job's directory, ledger, events and output. Steps take 0.2 s while
    the world is below ``paced_below`` (the size the newcomers make), then run at full speed."""
    hosts = str(tmp_path / "job" / "hosts")  # where launch.run_job writes the base hosts
    grown = ",".join(list(base) + [f"{launch.third_host()}:{added_slots}"])  # no third host: RuntimeError
    # 0.2 s per step until the newcomers are in: their start (Python, torch, Horovod) spans several commits.
    out, output = launch.run_job(tmp_path, worker, "--step-sleep-s", "0.2", "--sleep-below", str(paced_below),
                                 "--resize-at", f"8:{hosts}:{grown}",
                                 "--faults", faults, *extra, hosts=base, np_=4 - added_slots, epochs=EPOCHS,
                                 commit_every=COMMIT_EVERY, timeout_s=300, launcher=True)
    return out, ledger.read(str(out)), analysis.read_events(str(out / "events.jsonl")), output


def of_rank(events, name, rank=0):
    return [e for e in events if e["event"] == name and e["rank"] == rank]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("worker, extra, agreed_at", [("train_torch.py", [], 3), ("train_tf.py", ["--keras", "3"], 2)],
                         ids=["torch", "tensorflow"])
def test_survivors_train_while_the_newcomers_start(tmp_path, worker, extra, agreed_at):
    """The newcomers run Horovod as a world of one while they build the model; the survivors
    reset only once every newcomer reached @elastic_ext.run, so the resize costs no model build."""
    out, records, events, _ = run_job(tmp_path, "", worker, extra)
    started, joined = of_rank(events, "prestart"), of_rank(events, "newcomers_joined")
    # The addition, noticed at step 8 (commit 2), is agreed there; PyTorch's overlapped commit acts one later.
    assert [e["commit_id"] for e in started] == [agreed_at], started
    assert len(joined) == 1 and joined[0]["why"] == "all_there" and joined[0]["next_size"] == 4, joined
    # The survivors went on committing while the newcomers started; the resize came after.
    assert joined[0]["commit_id"] > started[0]["commit_id"], (started, joined)
    assert analysis.sizes_by_generation(records) == [[2], [4]]
    starts = ledger.starts(records)
    assert [starts[g][2] for g in sorted(starts)] == [0, joined[0]["commit_id"] * COMMIT_EVERY], starts
    resizes = of_rank(events, "resize")
    assert [(e["commit_id"], e["skip_sync"]) for e in resizes] == [(joined[0]["commit_id"], False)]
    assert not of_rank(events, "rollback")
    analysis.assert_exactly_once(out, DIGITS, EPOCHS)
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1, 2, 3]
    analysis.assert_ranks_identical(finals)


@pytest.mark.timeout(360)
def test_a_survivor_killed_while_the_newcomers_start(tmp_path):
    """Rank 1 dies at step 14, after the early start began (step 8) and before the newcomers
    are up: the job rolls back to step 12 at once, the reset meets the newcomers that Horovod's
    driver already counts in, and rank 0 goes on with them (its host's peer is blacklisted)."""
    out, records, events, output = run_job(tmp_path, "1:14:kill", paced_below=3)
    assert [e["commit_id"] for e in of_rank(events, "prestart")] == [3]  # overlapped: one commit after step 8
    assert not of_rank(events, "newcomers_joined")  # the failure's reset ended the early start
    rollbacks = of_rank(events, "rollback")
    assert [e["commit_id"] for e in rollbacks] == [3], rollbacks
    assert analysis.sizes_by_generation(records) == [[2], [3]]
    assert "dismissed this worker" not in output, "one member going on is below --min-np: nobody is dismissed"
    starts = ledger.starts(records)
    assert [starts[g][2] for g in sorted(starts)] == [0, 12], starts
    analysis.assert_exactly_once(out, DIGITS, EPOCHS)
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1, 2]
    analysis.assert_ranks_identical(finals)


@pytest.mark.timeout(360)
def test_a_survivor_killed_while_a_newcomer_starts_does_not_wait_for_its_start(tmp_path):
    """Three workers; at step 8 a host of one slot is added. Rank 1 dies at step 14, while the
    newcomer is still starting: the driver dismisses it (the two members going on would otherwise
    wait for the rest of its start), they roll back to step 12 and train on two workers, and the
    dismissed slot comes back with the failed one in the next early start."""
    out, records, events, output = run_job(tmp_path, "1:14:kill", base=("localhost:2", "127.0.0.1:1"),
                                           added_slots=1)
    assert "elastic_ext: a member of round" in output and "dismissing" in output, "the driver dismissed nobody"
    assert "dismissed this worker" in output, "the newcomer did not read its dismissal"
    assert [e["commit_id"] for e in of_rank(events, "rollback")] == [3]
    assert analysis.sizes_by_generation(records) == [[3], [2], [4]], "the survivors waited for the newcomer"
    # The round of two left the failed and the dismissed slots out: their workers start at its sync,
    # before its first commit (the addition's early start came at a commit).
    started = [(e["commit_id"], e["size"], e.get("at_sync", False)) for e in of_rank(events, "prestart")]
    assert started == [(3, 3, False), (3, 2, True)], started
    assert [e["why"] for e in of_rank(events, "newcomers_joined")][-1:] == ["all_there"]
    analysis.assert_exactly_once(out, DIGITS, EPOCHS)
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1, 2, 3]
    analysis.assert_ranks_identical(finals)
