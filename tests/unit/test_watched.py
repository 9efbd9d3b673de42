"""The demo's and the tests' watch over a training script (devkit/watched.py): the script carries no hook;
its steps reach the ledger from ``sampler.record_step()``, its faults fire once, its steps are paced."""

import types

import pytest

import elastic_ext
from devkit import ledger, watched
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.errors import ConfigError
from elastic_ext.runtime import run as run_module


@pytest.fixture
def installed(monkeypatch):
    """Installs a watch as ``python -m devkit.watched`` does, over a run decorator that just calls the
    function (no Horovod here); everything it replaced is put back after the test."""
    monkeypatch.setattr(run_module, "run", lambda func, **options: func)
    monkeypatch.setattr(elastic_ext, "run", run_module.run, raising=False)
    monkeypatch.setattr(ElasticPartitioner, "record_step", ElasticPartitioner.record_step)

    def install(*args, **kwargs):
        watch = watched.Watch(*args, **kwargs)
        watched.install(watch)
        return watch
    return install


def training(rank=1, size=2, samples=10, global_batch=4):
    """A user's loop over an ElasticPartitioner at (rank, size); returns the batches it drew, per step."""
    sampler = ElasticPartitioner(samples, global_batch_size=global_batch, seed=3, policy="pad",
                                 world=lambda: (rank, size))
    state = types.SimpleNamespace(step=0, generation=2, sampler=sampler)
    drawn = []

    @elastic_ext.run
    def train(state):
        for indices, pad in sampler.batches():
            drawn.append((indices.copy(), pad.copy()))
            sampler.record_step()
            state.step += 1

    return state, train, drawn


def test_every_step_reaches_the_ledger_as_the_loop_drew_it_without_its_padding(tmp_path, installed):
    watch = installed(str(tmp_path))
    state, train, drawn = training()
    train(state)
    watch.finished()
    records = ledger.read(str(tmp_path))
    starts, steps = [r for r in records if "start" in r], [r for r in records if "gen" in r]
    assert [(r["start"], r["epoch"], r["cursor"], r["step"], r["rank"], r["size"]) for r in starts] == \
        [(2, 0, 0, 0, 1, 2)]
    assert len(steps) == len(drawn) == 3  # 10 samples, 4 a step: the last step padded
    for record, (indices, pad) in zip(steps, drawn):
        assert record["indices"] == [int(i) for i in indices[~pad]]
        assert record["pads"] == int(pad.sum())
    assert [(r["step"], r["cursor"]) for r in steps] == [(0, 0), (1, 4), (2, 8)]
    assert [r for r in records if r.get("end")][0]["step"] == 3


def test_a_fault_fires_once_before_its_step_and_its_marker_lives_under_the_run(tmp_path, installed):
    run = tmp_path / "run"
    watch = installed(str(run), faults="1:2:raise")
    state, train, _ = training()
    with pytest.raises(RuntimeError, match="injected fault at rank 1 step 2"):
        train(state)
    assert state.step == 1  # after step 1's update and record, before step 2 and any commit of it
    state.step = 2  # a restart at step 2 (after a rollback): fired already
    train(state)
    assert [f["step"] for f in watch.faults.fired()] == [2]
    assert [p.name for p in (run / "faults").iterdir()] == ["fault-1-2-raise-step"]


def test_a_fault_at_the_step_a_run_starts_from_fires_at_its_start(tmp_path, installed):
    installed(str(tmp_path), faults="0:0:raise")
    state, train, drawn = training(rank=0)
    with pytest.raises(RuntimeError, match="injected fault at rank 0 step 0"):
        train(state)
    assert drawn == []


def test_steps_sleep_longer_while_the_world_is_below_the_slow_size(monkeypatch, installed):
    slept = []
    monkeypatch.setattr(watched.time, "sleep", slept.append)
    installed(step_sleep_s=0.03, slow_below="6:0.15")
    for size in (4, 6):
        state, train, _ = training(size=size, samples=16, global_batch=8)
        train(state)
    assert slept == [0.15, 0.15, 0.03, 0.03]


def test_a_step_recorded_outside_the_run_is_a_clear_error(tmp_path, installed):
    installed(str(tmp_path))
    sampler = ElasticPartitioner(8, global_batch_size=4, world=lambda: (0, 1))
    with pytest.raises(ConfigError, match=r"record_step\(\) was called outside the function decorated"):
        sampler.record_step()


def test_bad_options_are_refused_with_their_value():
    with pytest.raises(ConfigError, match=r"faults \('1:3:kill'\) need a ledger directory"):
        watched.Watch(faults="1:3:kill")
    with pytest.raises(ConfigError, match=r"step_sleep_s \(-1.0\) must be >= 0"):
        watched.Watch(step_sleep_s=-1.0)
    with pytest.raises(SystemExit, match="usage: python -m devkit.watched"):
        watched.parse_args(["--ledger", "x", "script.py"])


@pytest.mark.parametrize("text", ["6", "six:0.1", "6:-1", "0:0.1", "6:nan", ":0.2"])
def test_a_bad_slow_below_is_refused_with_its_value(text):
    with pytest.raises(ConfigError, match=r"slow_below \(.*\) must be SIZE:SECONDS") as caught:
        watched.Watch(slow_below=text)
    assert repr(text) in str(caught.value)
