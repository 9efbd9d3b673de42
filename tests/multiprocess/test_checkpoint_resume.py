"""Durable checkpoints with real horovodrun: every worker and the driver die, the job
starts again from storage on another number of workers, and ends bitwise where an
uninterrupted run with the same world-size schedule ends, every sample once."""

import os

import pytest

from elastic_ext.checkpoint import CheckpointStore, checkpoint_name
from tests.multiprocess import analysis, launch

DIGITS = 1797
EPOCHS = 2
COMMIT_EVERY = 4
FIRST_HOSTS = ["localhost:2", "127.0.0.1:2"]   # 4 workers on two pseudo-hosts
SECOND_HOSTS = ["localhost:2"]                  # 2 workers after the restart
KILL_AFTER_COMMIT = 3                           # kill once this commit's checkpoint is durable


def command(out, hosts, np_, *worker_args, worker="train_torch_ckpt.py"):
    hosts_file = str(out / f"hosts-{np_}")
    launch.write_hosts(hosts_file, hosts)
    return launch.elastic_cmd(np_, np_, np_, hosts_file, worker, "--out", str(out),
                              "--epochs", str(EPOCHS), "--commit-every", str(COMMIT_EVERY), *worker_args)


def environment(out, name, every=1):
    """Checkpoints every ``every`` commits (None: the default cadence, ``auto``)."""
    cadence = {} if every is None else {"ELASTIC_EXT_CHECKPOINT_EVERY": every}
    return launch.base_env(ELASTIC_EXT_CHECKPOINT_DIR=str(out / "ckpt"), ELASTIC_EXT_CHECKPOINT_KEEP_LAST=3,
                           ELASTIC_EXT_EVENTS_PATH=str(out / f"events-{name}.jsonl"), **cadence)


def run_to_end(out, name, hosts, np_, *worker_args, worker="train_torch_ckpt.py", timeout_s=240, every=1):
    code, output = launch.run(command(out, hosts, np_, *worker_args, worker=worker),
                              environment(out, name, every), str(out / f"{name}.log"), timeout_s)
    assert code == 0, output[-5000:]
    return output


def run_and_kill_everything(out, name, hosts, np_, *worker_args, worker="train_torch_ckpt.py", timeout_s=240):
    """Starts the job, and once commit KILL_AFTER_COMMIT is durable SIGKILLs horovodrun and every worker."""
    job = launch.Job(command(out, hosts, np_, *worker_args, worker=worker), environment(out, name),
                     str(out / f"{name}.log"))
    workers = launch.kill_whole_job(
        job, lambda: any(i >= KILL_AFTER_COMMIT for i in analysis.durable_commit_ids(out / "ckpt")), timeout_s)
    assert len(workers) >= np_, f"expected at least {np_} worker processes, found {len(workers)}"
    assert not list(out.glob("final-*.npz")), "the killed run must not have finished"


@pytest.mark.timeout(900)
def test_job_killed_entirely_resumes_on_fewer_workers_bitwise_and_exactly_once(tmp_path):
    # 1. Four workers until every process of the job, driver included, is SIGKILLed.
    # Then one bit of the newest checkpoint flips: the job must detect it and
    # resume from the one before. (Resuming from an intact newest checkpoint
    # is the same path with one checkpoint fewer to skip; the TF test in
    # test_tf_checkpoint_resume.py runs it.)
    failed = tmp_path / "failed"
    failed.mkdir()
    run_and_kill_everything(failed, "killed", FIRST_HOSTS, 4, "--step-sleep-s", "0.1")
    durable = analysis.durable_commit_ids(failed / "ckpt")
    assert len(durable) >= 2, f"two durable checkpoints expected, found {durable}"
    data = failed / "ckpt" / checkpoint_name(durable[0]) / "arrays.bin"
    with open(data, "r+b") as handle:
        handle.seek(os.path.getsize(data) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    resume_from = CheckpointStore(str(failed / "ckpt")).load_newest().commit_id
    assert resume_from == durable[1]

    # 2. The job starts again from storage with two workers.
    output = run_to_end(failed, "resumed", SECOND_HOSTS, 2)
    resumed = [e for e in analysis.read_events(str(failed / "events-resumed.jsonl"))
               if e["event"] == "checkpoint_resumed"]
    assert [e["commit_id"] for e in resumed] == [resume_from], resumed
    warning = [line for line in output.splitlines() if "skipping checkpoint" in line]
    assert warning and str(failed / "ckpt" / checkpoint_name(durable[0])) in warning[0], output[-5000:]
    assert "checksum" in warning[0], warning
    finals = analysis.load_finals(str(failed))
    assert sorted(finals) == [0, 1]
    analysis.assert_ranks_identical(finals)
    analysis.assert_exactly_once(str(failed), DIGITS, EPOCHS)

    # 3. Reference: the same world-size schedule without a failure. Four workers end
    # training at the same commit, under the default cadence ("auto", which need not
    # find that commit due): run writes the last commit when training ends. Two
    # workers resume from it.
    reference = tmp_path / "reference"
    reference.mkdir()
    run_to_end(reference, "first", FIRST_HOSTS, 4, "--stop-after-commit", str(resume_from), every=None)
    assert analysis.durable_commit_ids(reference / "ckpt")[0] == resume_from, "the last commit is not on disk"
    run_to_end(reference, "second", SECOND_HOSTS, 2)
    ref_finals = analysis.load_finals(str(reference))
    assert sorted(ref_finals) == [0, 1]
    analysis.assert_exactly_once(str(reference), DIGITS, EPOCHS)
    analysis.assert_bitwise_equal(finals[0], ref_finals[0], "resumed after losing every process vs reference")
