"""checkpoint_every="auto": Young's interval from the measured write cost and the failures seen, its bounds,
its event, and the tally a restarted job goes on with."""

import math

import pytest
import torch

from elastic_ext.checkpoint import CheckpointStore, checkpoint_name, read_checkpoint
from elastic_ext.checkpoint.cadence import MAX_INTERVAL_S, MIN_EVERY, PRIOR_MTBF_S, Cadence
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import ConfigError
from elastic_ext.testing import SoloBinding, state_on


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def commits(policy, clock, intervals, writing=False):
    for interval in intervals:
        clock.now += interval
        policy.on_commit(writing)


def measured(write_excess_s, idle_s=1.0, write_intervals=2, failures=0, training_s=0.0):
    """A cadence that saw idle commits every ``idle_s`` and one write that made each of the
    ``write_intervals`` commits it spanned ``write_excess_s / write_intervals`` longer
    (after ``failures`` in ``training_s`` seconds before)."""
    clock = Clock()
    policy = Cadence(clock)
    policy.past_training_s = training_s
    for _ in range(failures):
        policy.on_failure()
    commits(policy, clock, [idle_s] * 4)
    policy.on_write_started()
    commits(policy, clock, [idle_s + write_excess_s / write_intervals] * write_intervals, writing=True)
    event = policy.on_write_done(duration_s=idle_s * write_intervals)
    return policy, event, clock


