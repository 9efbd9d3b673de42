"""State(guard=...), state.guard_step and run's numeric rollback, in a world of one rank."""

import math

import pytest

import elastic_ext
from elastic_ext import ConfigError, ElasticConfig, NumericGuard, State, StateError
from elastic_ext.policies.numeric_rollback import WINDOW_NAME
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.testing import SoloBinding
from elastic_ext.testing import state_on


def make_state(guard=NumericGuard(spike_k=None), rollback_limit=5, **objects):
    sampler = ElasticPartitioner(40, global_batch_size=4, shuffle=False, world=lambda: (0, 1))
    return state_on(SoloBinding(), config=ElasticConfig(rollback_limit=rollback_limit), guard=guard, sampler=sampler,
                    step=0, **objects)


def nan_once_at(bad_step, seen):
    """A training function whose loss is NaN the first time it reaches ``bad_step``."""

    @elastic_ext.run
    def train(state):
        for _ in state.sampler.batches():
            loss = float("nan") if state.step == bad_step and bad_step not in seen else 1.0
            seen.append(state.step)
            state.guard_step(loss, samples=4)
            state.sampler.record_step()
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
        return state.step

    return train


def test_a_nan_step_rolls_back_skips_its_samples_and_training_finishes_without_a_reset():
    state = make_state()
    seen = []
    assert nan_once_at(5, seen)(state) == 9  # ten steps of the epoch, one skipped
    assert state.binding.resets == 0
    assert seen == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    events = [e for e in state.events.history if e["event"] == "numeric_rollback"]
    assert len(events) == 1
    event = events[0]
    assert (event["step"], event["reason"], event["loss"], event["bad_ranks"]) == (5, "nonfinite_loss", "nan", [0])
    assert (event["commit_id"], event["rollbacks_in_a_row"], event["steps_rolled_back"]) == (2, 1, 1)
    assert event["skipped"] == [["sampler", 0, 20, 24]]
    assert state.sampler.skipped == [[0, 20, 24]] and state.sampler.cursor == 40
    assert len(state.objects[WINDOW_NAME]) == 9  # accepted losses only, replays once


def test_too_many_numeric_rollbacks_in_a_row_end_the_job_with_the_verdict():
    state = make_state(guard=NumericGuard(spike_k=None), rollback_limit=2)

    calls = []

    @elastic_ext.run
    def diverged(state):
        calls.append(1)
        if len(calls) == 1:
            state.commit()  # one commit: every rollback goes back to it
        for _ in state.sampler.batches():
            state.guard_step(math.inf)

    with pytest.raises(elastic_ext.NumericRollbackLimitError, match=r"3 numeric rollbacks in a row.*rollback_limit \(2\)"):
        diverged(state)
    limit = [e for e in state.events.history if e["event"] == "rollback_limit"]
    assert len(limit) == 1 and limit[0]["cause"] == "numeric" and limit[0]["reason"] == "nonfinite_loss"
    assert limit[0]["limit"] == 2 and limit[0]["rollbacks"] == 3
    # Each rollback skipped the step it was at: three steps of four samples.
    assert state.sampler.skipped == [[0, 0, 4], [0, 4, 8]]


def test_a_skip_no_commit_holds_is_reapplied_after_a_failed_collective():
    from horovod.common.exceptions import HorovodInternalError
    state = make_state()
    calls = []

    @elastic_ext.run
    def train(state):
        calls.append([list(r) for r in state.sampler.skipped])
        if len(calls) == 1:
            state.commit()
            state.guard_step(float("nan"))
        if len(calls) == 2:
            raise HorovodInternalError("peer gone")  # restores the commit, which has no skip yet
        return state.sampler.step_range()

    assert train(state) == (0, 4, 8)
    # The failed collective's restore dropped the uncommitted skip; run put it back.
    assert calls == [[], [[0, 0, 4]], [[0, 0, 4]]] and state.binding.resets == 1


