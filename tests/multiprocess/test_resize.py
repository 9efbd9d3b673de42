"""2 -> 4 -> 2 -> 4 workers through the discovery script, then a SIGKILL back
to 2: every sample exactly once over the committed history, for PyTorch and
TensorFlow. Resizes are deterministic: rank 0 rewrites the host file at a
given step and waits for Horovod's notice (elastic_ext.testing.HostFileSchedule)."""

import pytest

from elastic_ext.testing import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
COMMIT_EVERY = 4
ONE = "localhost:2"
TWO = "localhost:2,127.0.0.1:2"


def run_schedule(tmp_path, worker, extra, **env):
    """2 -> 4 -> 2 -> 4 at steps 8, 16, 24, then a SIGKILL at step 30; returns (job dir, ledger records)."""
    out = tmp_path / "job"
    out.mkdir()
    hosts = str(out / "hosts")
    launch.write_hosts(hosts, [ONE])
    schedule = f"8:{hosts}:{TWO};16:{hosts}:{ONE};24:{hosts}:{TWO}"
    cmd = launch.elastic_cmd(2, 2, 4, hosts, worker, "--out", str(out), "--epochs", "2",
                             "--commit-every", str(COMMIT_EVERY), "--resize-at", schedule,
                             "--faults", "3:30:kill", *extra)
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), **env),
                              str(out / "horovodrun.log"), timeout_s=360)
    assert code == 0, output[-5000:]
    return out, ledger.read(str(out))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("worker, extra", [("train_torch.py", []), ("train_tf.py", ["--keras", "3"])],
                         ids=["torch", "tensorflow"])
def test_grow_shrink_grow_and_failure_keep_exactly_once(tmp_path, worker, extra):
    out, records = run_schedule(tmp_path, worker, extra)
    sizes = analysis.sizes_by_generation(records)
    assert sizes == [[2], [4], [2], [4], [2]], sizes
    starts = ledger.starts(records)
    assert [starts[g][2] for g in sorted(starts)] == [0, 8, 16, 24, 28], starts
    events = analysis.read_events(str(out / "events.jsonl"))
    assert len({e["generation"] for e in events if e["event"] == "recovered" and e["cause"] == "collective_failed"}) == 1
    # Newcomers got the commit in stripes from both survivors, not from rank 0 alone.
    grows = [e for e in events if e["event"] == "sync" and e.get("newcomers") and e["generation"] > 1]
    assert {e["generation"] for e in grows} == {2, 4}, grows
    assert all(e["senders"] == [0, 1] for e in grows), [e["senders"] for e in grows]
    report = analysis.assert_exactly_once(out, DIGITS, 2)
    assert report["lost_steps"] >= 1  # the steps after commit 28 that the SIGKILL threw away
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)


@pytest.mark.timeout(420)
def test_with_overlapped_commits_each_resize_acts_one_commit_later_and_nothing_is_lost(tmp_path):
    """ELASTIC_EXT_OVERLAP_COMMIT=1: the commit's allreduce runs in Horovod's background
    thread and is read at the next commit, so each resize of the schedule above lands
    4 steps (one commit) later, on every rank together, and the job stays exactly-once."""
    out, records = run_schedule(tmp_path, "train_torch.py", [], ELASTIC_EXT_OVERLAP_COMMIT="1")
    assert analysis.sizes_by_generation(records) == [[2], [4], [2], [4], [2]]
    starts = ledger.starts(records)
    assert [starts[g][2] for g in sorted(starts)] == [0, 12, 20, 28, 28], starts
    events = analysis.read_events(str(out / "events.jsonl"))
    resizes = [e for e in events if e["event"] == "resize"]
    assert resizes and {e["commit_id"] for e in resizes} == {3, 5, 7}, resizes  # commits at steps 12, 20, 28
    analysis.assert_exactly_once(out, DIGITS, 2)
    finals = analysis.load_finals(out)
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)
