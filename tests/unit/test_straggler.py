"""Straggler eviction: the policy's rules, the tracker's decisions, the piggybacked table, the step timer."""

import random

import numpy as np
import pytest

from elastic_ext.errors import ConfigError, PartitionError
from elastic_ext.policies.step_timer import StepTimer, pack_slots, unpack_slots
from elastic_ext.policies.eviction import StragglerWatch
from elastic_ext.policies.straggler import Eviction, StragglerPolicy, StragglerTracker, ratios, shares

BASE_S = 0.1  # a normal step's compute time in these tables (numbers only: nothing sleeps)


def table(size, slow=None, jitter=0.0, seed=0):
    """Per-rank seconds per step: BASE_S everywhere, times ``slow[rank]`` for slowed ranks, +-jitter."""
    rng = random.Random(seed)
    slow = slow or {}
    return [BASE_S * slow.get(rank, 1.0) * (1.0 + rng.uniform(-jitter, jitter)) for rank in range(size)]


def run_job(policy, size, steps, slowdown, commit_every=1, samples=None, jitter=0.05):
    """Feeds one observation per commit; ``slowdown(step)`` gives {rank: factor} for that step.

    Each rank reports the median of its steps since the last commit (what StepTimer.report gives).
    An evicted rank leaves as the integration would make it: the world resets (the tracker restarts
    its warm-up) and the rank reports nothing from then on. Returns (evictions, tracker).
    """
    tracker = StragglerTracker(policy)
    samples = list(samples or [32] * size)
    evictions = []
    for commit_step in range(commit_every, steps + 1, commit_every):
        per_step = [table(size, slowdown(s), jitter, seed=s) for s in range(commit_step - commit_every + 1,
                                                                             commit_step + 1)]
        medians = [float(np.median([row[r] for row in per_step])) if samples[r] else 0.0 for r in range(size)]
        eviction = tracker.observe(commit_step, medians, samples)
        if eviction is not None:
            evictions.append(eviction)
            samples[eviction.rank] = 0
            tracker.reset(commit_step)
    return evictions, tracker


ON = dict(factor=3.0, window_steps=10, warmup_steps=5)


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("kwargs, quoted", [
    ({"factor": 1.0}, "factor (1.0) must be a finite number > 1"),
    ({"factor": 0.5}, "factor (0.5)"),
    ({"factor": float("inf")}, "factor (inf)"),
    ({"factor": True}, "factor (True)"),
    ({"window_steps": 0}, "window_steps (0) must be an integer >= 1"),
    ({"window_steps": 2.0}, "window_steps (2.0)"),
    ({"warmup_steps": -1}, "warmup_steps (-1) must be an integer >= 0"),
    ({"min_size": 0}, "min_size (0) must be an integer >= 1"),
])
def test_bad_parameters_are_refused_with_the_value_quoted(kwargs, quoted):
    with pytest.raises(ConfigError) as info:
        StragglerPolicy(**kwargs)
    assert quoted in str(info.value)


def test_off_by_default_and_off_means_never_evict():
    watch = StragglerWatch(None)  # State(straggler=None), the default
    assert not watch.enabled and watch.slots(0, 4, ()) is None
    assert (StragglerPolicy().factor, StragglerPolicy().window_steps) == (3.0, 50)


# ---------------------------------------------------------------------- ratios

def test_ratios_compare_each_rank_with_the_median_of_the_others():
    assert ratios([0.1, 0.5], [1, 1]) == pytest.approx([0.2, 5.0])  # two ranks: the slow one still stands out
    assert ratios([0.1, 0.1, 0.1, 0.5], [1] * 4) == pytest.approx([1.0, 1.0, 1.0, 5.0])
    assert ratios([0.1, 0.2, 0.3, 0.4, 1.0], [1] * 5) == pytest.approx([1 / 3.5, 2 / 3.5, 1.0, 1.6, 4.0])