def test_the_guard_is_opt_in_and_bad_input_is_a_clear_error():
    plain = state_on(SoloBinding(), config=ElasticConfig(), step=0)
    assert plain.guard is None and WINDOW_NAME not in plain.objects
    with pytest.raises(StateError, match="needs a guard"):
        plain.guard_step(1.0)
    with pytest.raises(ConfigError, match=r"guard \('yes'\) must be an elastic_ext.NumericGuard"):
        state_on(SoloBinding(), config=ElasticConfig(), guard="yes", step=0)
    with pytest.raises(StateError, match="numeric_guard_window"):
        state_on(SoloBinding(), config=ElasticConfig(), numeric_guard_window=1)
    state = make_state()
    with pytest.raises(StateError, match=r"step='x'"):
        state.guard_step(1.0, step="x")
    with pytest.raises(ConfigError, match=r"samples \(-1\)"):
        state.guard_step(1.0, samples=-1)
    assert state.guard_step(2.0).ok and state.objects[WINDOW_NAME].losses == [2.0]


def test_the_loss_window_rolls_back_with_the_commit():
    state = make_state()
    state.guard_step(1.0)
    state.commit()
    state.guard_step(3.0)
    state.restore()
    assert state.objects[WINDOW_NAME].losses == [1.0]


def test_a_sync_that_loads_the_commit_keeps_the_uncommitted_skip():
    # A rank other than the sync's root loads the root's commit into its live objects when their
    # bytes differ (BatchNorm statistics always do): the skip, not committed yet, must survive it.
    state = make_state()

    def loading_sync():
        State.sync(state)
        if state.commit_id > 0:
            state.restore()  # what loading the root's commit does to this rank's live objects

    state.sync = loading_sync
    calls = []

    @elastic_ext.run
    def train(state):
        calls.append(1)
        if len(calls) == 1:
            state.commit()
            state.guard_step(float("nan"))
        return state.sampler.step_range()

    assert train(state) == (0, 4, 8)


class BackgroundSolo(SoloBinding):
    """A world of one whose allgather can start in the background, as PyTorch's binding's does."""

    def __init__(self):
        super().__init__()
        self.started = []

    def allgather_start(self, array, name):
        self.started.append(name)
        result = self.allgather(array, name)
        return lambda: result


def test_in_the_background_a_step_is_judged_at_the_next_guard_step_or_commit_and_only_it_is_skipped():
    sampler = ElasticPartitioner(40, global_batch_size=4, shuffle=False, world=lambda: (0, 1))
    state = state_on(BackgroundSolo(), config=ElasticConfig(), guard=NumericGuard(spike_k=None),
                  sampler=sampler, step=0)
    seen = []
    # NaN at step 2: judged at step 3's guard_step; the commit after step 3 never happens with it.
    assert nan_once_at(2, seen)(state) == 9
    assert seen == [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8], seen
    [event] = [e for e in state.events.history if e["event"] == "numeric_rollback"]
    assert (event["step"], event["reason"], event["commit_id"]) == (2, "nonfinite_loss", 1)
    assert event["steps_rolled_back"] == 1 and event["skipped"] == [["sampler", 0, 8, 12]], event
    assert state.sampler.skipped == [[0, 8, 12]] and state.binding.resets == 0
    # The last step is still in flight: no commit came after it (a final commit() would judge it).
    assert len(state.objects[WINDOW_NAME]) == 8 and set(state.binding.started) == {"elastic_ext.policies.guard"}
    state.commit()
    assert len(state.objects[WINDOW_NAME]) == 9

    # A NaN in the last step before a commit is judged by that commit, which then commits nothing.
    state = state_on(BackgroundSolo(), config=ElasticConfig(), guard=NumericGuard(spike_k=None),
                  sampler=ElasticPartitioner(40, global_batch_size=4, shuffle=False, world=lambda: (0, 1)), step=0)
    seen = []
    assert nan_once_at(3, seen)(state) == 9
    assert seen == [0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8], seen
    [event] = [e for e in state.events.history if e["event"] == "numeric_rollback"]
    assert event["step"] == 3 and event["commit_id"] == 1 and event["skipped"] == [["sampler", 0, 12, 16]], event
