"""2 -> 4 -> 2 -> 4 workers through the discovery script, then a SIGKILL back
to 2: every sample exactly once over the committed history, for PyTorch and
TensorFlow. Resizes are deterministic: rank 0 rewrites the host file at a
given step and waits for Horovod's notice (devkit.faults.HostFileSchedule)."""

import pytest

from devkit import ledger
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
@pytest.mark.parametrize("worker, extra, resized_at", [
    # PyTorch overlaps the commit's collective: each resize acts one commit (4 steps) later, on every
    # rank together. TensorFlow's commit collective blocks: it acts at the commit that saw the notice.
    ("train_torch.py", [], [0, 12, 20, 28, 28]),
    ("train_tf.py", ["--keras", "3"], [0, 8, 16, 24, 28])], ids=["torch", "tensorflow"])
def test_grow_shrink_grow_and_failure_keep_exactly_once(tmp_path, worker, extra, resized_at):
    out, records = run_schedule(tmp_path, worker, extra)
    sizes = analysis.sizes_by_generation(records)
    assert sizes == [[2], [4], [2], [4], [2]], sizes
    starts = ledger.starts(records)
    assert [starts[g][2] for g in sorted(starts)] == resized_at, starts
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