def test_ratios_leave_unmeasured_ranks_out():
    assert ratios([0.1, 0.0, 0.3, float("nan")], [1, 1, 1, 1]) == pytest.approx([1 / 3, None, 3.0, None])
    assert ratios([0.1, 0.2], [1, 0]) == [None, None]  # one measured rank: nothing to compare with
    with pytest.raises(ValueError, match="compute_s has 2 ranks but samples has 3"):
        ratios([0.1, 0.2], [1, 1, 1])


def test_ratios_divide_by_the_share():
    # Rank 0 got twice the samples on purpose and takes twice as long: it is not slow.
    assert ratios([0.2, 0.1, 0.1], [64, 32, 32]) == pytest.approx([1.0, 1.0, 1.0])


# ---------------------------------------------------------------- the decisions

def test_a_5x_slowdown_from_step_20_is_evicted_within_the_window():
    policy = StragglerPolicy(**ON)
    evictions, tracker = run_job(policy, 4, 60, lambda s: {2: 5.0} if s >= 20 else {})
    assert [e.rank for e in evictions] == [2]  # once: the others are not slow after it left
    eviction = evictions[0]
    assert eviction.slow_since == 19 and eviction.step == 29  # slow steps 20..29: exactly the window
    assert eviction.step - 20 < policy.window_steps
    assert eviction.ratio == pytest.approx(5.0, rel=0.2) and len(eviction.ratios) == 4
    fields = eviction.fields()
    assert fields["evicted_rank"] == 2 and fields["slow_steps"] == 10


def test_a_5x_slowdown_is_evicted_when_commits_come_every_few_steps():
    policy = StragglerPolicy(**ON)
    evictions, _ = run_job(policy, 4, 80, lambda s: {1: 5.0} if s > 20 else {}, commit_every=5)
    assert [(e.rank, e.slow_since, e.step) for e in evictions] == [(1, 20, 30)]


def test_2x_for_3_steps_is_not_evicted():
    for factor in (3.0, 1.5):  # with 1.5 those three steps do count as slow, but not for a whole window
        policy = StragglerPolicy(**dict(ON, factor=factor))
        evictions, tracker = run_job(policy, 4, 80, lambda s: {3: 2.0} if 20 <= s < 23 else {})
        assert evictions == [] and tracker.slow_since == {}


def test_one_very_slow_step_is_not_evicted():
    policy = StragglerPolicy(**dict(ON, window_steps=1))  # even the shortest window needs a slow *observation*
    evictions, _ = run_job(policy, 4, 60, lambda s: {0: 100.0} if s == 30 else {}, commit_every=10)
    assert evictions == []  # the commit interval's median hides one slow step among ten
    policy = StragglerPolicy(**dict(ON, window_steps=5))
    evictions, _ = run_job(policy, 4, 60, lambda s: {0: 100.0} if s == 30 else {})
    assert evictions == []


def test_an_intermittent_straggler_must_be_slow_in_every_observation_of_the_window():
    policy = StragglerPolicy(**ON)
    evictions, _ = run_job(policy, 4, 200, lambda s: {2: 5.0} if s % 4 else {})
    assert evictions == []


def test_no_eviction_during_the_warm_up_even_when_slow_from_the_start():
    policy = StragglerPolicy(**dict(ON, warmup_steps=20, window_steps=10))
    evictions, _ = run_job(policy, 4, 100, lambda s: {1: 8.0})
    assert [(e.rank, e.slow_since, e.step) for e in evictions] == [(1, 20, 30)]
    evictions, _ = run_job(policy, 4, 29, lambda s: {1: 8.0})
    assert evictions == []


def test_warm_up_starts_again_after_a_reset():
    policy = StragglerPolicy(**dict(ON, warmup_steps=5, window_steps=4))
    tracker = StragglerTracker(policy)
    for step in range(1, 9):
        assert tracker.observe(step, table(3, {0: 4.0}), [8, 8, 8]) is None
    assert tracker.slow_since == {0: 5}
    tracker.reset(9)  # a resize: ranks renumbered, newcomers compiling
    assert tracker.slow_since == {}
    decisions = [tracker.observe(step, table(3, {0: 4.0}), [8, 8, 8]) for step in range(10, 30)]
    first = next(d for d in decisions if d is not None)
    assert (first.rank, first.slow_since, first.step) == (0, 14, 18)


