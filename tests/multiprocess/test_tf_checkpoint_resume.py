"""Durable checkpoints of a TensorFlow job under real horovodrun: a Keras 3 model
trained by a custom tf.function step loses its driver and every worker, starts
again from storage on another number of workers, and ends bitwise where an
uninterrupted run with the same world-size schedule ends, every sample once.

The TF counterpart of test_checkpoint_resume.py (which kills a PyTorch job);
this one grows on the restart (2 workers, then 3), so the resumed optimizer is
built and filled from a checkpoint on workers that never trained before.
"""

import signal
import time

import psutil
import pytest

from elastic_ext.checkpoint import CheckpointStore
from tests.multiprocess import analysis, launch
from tests.multiprocess.test_checkpoint_resume import durable_commit_ids, environment

DIGITS = 1797
EPOCHS = 2
COMMIT_EVERY = 4
FIRST_HOSTS = ["localhost:2"]                   # 2 workers until everything is killed
SECOND_HOSTS = ["localhost:2", "127.0.0.1:1"]   # 3 workers after the restart
KILL_AFTER_COMMIT = 3


def command(out, hosts, np_, *worker_args):
    hosts_file = str(out / f"hosts-{np_}")
    launch.write_hosts(hosts_file, hosts)
    return launch.elastic_cmd(np_, np_, np_, hosts_file, "tf_ckpt.py", "--out", str(out), "--keras", "3",
                              "--epochs", str(EPOCHS), "--commit-every", str(COMMIT_EVERY), *worker_args)


def run_to_end(out, name, hosts, np_, *worker_args, timeout_s=300):
    code, output = launch.run(command(out, hosts, np_, *worker_args), environment(out, name),
                              str(out / f"{name}.log"), timeout_s)
    assert code == 0, output[-5000:]
    return output


def kill_everything_after_a_durable_commit(out, hosts, np_, timeout_s=300):
    """SIGKILLs horovodrun, then every worker, once commit KILL_AFTER_COMMIT is on storage."""
    job = launch.Job(command(out, hosts, np_, "--step-sleep-s", "0.1"), environment(out, "killed"),
                     str(out / "killed.log"))
    deadline = time.monotonic() + timeout_s
    try:
        while not any(i >= KILL_AFTER_COMMIT for i in durable_commit_ids(out)):
            job.track()
            tail = open(job.log_path).read()[-5000:]
            assert job.proc.poll() is None, f"the job ended before it could be killed:\n{tail}"
            assert time.monotonic() < deadline, f"no checkpoint after {timeout_s}s:\n{tail}"
            time.sleep(0.05)
        job.track()
        driver = psutil.Process(job.proc.pid)
        workers = [psutil.Process(pid) for pid in job.descendants if psutil.pid_exists(pid)]
        for proc in [driver] + workers:  # the driver first: nothing may react to the workers' death
            proc.kill()
        _, alive = psutil.wait_procs([driver] + workers, timeout=30)
    finally:
        launch.kill_tree(job.proc.pid)
        for pid in job.descendants:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        job.log.close()
    assert not alive, f"processes survived SIGKILL: {alive}"
    assert driver.returncode == -signal.SIGKILL, f"the driver ended with {driver.returncode}, not by SIGKILL"
    assert len(workers) >= np_, f"expected at least {np_} worker processes, found {len(workers)}"
    assert not list(out.glob("final-*.npz")), "the killed run must not have finished"


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

    # 3. Reference: the same world sizes at the same steps without a failure. Two
    # workers stop cleanly after the checkpoint of the same commit; three resume.
    reference = tmp_path / "reference"
    reference.mkdir()
    run_to_end(reference, "first", FIRST_HOSTS, 2, "--stop-after-commit", str(resume_from))
    assert durable_commit_ids(reference)[0] == resume_from
    run_to_end(reference, "second", SECOND_HOSTS, 3)
    ref_finals = analysis.load_finals(str(reference))
    assert sorted(ref_finals) == [0, 1, 2]
    analysis.assert_exactly_once(str(reference), DIGITS, EPOCHS)
    analysis.assert_bitwise_equal(finals[0], ref_finals[0], "resumed after losing every process vs reference")
