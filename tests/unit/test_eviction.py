"""The straggler glue between State and the rules: the slots on the commit's
allreduce, the same decision on every rank, the exclude file."""

import numpy as np
import pytest

from elastic_ext import ElasticPartitioner, StragglerPolicy
from elastic_ext.config import ElasticConfig
from elastic_ext.policies.eviction import StragglerWatch, samples_per_step
from elastic_ext.state.host_updates import FIELDS
from elastic_ext.testing.solo import SoloBinding
from elastic_ext.testing import state_on

POLICY = StragglerPolicy(factor=3.0, window_steps=8, warmup_steps=4, min_size=1)


def timed(watch, seconds, steps):
    clock = iter(np.cumsum([0.0] + [seconds, 0.0] * steps))
    watch.timer._clock = lambda: float(next(clock))
    for _ in range(steps):
        watch.timer.start()
        watch.timer.stop()


def agree(watches, seconds_per_rank, steps=4):
    """One commit of a world of len(watches) ranks: element-wise max of the slots, then every rank decides."""
    size = len(watches)
    for watch, seconds in zip(watches, seconds_per_rank):
        timed(watch, seconds, steps)
    reduced = np.max([w.slots(r, size, ()) for r, w in enumerate(watches)], axis=0)
    return [w.decide(reduced, size) for w in watches]


def test_off_adds_nothing_to_the_commit_allreduce():
    watch = StragglerWatch(None)
    assert watch.slots(0, 4, ()) is None
    seen = []
    binding = SoloBinding()
    binding.allreduce_max = lambda array, name: seen.append(array.shape) or np.array(array)
    state = state_on(binding, config=ElasticConfig(replica_check_every=0), step=0)
    state.commit()
    assert seen == [(FIELDS,)]  # the fixed part only (the replica check, off here, adds one slot per rank)


def test_every_rank_evicts_the_same_slow_rank_after_the_window_and_not_before():
    watches = [StragglerWatch(POLICY) for _ in range(4)]
    assert agree(watches, [0.01] * 4) == [None] * 4              # steps 0-4: warm-up
    assert agree(watches, [0.01, 0.05, 0.01, 0.01]) == [None] * 4  # slow since 4: 4 steps < window 8
    decisions = agree(watches, [0.01, 0.05, 0.01, 0.01])
    assert len({d for d in decisions}) == 1 and decisions[0] is not None
    assert (decisions[0].rank, decisions[0].step, decisions[0].slow_since) == (1, 12, 4)
    assert decisions[0].ratio == pytest.approx(5.0)


def test_a_reset_discards_the_measurements_and_warms_up_again():
    watches = [StragglerWatch(POLICY) for _ in range(2)]
    agree(watches, [0.01, 0.01])
    agree(watches, [0.01, 0.05])
    for watch in watches:
        timed(watch, 0.05, 3)  # measured, then thrown away by the reset (a rollback replays these steps)
        watch.reset()
    assert agree(watches, [0.01, 0.05]) == [None, None]  # warm-up after the reset
    assert agree(watches, [0.01, 0.05]) == [None, None]  # slow for 4 steps
    assert agree(watches, [0.01, 0.05])[0].rank == 1


def test_a_larger_share_given_on_purpose_is_not_slow():
    sampler = ElasticPartitioner(100, global_batch_size=10)
    assert [samples_per_step([sampler], r, 4) for r in range(4)] == [3, 3, 2, 2]
    assert samples_per_step([], 0, 4) == 1
    watches = [StragglerWatch(StragglerPolicy(factor=1.4, window_steps=4, warmup_steps=0))
               for _ in range(4)]
    size = 4
    for step in range(3):
        for rank, watch in enumerate(watches):
            timed(watch, 0.003 if rank < 2 else 0.002, 4)  # the same time per sample everywhere
        reduced = np.max([w.slots(r, size, [sampler]) for r, w in enumerate(watches)], axis=0)
        assert [w.decide(reduced, size) for w in watches] == [None] * 4


def test_the_exclude_file_gets_the_host_once(tmp_path):
    path = tmp_path / "exclude"
    path.write_text("# hosts to leave out\nnode7\n")
    watch = StragglerWatch(StragglerPolicy(), exclude_file=str(path))
    watch.exclude("node3")
    watch.exclude("node3")
    watch.exclude("node7")
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    assert [line for line in lines if line] == ["node7", "node3"]


def test_bad_policy_values_are_named():
    from elastic_ext import ConfigError
    with pytest.raises(ConfigError, match=r"straggler \(\{'factor': 3\}\) must be an elastic_ext.StragglerPolicy"):
        StragglerWatch({"factor": 3})
    with pytest.raises(ConfigError, match=r"straggler \(1\)"):
        state_on(SoloBinding(), straggler=1, step=0)
    with pytest.raises(Exception, match=r"exclude_file \(''\)"):
        ElasticConfig(exclude_file="")


def test_no_eviction_below_min_size_counting_the_whole_host():
    policy = StragglerPolicy(factor=3.0, window_steps=4, warmup_steps=0, min_size=3)
    watches = [StragglerWatch(policy) for _ in range(4)]

    def commit(local_size):
        for rank, watch in enumerate(watches):
            timed(watch, 0.05 if rank == 1 else 0.01, 4)
        reduced = np.max([w.slots(r, 4, (), local_size) for r, w in enumerate(watches)], axis=0)
        return [w.decide(reduced, 4) for w in watches]

    assert commit(2) == [None] * 4  # 4 - 2 ranks of its host < 3
    assert commit(1)[0].rank == 1   # one rank per host: 3 are left
