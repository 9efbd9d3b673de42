"""A checkpoint writer that keeps failing escalates: after checkpoint_failure_limit failed writes in a row
every rank stops at its next commit with CheckpointError, instead of training on with no checkpoint."""

import faulty_fs
import numpy as np
import pytest
from faulty_fs import Fault

import elastic_ext
from elastic_ext.config import ElasticConfig
from elastic_ext.testing import SoloBinding
from elastic_ext.testing import state_on


def job(tmp_path, limit, fault):
    faulty_fs.install(fault)
    config = ElasticConfig(checkpoint_dir=faulty_fs.url(tmp_path / "ckpt"), checkpoint_failure_limit=limit,
                           checkpoint_every=1, hang_timeout_s=0)
    return state_on(SoloBinding(), config=config, weights=np.zeros(4), step=0)


def commit_and_wait(state):
    state.step += 1
    state.weights += 1.0
    state.commit()
    state.wait_for_checkpoint()  # the write's outcome is known before the next commit


@pytest.fixture(autouse=True)
def no_faults_afterwards():
    yield
    faulty_fs.install()


def test_writes_that_keep_failing_stop_the_job_at_the_next_commit_with_the_cause(tmp_path):
    state = job(tmp_path, 3, Fault("open", "arrays.bin", faulty_fs.denied, mode="w"))
    for _ in range(3):
        commit_and_wait(state)
    events = [e["event"] for e in state.events.history]
    assert events.count("checkpoint_failed") == 3 and events.count("checkpoint_failing") == 1, events
    with pytest.raises(elastic_ext.CheckpointError, match=r"3 writes in a row to .*Access Denied"):
        commit_and_wait(state)
    state.restore()  # the commit that stopped the job is intact in memory
    assert state.step == 4 and state.weights.tolist() == [4.0] * 4


def test_a_write_that_succeeds_in_between_resets_the_count(tmp_path):
    state = job(tmp_path, 3, Fault("open", "arrays.bin", faulty_fs.eio, mode="w", times=2))
    for _ in range(6):
        commit_and_wait(state)
    events = [e["event"] for e in state.events.history]
    assert events.count("checkpoint_failed") == 2 and "checkpoint_failing" not in events, events
    assert state.wait_for_checkpoint() == 6


def test_the_limit_is_validated():
    with pytest.raises(elastic_ext.ConfigError, match=r"checkpoint_failure_limit \(0\) must be an integer >= 1"):
        ElasticConfig(checkpoint_failure_limit=0)
    assert ElasticConfig.from_env({"ELASTIC_EXT_CHECKPOINT_FAILURE_LIMIT": "7"}).checkpoint_failure_limit == 7
