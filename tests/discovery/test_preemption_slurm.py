"""Slurm's signal before the time limit, under a real Slurm: an ``sbatch`` job whose batch script
``exec``s ``elastic-horovodrun``; ``scancel --batch --signal=USR1`` signals the batch script as
``--signal=B:USR1@SECONDS`` does. The driver passes the notice to every worker: all of them leave
at one commit, rank 0 first makes it durable, and nothing trained is lost."""

import pytest

from elastic_ext.checkpoint import CheckpointStore
from devkit.notice_job import run_slurm_notice, steps
from tests.multiprocess import analysis


@pytest.mark.timeout(300, method="signal")
def test_slurms_signal_makes_every_worker_leave_at_one_commit_made_durable_first(slurm_cluster, tmp_path):
    out = str(tmp_path / "job")
    phase, output = run_slurm_notice(out, {"SLURM_CONF": slurm_cluster.env["SLURM_CONF"]})
    events = analysis.read_events(f"{out}/events.jsonl")
    assert not [e for e in events if e["event"] == "rollback"], "a notice must not cause a rollback"
    leaves = {e["rank"]: e for e in events if e["event"] == "leave"}
    assert sorted(leaves) == [0, 1], f"ranks {sorted(leaves)} left, not every rank: {list(leaves.values())}"
    assert {e["cause"] for e in leaves.values()} == {"preemption"}
    assert {e["notice"]["source"] for e in leaves.values()} == {"slurm"}
    commit = leaves[0]["commit_id"]
    assert leaves[1]["commit_id"] == commit, "every worker leaves at one commit"
    assert leaves[0]["durable_commit_id"] == commit, "rank 0 leaves once its last commit is durable"
    assert "every worker leaves at its next commit" in output, output[-3000:]
    newest = CheckpointStore(f"{out}/ckpt").load_newest()
    trained = max(r["step"] for r in steps(out)) + 1
    assert newest.commit_id == commit and newest.entries["step"].meta == trained, (
        f"the newest checkpoint (commit {newest.commit_id}) does not hold the last step trained ({trained})")
    assert phase.gone is not None
