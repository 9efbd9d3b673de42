"""bench.chaos's analytic bounds: lost time with overlapping failures, and the throughput on fewer workers."""

import pytest

from bench import chaos


def test_a_lone_failure_loses_the_stall_and_the_missing_share_until_full_size():
    # 1 s standing still, then 3 s at 0.75 of the throughput: 1 + 0.25 * 3.
    assert chaos.lost_capacity([10.0], 1.0, 4.0, 0.75, 100.0) == pytest.approx(1.75, abs=0.02)


def test_overlapping_failures_count_each_instant_at_its_worst():
    # The second failure's stall [11, 12] falls in the first's reduced part; from 12 on,
    # the reduced part runs to 15 (the second failure's full size).
    assert chaos.lost_capacity([10.0, 11.0], 1.0, 4.0, 0.75, 100.0) == pytest.approx(2.0 + 0.25 * 3, abs=0.02)


def test_a_failure_near_the_end_is_cut_there():
    assert chaos.lost_capacity([99.5], 1.0, 4.0, 0.5, 100.0) == pytest.approx(0.5, abs=0.02)


def test_without_a_reduced_phase_it_is_the_union_of_the_stalls():
    kills = [5.0, 5.5, 30.0]
    assert chaos.lost_capacity(kills, 2.0, 2.0, 0.75, 60.0) == pytest.approx(chaos.lost(kills, 2.0, 60.0), abs=0.02)


def test_the_throughput_on_three_is_measured_over_steady_seconds_only():
    timeline = [[i, 1000, 4] for i in range(10)] + [[10, 300, 3]] + [[i, 780, 3] for i in range(11, 20)]
    timeline += [[20, 500, 4]] + [[i, 1000, 4] for i in range(21, 25)]
    assert chaos.reduced_throughput(timeline) == (pytest.approx(0.78), True)


def test_too_few_seconds_on_three_gives_the_share_of_workers():
    timeline = [[i, 1000, 4] for i in range(10)] + [[10, 700, 3], [11, 700, 3]]
    assert chaos.reduced_throughput(timeline) == (0.75, False)


def test_what_was_trained_after_a_failure_is_split_into_close_and_isolated_failures():
    # 100 samples a second at full size; failures at 20 s (isolated), 50 and 53 s (the second close).
    timeline = [[t, 0 if t in (20, 50, 53) else 100, 4] for t in range(0, 80)]
    result = {"throughput_samples_per_s": 100.0, "timeline": timeline,
              "failures": [{"at_s": 20.4}, {"at_s": 50.2}, {"at_s": 53.9}]}
    windows = chaos.after_failures(result)
    assert windows == {"close": [9.0], "isolated": [9.0]}  # 50.2 has a failure within 10 s after it: neither
    timeline[55][1] = 0  # a second lost after the close one
    assert chaos.after_failures(result)["close"] == [8.0]


def test_efficiency_against_the_run_s_own_pace_uses_its_steady_seconds_at_four():
    # The failure-free jobs measured 1100 samples/s; in the run, steady seconds at 4 did 1000.
    timeline = [[t, 1000, 4] for t in range(0, 40)] + [[40, 0, 3]] + [[t, 750, 3] for t in range(41, 44)]
    timeline += [[t, 1000, 4] for t in range(44, 100)]
    result = {"training_wall_s": 100.0, "throughput_samples_per_s": 1100.0, "goodput_samples_per_s": 950.0,
              "resume_median_s": 1.0, "full_size_median_s": 4.0, "failures": [{"at_s": 40.0}], "timeline": timeline}
    out = chaos.efficiency(result)
    assert out["step_efficiency"] == pytest.approx(950 / 1100)
    assert out["throughput_in_run_samples_per_s"] == 1000
    assert out["step_efficiency_in_run"] == pytest.approx(0.95)
    assert out["points_below_bound_reduced_throughput_in_run"] == pytest.approx(
        100 * (out["bound_reduced_throughput"] - 0.95))
    del result["timeline"][5:]  # too few steady seconds: not reported
    assert "step_efficiency_in_run" not in chaos.efficiency(result)