def test_the_interval_is_youngs_from_the_measured_cost_and_the_prior():
    policy, event, _ = measured(write_excess_s=1.0)
    assert policy.write_cost_s == pytest.approx(1.0)
    mtbf = PRIOR_MTBF_S  # no failure yet
    assert event["mtbf_s"] == pytest.approx(mtbf)
    assert event["interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * mtbf))
    assert policy.every == event["every"] == round(math.sqrt(2 * 1.0 * mtbf) / 1.0)
    assert event["reason"] == "write" and event["failures"] == 0


def test_failures_shorten_the_interval_by_the_square_root_of_the_rate():
    quiet, _, _ = measured(write_excess_s=1.0, failures=1, training_s=3600.0)
    busy, _, _ = measured(write_excess_s=1.0, failures=16, training_s=3600.0)
    assert quiet.mtbf_s == pytest.approx(quiet.training_s) and busy.mtbf_s == pytest.approx(quiet.mtbf_s / 16)
    assert busy.interval_target_s() == pytest.approx(quiet.interval_target_s() / 4)
    before = quiet.every
    event = quiet.on_failure()
    assert event["reason"] == "failure" and event["failures"] == 2
    assert event["every"] == round(math.sqrt(2 * 1.0 * quiet.training_s / 2)) < before


def test_a_write_that_costs_training_nothing_is_bounded_below_by_its_duration_and_one_idle_commit():
    policy, event, _ = measured(write_excess_s=0.0, idle_s=1.0, write_intervals=3)
    assert policy.write_cost_s == 0.0
    assert policy.interval_target_s() == pytest.approx(3.0 + 1.0)
    assert policy.every == 4 and event["every"] == 4


def test_a_costly_write_is_bounded_above():
    policy, _, _ = measured(write_excess_s=500.0, write_intervals=500)  # a long write, each interval twice as long
    assert policy.interval_target_s() == MAX_INTERVAL_S
    assert policy.every == round(MAX_INTERVAL_S / 1.0)


def test_before_the_cost_is_known_a_checkpoint_is_due_every_min_every_commits_after_one_without_a_write():
    clock = Clock()
    policy = Cadence(clock)
    assert policy.every == MIN_EVERY and policy.due(1, None)
    policy.on_write_started()                      # commit 1 writes
    commits(policy, clock, [1.0], writing=True)    # commit 2
    assert not policy.due(2, 1)
    commits(policy, clock, [1.0], writing=True)    # commit 3: the write still ran in the interval
    assert not policy.due(3, 1), "no commit interval without a write yet: no baseline"
    commits(policy, clock, [1.0])                  # commit 4
    assert policy.due(4, 1)
    assert policy.on_failure() is None, "no cost, no interval: nothing changes"


def test_an_interval_that_spans_a_reset_is_no_sample():
    clock = Clock()
    policy = Cadence(clock)
    commits(policy, clock, [1.0, 1.0, 30.0, 1.0])
    assert policy.interval_s == pytest.approx(1.0)
    policy.on_write_started()
    commits(policy, clock, [40.0], writing=True)  # a write across a resize: its cost is not measured
    assert policy.on_write_done(1.0) is None and policy.write_cost_s is None


def test_a_restarted_job_goes_on_counting():
    policy = Cadence(Clock())
    policy.resumed({"failures": 3, "training_s": 7200.0})
    assert policy.failures == 4 and policy.training_s == pytest.approx(7200.0)
    assert policy.mtbf_s == pytest.approx(7200.0 / 4)
    fresh = Cadence(Clock())
    fresh.resumed({"failures": "x", "training_s": -1})  # not what a manifest holds: only the restart counts
    assert fresh.failures == 1 and fresh.past_training_s == 0.0
    assert fresh.to_manifest() == {"failures": 1, "training_s": 0.0}


def test_checkpoint_every_takes_auto_and_names_a_bad_value():
    assert ElasticConfig(checkpoint_every="auto").checkpoint_every == "auto"
    assert ElasticConfig.from_env({"ELASTIC_EXT_CHECKPOINT_EVERY": "AUTO"}).checkpoint_every == "auto"
    assert ElasticConfig.from_env({"ELASTIC_EXT_CHECKPOINT_EVERY": "3"}).checkpoint_every == 3
    with pytest.raises(ConfigError, match=r"ELASTIC_EXT_CHECKPOINT_EVERY \('often'\) must be an integer or 'auto'"):
        ElasticConfig.from_env({"ELASTIC_EXT_CHECKPOINT_EVERY": "often"})
    for bad in ("often", 0, 2.5, True):
        with pytest.raises(ConfigError, match=r"checkpoint_every .* must be an integer >= 1 or 'auto'"):
            ElasticConfig(checkpoint_every=bad)


# ------------------------------------------------------------------ with a State

def job(directory, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = state_on(SoloBinding(), config=ElasticConfig(checkpoint_dir=str(directory), checkpoint_every="auto"),
                     model=model, optimizer=optimizer, step=0)
    state.sync()
    return state


def step(state, clock, count):
    for _ in range(count):
        clock.now += 1.0  # a commit a second, with or without a write: a write costs nothing here
        state.step += 1
        state.commit()
        state.wait_for_checkpoint()  # each write done before the next commit: a deterministic due pattern


def test_under_auto_the_writer_follows_the_cadence_and_a_resume_counts_a_failure(tmp_path):
    state = job(tmp_path)
    writer = state._checkpointer
    clock = Clock()
    writer.cadence = Cadence(clock)
    step(state, clock, 5)
    assert sorted(CheckpointStore(str(tmp_path)).commit_ids()) == [1, 3, 5], "every MIN_EVERY commits at first"
    events = [e for e in state.events.history if e["event"] == "checkpoint_cadence"]
    assert events == [], "a write that costs nothing keeps the cadence at its lower bound"
    writer.cadence.every = 4
    step(state, clock, 4)
    assert sorted(CheckpointStore(str(tmp_path)).commit_ids()) == [3, 5, 9]
    manifest = read_checkpoint(str(tmp_path / checkpoint_name(9))).manifest
    assert manifest["cadence"]["failures"] == 0 and manifest["cadence"]["training_s"] >= 0
    state.note_failure()  # a rollback
    assert writer.cadence.failures == 1

    resumed = job(tmp_path, seed=1)
    assert resumed.commit_id == 9
    assert resumed._checkpointer.cadence.failures == 1, "the restart is the failure; the rollback was not written yet"
