"""Durable checkpoints of a TensorFlow job under real horovodrun: a Keras 3 model
trained by a custom tf.function step loses its driver and every worker, starts
again from storage on another number of workers, and ends bitwise where an
uninterrupted run with the same world-size schedule ends, every sample once.

The TF counterpart of test_checkpoint_resume.py (which kills a PyTorch job);
this one grows on the restart (2 workers, then 3), so the resumed optimizer is
built and filled from a checkpoint on workers that never trained before. The
reference is one job that grows from 2 to 3 workers at the commit the failed
job resumed from: restarting from storage must give the bits that going on
in memory gives.
"""

import pytest

from elastic_ext.checkpoint import CheckpointStore
from devkit import ledger
from tests.multiprocess import analysis, launch
from tests.multiprocess import test_checkpoint_resume as torch_job

# The PyTorch test's job (its environment, epochs, commits, and its kill at the
# durable commit KILL_AFTER_COMMIT), with the TF worker and other world sizes.
EPOCHS, KILL_AFTER_COMMIT = torch_job.EPOCHS, torch_job.KILL_AFTER_COMMIT
DIGITS = 1797
FIRST_HOSTS = ["localhost:2"]                   # 2 workers until everything is killed
SECOND_HOSTS = ["localhost:2", "127.0.0.1:1"]   # 3 workers after the restart
WORKER = "tf_ckpt.py"


def run_to_end(out, name, hosts, np_, *worker_args):
    return torch_job.run_to_end(out, name, hosts, np_, "--keras", "3", *worker_args, worker=WORKER, timeout_s=300)


def kill_everything_after_a_durable_commit(out, hosts, np_):
    """SIGKILLs horovodrun, then every worker, once commit KILL_AFTER_COMMIT is on storage."""
    torch_job.run_and_kill_everything(out, "killed", hosts, np_, "--keras", "3", "--step-sleep-s", "0.1",
                                      worker=WORKER, timeout_s=300)


@pytest.mark.timeout(900)
def test_tf_job_killed_entirely_resumes_on_more_workers_bitwise_and_exactly_once(tmp_path):
    # 1. Two workers until every process of the job, driver included, is SIGKILLed.
    failed = tmp_path / "failed"
    failed.mkdir()
    kill_everything_after_a_durable_commit(failed, FIRST_HOSTS, 2)
    resume_from = CheckpointStore(str(failed / "ckpt")).load_newest().commit_id
    assert resume_from >= KILL_AFTER_COMMIT

    # 2. The job starts again from storage with three workers.
    run_to_end(failed, "resumed", SECOND_HOSTS, 3)
    resumed = [e for e in analysis.read_events(str(failed / "events-resumed.jsonl"))
               if e["event"] == "checkpoint_resumed"]
    assert [e["commit_id"] for e in resumed] == [resume_from], resumed
    finals = analysis.load_finals(str(failed))
    assert sorted(finals) == [0, 1, 2]
    analysis.assert_ranks_identical(finals)
    analysis.assert_exactly_once(str(failed), DIGITS, EPOCHS)

    # 3. Reference: the same world sizes at the same steps without a failure, in one job: two
    # workers until the commit the failed job resumed from, where a third joins (TensorFlow's
    # commit collective blocks: the resize acts at the commit that sees the new host).
    reference = tmp_path / "reference"
    reference.mkdir()
    hosts = str(reference / "hosts")
    launch.write_hosts(hosts, FIRST_HOSTS)
    cmd = launch.elastic_cmd(2, 2, 3, hosts, WORKER, "--out", str(reference), "--keras", "3", "--epochs", str(EPOCHS),
                             "--commit-every", str(torch_job.COMMIT_EVERY),
                             "--resize-at", f"{resume_from * torch_job.COMMIT_EVERY}:{hosts}:{','.join(SECOND_HOSTS)}")
    code, output = launch.run(cmd, launch.base_env(ELASTIC_EXT_EVENTS_PATH=str(reference / "events.jsonl")),
                              str(reference / "horovodrun.log"), 300)
    assert code == 0, output[-5000:]
    records = ledger.read(str(reference))
    assert analysis.sizes_by_generation(records) == [[2], [3]], analysis.sizes_by_generation(records)
    assert ledger.starts(records)[2][2] == resume_from * torch_job.COMMIT_EVERY, ledger.starts(records)
    ref_finals = analysis.load_finals(str(reference))
    assert sorted(ref_finals) == [0, 1, 2]
    analysis.assert_exactly_once(str(reference), DIGITS, EPOCHS)
    analysis.assert_bitwise_equal(finals[0], ref_finals[0], "resumed after losing every process vs reference")
