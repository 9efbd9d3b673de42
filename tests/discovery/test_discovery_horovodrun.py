"""The Slurm discovery script driving a real horovodrun job: a drained node
leaves and the job shrinks without a rollback; resumed, it returns and the
job grows again. Exactly once throughout. The job trains until the test has
seen the three phases (then it ends at the next epoch's end, ``--stop-file``),
at most EPOCHS epochs."""

import json
import sys
import time

import pytest

from devkit import ledger
from tests.multiprocess import analysis, launch

DIGITS = 1797
EPOCHS = 30  # a bound: the job ends at the stop file


def wait_for(predicate, what, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def sizes_seen(out):
    # In time order: ledger.read concatenates per-process files, and rank 0
    # may be a different process in different generations.
    steps = sorted((r for r in ledger.read(str(out)) if "gen" in r and r["rank"] == 0), key=lambda r: r["t"])
    return [r["size"] for r in steps]


@pytest.mark.timeout(420, method="signal")
def test_drain_shrinks_and_resume_grows_without_rollback(slurm_cluster, tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    script = f"{launch.REPO}/host_discovery/slurm.py --nodelist node[01-02] --slots 2 --address addr"
    cmd = [f"{launch.VENV_BIN}/horovodrun", "-np", "4", "--min-np", "2", "--max-np", "4", "--network-interfaces",
           "lo", "--host-discovery-script", script, sys.executable, f"{launch.WORKERS}/lifecycle.py",
           "--out", str(out), "--epochs", str(EPOCHS), "--commit-every", "2", "--step-sleep-s", "0.1",
           "--stop-file", str(out / "stop")]
    # The workers that rejoin on the resumed node import torch before their first
    # rendezvous; on a loaded 2-core machine that took longer than Gloo's default
    # 30 s store wait once in CI, and the job died. run() now sets the survivors'
    # wait to ElasticConfig.rendezvous_timeout_s (120 s): no override here.
    env = launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(out / "events.jsonl"), **slurm_cluster_env(slurm_cluster))
    job = launch.Job(cmd, env, str(out / "horovodrun.log"))
    try:
        wait_for(lambda: len(sizes_seen(out)) >= 6, "the job to train on 4 workers", 120)
        slurm_cluster.drain("node02")
        wait_for(lambda: 2 in sizes_seen(out), "the job to shrink to 2 workers", 60)
        slurm_cluster.resume("node02")
        slurm_cluster.wait_state("node02", "idle", timeout_s=30)
        wait_for(lambda: sizes_seen(out)[-1] == 4 and 2 in sizes_seen(out), "the job to grow back to 4", 120)
        (out / "stop").touch()
    finally:
        code, output = job.wait(timeout_s=300)
    assert code == 0, output[-5000:]
    sizes = sizes_seen(out)
    changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert changes == [4, 2, 4], changes
    events = analysis.read_events(str(out / "events.jsonl"))
    assert not [e for e in events if e["event"] == "rollback"], "a drained node must not cause a rollback"
    resizes = [e for e in events if e["event"] == "resize" and e["rank"] == 0]
    assert [e["skip_sync"] for e in resizes] == [True, False], resizes
    epochs = json.load(open(out / "final-0.json"))["epoch"] + 1
    report = analysis.assert_exactly_once(out, DIGITS, epochs)
    assert report["lost_steps"] == 0
    analysis.assert_ranks_identical(analysis.load_finals(out))


def slurm_cluster_env(cluster):
    return {"SLURM_CONF": cluster.env["SLURM_CONF"]}
