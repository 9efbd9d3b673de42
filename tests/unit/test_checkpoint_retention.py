"""Retention keeps what a resume may need (audit M4).

- It counts only checkpoints that verify, so a bad newest checkpoint never
  evicts the newest good one.
- ``hold(commit_id)`` keeps the newest checkpoint at or before that commit
  (the replica check's last agreed one) past ``keep_last`` until ``release()``.
"""

from __future__ import annotations

import pytest

from elastic_ext import checkpoint
from elastic_ext.checkpoint import CheckpointStore, write_checkpoint
from elastic_ext.errors import ConfigError
from test_checkpoint import Job, flip_byte, sample_entries

NAME = checkpoint.checkpoint_name


def written(directory, *ids):
    for commit_id in ids:
        write_checkpoint(str(directory), commit_id, sample_entries(commit_id), {})
    return CheckpointStore(str(directory))


def test_a_corrupt_newest_checkpoint_never_evicts_the_newest_one_that_verifies(tmp_path):
    store = written(tmp_path, 1, 2, 3)
    flip_byte(tmp_path / NAME(3) / "arrays.bin", 70)  # written wrong (or damaged) after its checksum
    assert store.apply_retention(3, keep_last=1) == [1]
    assert store.commit_ids() == [3, 2]
    assert store.load_newest().commit_id == 2


def test_when_nothing_verifies_no_complete_checkpoint_is_deleted(tmp_path):
    store = written(tmp_path, 1, 2, 3)
    write_checkpoint(str(tmp_path), 0, sample_entries(0), {})
    (tmp_path / NAME(0) / "manifest.json").unlink()  # a partial leftover: it still goes
    for commit_id in (1, 2, 3):
        flip_byte(tmp_path / NAME(commit_id) / "arrays.bin", 70)
    assert store.apply_retention(3, keep_last=1) == [0]
    assert store.commit_ids() == [3, 2, 1]


def test_a_held_checkpoint_outlives_keep_last_until_released(tmp_path):
    store = written(tmp_path, 1, 2, 3, 4, 5, 6)
    store.hold(3)  # the replica check's last agreed commit: ranks disagree since
    assert store.apply_retention(6, keep_last=2) == [4, 2, 1]
    assert store.commit_ids() == [6, 5, 3]
    written(tmp_path, 7)
    assert store.apply_retention(7, keep_last=2) == [5]
    assert store.commit_ids() == [7, 6, 3]
    store.release()
    assert store.apply_retention(7, keep_last=2) == [3]
    with pytest.raises(ConfigError, match="hold"):
        store.hold(-1)


def test_each_checkpoint_is_verified_once(tmp_path, monkeypatch):
    verified, real = [], checkpoint.store.verify_checkpoint
    monkeypatch.setattr(checkpoint.store, "verify_checkpoint", lambda path: verified.append(path) or real(path))
    store = CheckpointStore(str(tmp_path))
    for commit_id in range(1, 6):
        written(tmp_path, commit_id)
        store.apply_retention(commit_id, keep_last=2)
    assert sorted(verified) == sorted(set(verified)) and len(verified) == 5, verified
    assert store.commit_ids() == [5, 4]


def test_the_writer_of_a_state_holds_and_releases(tmp_path):
    job = Job(tmp_path, checkpoint_keep_last=1)
    job.state.sync()
    job.steps(2)
    job.state._checkpointer.hold(2)
    job.steps(3)
    assert CheckpointStore(str(tmp_path)).commit_ids() == [5, 2]
    job.state._checkpointer.release()
    job.steps(1)
    assert CheckpointStore(str(tmp_path)).commit_ids() == [6]
