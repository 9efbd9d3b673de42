"""A checkpoint directory belongs to one job, and its files are made safely (audit H4, L1, M3).

- A second job on a directory is refused with a CheckpointError naming the
  holder (job id, host, pid); the first job's checkpoints stay intact.
- A lock left by a process that died is taken over, with a warning naming it.
- Files are created with O_EXCL|O_NOFOLLOW under names of their own, mode
  0600 (directories 0700): a planted link is never followed; the O_DIRECT
  descriptor never reopens the path; the manifest is read with a bound.
- A directory whose checkpoints all fail verification stops a fresh job
  unless checkpoint_fresh_start allows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic_ext import checkpoint
from elastic_ext.checkpoint import CheckpointStore, direct, read_checkpoint, write_checkpoint
from elastic_ext.checkpoint.lock import DirectoryLock, read_owner
from elastic_ext.errors import CheckpointError, CorruptCheckpointError
from test_checkpoint import Job, flip_byte, sample_entries

NAME = checkpoint.checkpoint_name
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def as_job(monkeypatch, job_id):
    """Checkpointers made from now on belong to job ``job_id`` (as horovodrun's rendezvous would say)."""
    monkeypatch.setattr(checkpoint.writer, "job_id", lambda: job_id)


def test_a_second_job_on_the_directory_is_refused_naming_the_holder(tmp_path, monkeypatch):
    as_job(monkeypatch, "job-A")
    first = Job(tmp_path)
    first.state.sync()
    first.steps(3)
    before = {p.name: p.read_bytes() for p in (tmp_path / NAME(3)).iterdir()}
    as_job(monkeypatch, "job-B")
    second = Job(tmp_path, seed=5)
    with pytest.raises(CheckpointError, match="in use by job 'job-A'") as caught:
        second.state.sync()
    assert f"pid {os.getpid()}" in str(caught.value) and "host" in str(caught.value)
    assert second.state.commit_id == 0, "it must not have resumed another job's checkpoint"
    first.steps(2)  # the first job goes on writing
    assert first.state.wait_for_checkpoint() == 5
    assert {p.name: p.read_bytes() for p in (tmp_path / NAME(3)).iterdir()} == before
    assert CheckpointStore(str(tmp_path)).commit_ids() == [5, 4, 3]


def test_a_write_into_another_jobs_directory_is_a_failed_write(tmp_path):
    holder = DirectoryLock(str(tmp_path), "job-A")
    holder.acquire()
    mine = DirectoryLock(str(tmp_path), "job-B")
    with pytest.raises(CheckpointError, match="in use by job 'job-A'"):
        mine.acquire()
    same_job = DirectoryLock(str(tmp_path), "job-A")  # rank 0 moved to another process of job A
    same_job.acquire()
    assert not same_job.held and holder.held
    holder.release()
    same_job.acquire()
    assert same_job.held


_HOLDER = ("import sys; from elastic_ext.checkpoint.lock import DirectoryLock; "
           "lock = DirectoryLock(sys.argv[1], 'job-dead'); lock.acquire(); print('held', flush=True); "
           "sys.stdin.read()")


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, caplog):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=f"job 'job-dead' .*pid {holder.pid}"):
            DirectoryLock(str(tmp_path), "job-new").acquire()
    finally:
        holder.kill()
        holder.wait(60)
    assert read_owner(str(tmp_path))["pid"] == holder.pid, "the dead job's identity is still there"
    lock = DirectoryLock(str(tmp_path), "job-new")
    lock.acquire()  # the kernel released the dead process's flock
    assert lock.held and read_owner(str(tmp_path))["job_id"] == "job-new"
    assert any("taking over" in r.getMessage() and "job-dead" in r.getMessage() for r in caplog.records)


