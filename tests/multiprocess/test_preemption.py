"""Preemption notices under a real ``elastic-horovodrun`` job: one notice per cloud, in one job.

Four workers on three pseudo-hosts; every worker watches AWS, GCP and Azure
at a local server that answers as each cloud documents its endpoint
(:mod:`devkit.notice_job` has the script). Phases, each checked
and named in its assertions:

- ``aws``: the third host's spot instance-action; its worker leaves (4 -> 3);
- ``gcp``: 127.0.0.1 is preempted; its worker leaves (3 -> 2);
- ``azure``: a Preempt of localhost's VM; its two workers, ranks 0 and 1,
  leave at one commit, rank 0 having made it durable: no worker is left.

In every phase the notice reached a worker, that host's workers left with
cause ``preemption`` and the notice in their ``leave`` event, all at one
commit, with no rollback, and the driver dropped the host. At the end no
step was lost (no rollback, nothing trained after the last durable commit)
and every sample of the epochs done was seen once.
"""

import pytest

from elastic_ext.checkpoint import CheckpointStore
from devkit import ledger
from devkit.notice_job import COMMIT_EVERY, run_cloud_notices, steps
from tests.multiprocess import analysis

DIGITS = 1797


@pytest.mark.timeout(400)
def test_a_notice_from_each_cloud_makes_its_hosts_workers_leave_at_a_commit_and_nothing_is_lost(tmp_path):
    out = str(tmp_path / "job")
    phases, code, output = run_cloud_notices(out)
    events = analysis.read_events(f"{out}/events.jsonl")
    leaves = [e for e in events if e["event"] == "leave"]
    assert not [e for e in events if e["event"] == "rollback"], "a notice must not cause a rollback"
    sizes = [1, 1, 2]  # workers on the third host, 127.0.0.1, localhost
    for phase, workers in zip(phases, sizes):
        name = f"phase {phase.source} ({phase.host})"
        assert phase.served is not None and phase.gone is not None, name
        theirs = [e for e in leaves if e.get("notice", {}).get("source") == phase.source]
        assert len(theirs) == workers, f"{name}: leave events {theirs}"
        assert {e["cause"] for e in theirs} == {"preemption"}, f"{name}: {theirs}"
        assert len({e["commit_id"] for e in theirs}) == 1, f"{name}: the host's workers left at different commits"
        assert f"host {phase.host} has a preemption notice" in output, f"{name}: the driver did not drop the host"
    assert [p.source for p in phases] == ["aws", "gcp", "azure"]
    first = {e["rank"]: e for e in leaves if e["notice"]["source"] == "azure"}
    assert sorted(first) == [0, 1], f"phase azure: ranks {sorted(first)} left, not 0 and 1"
    commit = first[0]["commit_id"]
    assert first[0]["durable_commit_id"] == commit, f"phase azure: rank 0 left before commit {commit} was durable"
    # The job ends when its last workers leave: Horovod's driver stops ("failure count == N").
    assert code != 0 and "failure count == 2" in output, f"end: exit {code}\n{output[-3000:]}"
    records = steps(out)
    newest = CheckpointStore(f"{out}/ckpt").load_newest()
    trained = max(r["step"] for r in records) + 1
    assert newest.commit_id == commit and newest.entries["step"].meta == trained == commit * COMMIT_EVERY, (
        f"end: the newest checkpoint (commit {newest.commit_id}) does not hold the last step trained ({trained})")
    epochs_done = min(r["epoch"] for r in records if r["step"] == trained - 1)
    report = ledger.audit(ledger.read(out), DIGITS, epochs_done)
    assert report["exactly_once"] and report["lost_steps"] == 0, f"end: {report}"
