"""A static MPI job (real ``mpirun``, as HPC centres run Horovod under Slurm with
requeue): ``@elastic_ext.run`` commits and writes durable checkpoints, says in
one line what it cannot do under MPI, never cuts MPI's connections, and a job
killed and started again with another ``-np`` resumes exactly once."""

import os
import sys

import pytest

from elastic_ext.checkpoint import CheckpointStore
from tests.multiprocess import analysis, launch

DIGITS = 1797
EPOCHS = 2
COMMIT_EVERY = 4
KILL_AFTER_COMMIT = 3


def mpirun(np_, out, *worker_args):
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np_),
            sys.executable, os.path.join(launch.WORKERS, "train_torch_ckpt.py"), "--out", str(out),
            "--epochs", str(EPOCHS), "--commit-every", str(COMMIT_EVERY), *worker_args]


def environment(out, name):
    return launch.base_env(ELASTIC_EXT_CHECKPOINT_DIR=str(out / "ckpt"), ELASTIC_EXT_CHECKPOINT_EVERY=1,
                           ELASTIC_EXT_CHECKPOINT_KEEP_LAST=3,
                           ELASTIC_EXT_EVENTS_PATH=str(out / f"events-{name}.jsonl"))


@pytest.mark.timeout(600)
def test_mpirun_job_killed_and_requeued_on_fewer_ranks_resumes_exactly_once(tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    # 1. Three ranks until the whole job is killed (as a node failure or scancel --signal=KILL would).
    job = launch.Job(mpirun(3, out, "--step-sleep-s", "0.1"), environment(out, "first"), str(out / "first.log"))
    launch.kill_whole_job(
        job, lambda: any(i >= KILL_AFTER_COMMIT for i in analysis.durable_commit_ids(out / "ckpt")), timeout_s=240)
    first_log = open(out / "first.log").read()
    announced = [line for line in first_log.splitlines() if "under an MPI controller" in line]
    assert len(announced) == 3, f"every rank must say once what MPI cannot do; got {announced}"
    assert "connection" in announced[0] and "checkpoint" in announced[0], announced[0]
    assert not list(out.glob("final-*.npz")), "the killed job must not have finished"
    resume_from = CheckpointStore(str(out / "ckpt")).load_newest().commit_id
    assert resume_from >= KILL_AFTER_COMMIT

    # 2. Requeued with two ranks: resumes from the newest checkpoint and finishes.
    code, output = launch.run(mpirun(2, out), environment(out, "second"), str(out / "second.log"), 300)
    assert code == 0, output[-5000:]
    resumed = [e for e in analysis.read_events(str(out / "events-second.jsonl")) if e["event"] == "checkpoint_resumed"]
    assert [e["commit_id"] for e in resumed] == [resume_from], resumed
    finals = analysis.load_finals(str(out))
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)
    analysis.assert_exactly_once(str(out), DIGITS, EPOCHS)