def test_uneven_shares_from_the_partitioner_are_not_slowness():
    assert shares(10, 4) == [3, 3, 2, 2]
    with pytest.raises(PartitionError):
        shares(3, 4)
    policy = StragglerPolicy(**dict(ON, factor=1.4, window_steps=3, warmup_steps=0))
    # Ranks 0 and 1 take 3 samples, 2 and 3 take 2: 1.5x the time, by design.
    per_rank = shares(10, 4)
    evictions, _ = run_job(policy, 4, 50, lambda s: {0: 1.5, 1: 1.5}, samples=per_rank, jitter=0.0)
    assert evictions == []
    # The same times read as equal shares would be slowness: the division is what keeps them.
    evictions, _ = run_job(policy, 4, 50, lambda s: {0: 1.5, 1: 1.5}, samples=[1, 1, 1, 1], jitter=0.0)
    assert [e.rank for e in evictions] == [0, 1]  # one per decision, the lowest rank first on a tie
    # A share assigned on purpose (rank 0 gets 4x the samples) neither.
    evictions, _ = run_job(policy, 3, 50, lambda s: {0: 4.0}, samples=[128, 32, 32], jitter=0.0)
    assert evictions == []


def test_a_large_share_does_not_hide_a_real_straggler():
    policy = StragglerPolicy(**dict(ON, warmup_steps=0))
    # Rank 0 has twice the share and takes 10x as long: 5x per sample.
    tracker = StragglerTracker(policy)
    decisions = [tracker.observe(step, table(3, {0: 10.0}), [64, 32, 32]) for step in range(1, 20)]
    found = [d for d in decisions if d is not None]
    assert found[0].rank == 0 and found[0].ratio == pytest.approx(5.0)


def test_identical_tables_give_identical_decisions_on_every_rank():
    policy = StragglerPolicy(**ON)
    runs = [run_job(policy, 6, 80, lambda s: {4: 6.0} if s >= 30 else {}, jitter=0.2)[0] for _ in range(6)]
    assert all(run == runs[0] for run in runs) and [e.rank for e in runs[0]] == [4]


def test_at_most_one_rank_per_decision_the_slowest_first_then_the_lowest_rank():
    policy = StragglerPolicy(**dict(ON, warmup_steps=0, window_steps=2))
    tracker = StragglerTracker(policy)
    tracker.observe(1, table(6, {1: 5.0, 3: 7.0}), [8] * 6)
    eviction = tracker.observe(2, table(6, {1: 5.0, 3: 7.0}), [8] * 6)
    assert eviction.rank == 3 and tracker.slow_since == {1: 0}
    tied = StragglerTracker(policy)
    tied.observe(1, table(6, {1: 5.0, 4: 5.0}), [8] * 6)
    assert tied.observe(2, table(6, {1: 5.0, 4: 5.0}), [8] * 6).rank == 1


def test_too_few_measured_ranks_decide_nothing_and_forget_runs():
    policy = StragglerPolicy(**dict(ON, warmup_steps=0, window_steps=3))
    tracker = StragglerTracker(policy)
    tracker.observe(1, [0.1, 0.0, 0.5], [1, 1, 1])
    assert tracker.slow_since == {2: 0}
    assert tracker.observe(2, [0.0, 0.0, 0.5], [1, 1, 1]) is None  # one rank measured: nobody to compare with
    assert tracker.slow_since == {}


def test_steps_must_not_go_back_and_a_repeated_step_adds_nothing():
    tracker = StragglerTracker(StragglerPolicy(**dict(ON, warmup_steps=0, window_steps=1)))
    assert tracker.observe(5, [0.1, 0.1, 0.1], [1, 1, 1]) is None
    assert tracker.observe(5, [0.1, 0.1, 0.9], [1, 1, 1]) is None
    with pytest.raises(ValueError, match=r"step \(4\) must not go back before the last observation \(5\)"):
        tracker.observe(4, [0.1, 0.1, 0.1], [1, 1, 1])