def test_a_filesystem_without_locks_warns_once_and_writes_on(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = DirectoryLock(str(tmp_path), "job-A")
    lock.acquire()
    lock.acquire()
    warned = [r.getMessage() for r in caplog.records if "cannot be locked" in r.getMessage()]
    assert len(warned) == 1 and "No locks available" in warned[0] and not lock.held


def test_an_owner_file_that_is_not_ours_is_no_identity(tmp_path):
    (tmp_path / checkpoint.OWNER_FILE).write_bytes(b"{" * 10_000)
    assert read_owner(str(tmp_path)) == {}
    (tmp_path / checkpoint.OWNER_FILE).write_text(json.dumps([1, 2]))
    assert read_owner(str(tmp_path)) == {}


# ------------------------------------------------------------------ L1: how files are made

def test_a_planted_link_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ckpts = tmp_path / "ckpts"
    (ckpts / NAME(1)).mkdir(parents=True)
    for name in ("arrays.bin.tmp", "manifest.json.tmp"):  # the names every write used before
        os.symlink(victim, ckpts / NAME(1) / name)
    write_checkpoint(str(ckpts), 1, sample_entries(1), {})
    read_checkpoint(str(ckpts / NAME(1)))
    os.symlink(victim, tmp_path / "link")
    with pytest.raises(FileExistsError):
        direct.DirectFile(str(tmp_path / "link"))  # O_EXCL: an existing name, a link included, is refused
    os.symlink(tmp_path, ckpts / NAME(2))  # a planted checkpoint directory
    with pytest.raises(CheckpointError, match="symbolic link"):
        write_checkpoint(str(ckpts), 2, sample_entries(2), {})
    assert victim.read_bytes() == b"precious" and sorted(os.listdir(tmp_path)) == ["ckpts", "link", "victim"]


def test_checkpoint_files_are_private(tmp_path):
    old = os.umask(0)  # whatever the umask allows, the modes are the job's own
    try:
        write_checkpoint(str(tmp_path / "ckpts"), 1, sample_entries(1), {})
        DirectoryLock(str(tmp_path / "ckpts"), "job").acquire()
    finally:
        os.umask(old)
    path = tmp_path / "ckpts" / NAME(1)
    for made in (tmp_path / "ckpts", path):
        assert os.stat(made).st_mode & 0o777 == 0o700, made
    for made in (path / "arrays.bin", path / "manifest.json", tmp_path / "ckpts" / checkpoint.LOCK_FILE,
                 tmp_path / "ckpts" / checkpoint.OWNER_FILE):
        assert os.stat(made).st_mode & 0o777 == 0o600, made
    assert not [name for name in os.listdir(path) if name.endswith(".tmp")]


@pytest.mark.skipif(not direct.O_DIRECT, reason="O_DIRECT is Linux's")
def test_the_direct_descriptor_never_reopens_the_path(tmp_path, monkeypatch):
    opened, real = [], os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real(path, *a, **k))
    handle = direct.DirectFile(str(tmp_path / "out.bin"))
    handle.close()
    assert opened[0] == str(tmp_path / "out.bin")
    assert all(path.startswith("/proc/self/fd/") for path in opened[1:]), opened


def test_a_manifest_over_the_bound_is_corrupt_and_not_read_whole(tmp_path, monkeypatch):
    write_checkpoint(str(tmp_path), 1, sample_entries(1), {})
    monkeypatch.setattr(checkpoint.files, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(CorruptCheckpointError, match="larger than 100 bytes"):
        read_checkpoint(str(tmp_path / NAME(1)))


# ------------------------------------------------------------------ M3: no silent fresh start

def test_a_directory_of_corrupt_checkpoints_stops_a_fresh_job_unless_told(tmp_path):
    first = Job(tmp_path)
    first.state.sync()
    first.steps(2)
    for commit_id in (1, 2):
        flip_byte(tmp_path / NAME(commit_id) / "arrays.bin", 70)
    listing = {p: p.read_bytes() for p in tmp_path.rglob("ckpt-*/*")}
    second = Job(tmp_path, seed=4)
    with pytest.raises(CheckpointError, match="no checkpoint in .* can be used: 2 failed verification") as caught:
        second.state.sync()
    assert "ELASTIC_EXT_CHECKPOINT_FRESH_START" in str(caught.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("ckpt-*/*")} == listing
    third = Job(tmp_path, seed=4, checkpoint_fresh_start=True)
    third.state.sync()
    assert third.state.commit_id == 0


def test_partial_checkpoints_alone_still_start_fresh(tmp_path):
    write_checkpoint(str(tmp_path), 1, sample_entries(1), {})
    (tmp_path / NAME(1) / "manifest.json").unlink()  # the first write was cut: nothing to lose
    job = Job(tmp_path)
    job.state.sync()
    assert job.state.commit_id == 0
    assert not [e for e in job.state.events.history if e["event"] == "checkpoint_resumed"]
