"""The examples' one hook: off without its flags; with them, faults fire once and steps reach the ledger."""

import argparse
import types

import numpy as np
import pytest

from elastic_ext.errors import ConfigError
from elastic_ext.testing import Instrument
from devkit import ledger


def fake_state(step=0, generation=1):
    return types.SimpleNamespace(step=step, generation=generation)


def fake_sampler(epoch=0, cursor=0):
    return types.SimpleNamespace(epoch=epoch, cursor=cursor)


def parse(argv):
    parser = argparse.ArgumentParser()
    Instrument.add_arguments(parser)
    return parser.parse_args(argv)


def test_without_flags_every_call_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    instrument = Instrument.from_args(parse([]), lambda: 0, lambda: 1)
    state = fake_state()
    instrument.started(state, fake_sampler())
    instrument.step(state, fake_sampler(), np.arange(4), np.zeros(4, dtype=bool))
    instrument.finished(state)
    assert (instrument.faults, instrument.ledger) == (None, None)
    assert list(tmp_path.iterdir()) == []


def test_faults_without_a_ledger_are_refused():
    with pytest.raises(ConfigError, match=r"faults \('1:3:kill'\) need a ledger directory"):
        Instrument.from_args(parse(["--faults", "1:3:kill"]), lambda: 0, lambda: 1)
    with pytest.raises(ConfigError, match=r"step_sleep_s \(-1.0\) must be >= 0"):
        Instrument(step_sleep_s=-1.0)


def test_a_fault_fires_once_and_its_marker_lives_under_the_run(tmp_path):
    run = tmp_path / "run"
    instrument = Instrument.from_args(parse(["--ledger", str(run), "--faults", "2:5:raise"]), lambda: 2, lambda: 4)
    instrument.before_step(fake_state(step=4))
    with pytest.raises(RuntimeError, match="injected fault at rank 2 step 5"):
        instrument.before_step(fake_state(step=5))
    instrument.before_step(fake_state(step=5))  # replayed after a rollback: fired already
    assert [f["step"] for f in instrument.faults.fired()] == [5]
    assert [p.name for p in (run / "faults").iterdir()] == ["fault-2-5-raise-step"]


def test_steps_reach_the_ledger_without_their_padding(tmp_path):
    instrument = Instrument(str(tmp_path), rank_fn=lambda: 1, size_fn=lambda: 2)
    state, sampler = fake_state(step=7, generation=3), fake_sampler(epoch=1, cursor=8)
    instrument.started(state, sampler)
    instrument.step(state, sampler, np.array([5, 6, 0]), np.array([False, False, True]))
    state.step = 8
    instrument.finished(state)
    records = ledger.read(str(tmp_path))
    start, step = [r for r in records if "start" in r], [r for r in records if "gen" in r]
    assert [(r["start"], r["epoch"], r["cursor"], r["step"], r["rank"], r["size"]) for r in start] == [(3, 1, 8, 7, 1, 2)]
    assert [(r["gen"], r["step"], r["indices"], r["pads"]) for r in step] == [(3, 7, [5, 6], 1)]


def test_steps_sleep_longer_while_the_world_is_below_the_slow_size(monkeypatch):
    from elastic_ext.testing import instrument as module
    slept, size = [], [4]
    monkeypatch.setattr(module.time, "sleep", slept.append)
    instrument = Instrument.from_args(parse(["--step-sleep-s", "0.03", "--slow-below", "6:0.15"]),
                                      lambda: 0, lambda: size[0])
    for world in (4, 3, 6, 5, 6):
        size[0] = world
        instrument.pause()
    assert slept == [0.15, 0.15, 0.03, 0.15, 0.03]


@pytest.mark.parametrize("text", ["6", "six:0.1", "6:-1", "0:0.1", "6:nan", ":0.2"])
def test_a_bad_slow_below_is_refused_with_its_value(text):
    with pytest.raises(ConfigError, match=r"slow_below \(.*\) must be SIZE:SECONDS") as caught:
        Instrument(slow_below=text)
    assert repr(text) in str(caught.value)


def test_its_flags_without_the_checkouts_devkit_are_a_clear_error(tmp_path, monkeypatch):
    """The fault schedule and the ledger are not shipped: outside a checkout the flags say what they need."""
    from elastic_ext.testing import instrument as module

    def no_devkit(name):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(module.importlib, "import_module", no_devkit)
    with pytest.raises(ConfigError, match=r"need devkit\.ledger from a checkout .* No module named 'devkit.ledger'"):
        Instrument(str(tmp_path))
    assert Instrument(step_sleep_s=0.01).ledger is None  # without those flags nothing is imported