# ------------------------------------------------------- the piggybacked table

def test_slots_reduced_by_max_give_every_rank_the_whole_table():
    size = 4
    mine = [(0.1, 32), (0.25, 32), (None, 32), (0.5, 16)]
    reduced = np.max(np.stack([pack_slots(r, size, s, n) for r, (s, n) in enumerate(mine)]), axis=0)
    assert reduced.dtype == np.int64 and reduced.shape == (8,)
    compute_s, samples = unpack_slots(reduced, size)
    assert compute_s == pytest.approx([0.1, 0.25, 0.0, 0.5]) and samples == [32, 32, 0, 16]
    assert ratios(compute_s, samples)[2] is None  # unmeasured rank: left out, not fast


def test_slots_keep_a_measured_zero_apart_from_nothing_and_refuse_bad_input():
    assert pack_slots(0, 2, 0.0, 5).tolist() == [1, 0, 5, 0]  # measured: at least 1 ns
    assert pack_slots(1, 2, float("nan"), 5).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"rank \(2\) must be in \[0, size \(2\)\)"):
        pack_slots(2, 2, 0.1, 1)
    with pytest.raises(ValueError, match=r"samples \(-1\)"):
        pack_slots(0, 2, 0.1, -1)
    with pytest.raises(ValueError, match=r"shape \(3,\) must be \(4,\)"):
        unpack_slots(np.zeros(3, dtype=np.int64), 2)


# ------------------------------------------------------------------- the timer

class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_timer_measures_sections_and_reports_the_median_step():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    for seconds in (0.1, 0.1, 5.0, 0.1, 0.2):  # one slow step among five
        with timer:
            clock.now += seconds
        clock.now += 1.0  # waiting in the allreduce: not counted
    median, steps = timer.report()
    assert median == pytest.approx(0.1) and steps == 5
    assert timer.report() == (None, 0)  # each report covers the steps since the last one


def test_timer_adds_accumulation_passes_into_one_step():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    for _ in range(2):
        for _ in range(4):
            timer.start()
            clock.now += 0.05
            assert timer.stop(end_step=False) == pytest.approx(0.05)
        timer.end_step()
    timer.end_step()  # nothing ran since: no empty step
    assert timer.report() == (pytest.approx(0.2), 2)


def test_timer_drops_an_abandoned_step_and_everything_on_discard():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    with pytest.raises(KeyError):
        with timer:
            clock.now += 9.0
            raise KeyError("a collective failed mid-step")
    assert not timer.running and timer.report() == (None, 0)
    with timer:
        clock.now += 0.3
    timer.discard()
    assert timer.report() == (None, 0)


def test_timer_misuse_is_refused_and_memory_is_bounded():
    with pytest.raises(ConfigError, match=r"max_steps \(0\)"):
        StepTimer(max_steps=0)
    clock = FakeClock()
    timer = StepTimer(max_steps=3, clock=clock)
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="already running|while a section is running"):
        timer.start()
    timer.stop()
    for seconds in (1.0, 2.0, 3.0, 4.0):
        with timer:
            clock.now += seconds
    assert timer.report() == (pytest.approx(3.0), 3)  # the newest three steps


def test_timer_default_clock_is_monotonic_and_positive():
    timer = StepTimer()
    with timer:
        sum(range(1000))
    median, steps = timer.report()
    assert steps == 1 and median >= 0.0


def test_eviction_is_a_plain_record():
    eviction = Eviction(rank=1, step=30, ratio=5.0, slow_since=20, ratios=(1.0, 5.0))
    assert eviction.fields() == {"evicted_rank": 1, "step": 30, "ratio": 5.0, "slow_since": 20, "slow_steps": 10,
                                 "ratios": [1.0, 5.0]}
