"""overlap_commit: a commit's collective is read at the next commit. Every rank
still acts together, one commit later; a reset drops the one in flight
(ranks simulated by threads; tests/multiprocess/test_overlap_commit.py runs
the background collective under horovodrun)."""

import numpy as np
import pytest
from horovod.common.exceptions import HostsUpdatedInterrupt

from elastic_ext import State
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import StateDivergenceError
from elastic_ext.state.host_updates import HOSTS_ADDED, HOSTS_REMOVED, HostUpdates

from tests.unit.test_state_agreement import ThreadWorld


def world_of(size, overlap):
    world = ThreadWorld(size)
    states = [State(binding=world.binding(r), config=ElasticConfig(overlap_commit=overlap), step=0)
              for r in range(size)]
    assert not any(isinstance(r, BaseException) for r in world.run(lambda r: states[r].sync()))
    return world, states


def commit_all(world, states):
    """One commit on every rank: None where it returned, else the exception."""
    def commit(rank):
        states[rank].step += 1
        states[rank].commit()
    return world.run(commit)


@pytest.mark.parametrize("overlap, acts_at", [(False, 1), (True, 2)])
def test_a_host_update_seen_by_rank_0_acts_on_every_rank_at_the_same_commit(overlap, acts_at):
    world, states = world_of(3, overlap)
    states[0].on_hosts_updated(100, HOSTS_ADDED)  # Horovod notifies the coordinator only
    for commit in range(1, 4):
        results = commit_all(world, states)
        if commit < acts_at:
            assert results == [None] * 3, (commit, results)
        elif commit == acts_at:
            assert all(isinstance(r, HostsUpdatedInterrupt) for r in results), (commit, results)
            assert [r.skip_sync for r in results] == [False] * 3  # hosts added: newcomers need a sync
            for state in states:
                state.on_reset()
                assert state.commit_id == acts_at  # the commit was made: nothing is lost
        else:
            assert results == [None] * 3, (commit, results)  # acted on once, not again


def test_a_removal_acts_one_commit_later_without_a_sync():
    world, states = world_of(2, True)
    states[0].on_hosts_updated(100, HOSTS_REMOVED)
    assert commit_all(world, states) == [None, None]
    results = commit_all(world, states)
    assert [r.skip_sync for r in results] == [True, True]


def test_differing_commit_ids_fail_at_the_next_commit_on_every_rank():
    world, states = world_of(2, True)

    def commit(rank):
        if rank == 1:
            states[rank].save()  # a local snapshot: rank 1's id is now one ahead
        states[rank].commit()

    assert world.run(commit) == [None, None]  # commit 1's allreduce is only read at the next commit
    results = commit_all(world, states)
    assert all(isinstance(r, StateDivergenceError) for r in results), results
    assert "from 1 to 2" in str(results[0])


def test_a_reset_drops_the_collective_in_flight():
    world, states = world_of(2, True)
    states[0].on_hosts_updated(100, HOSTS_ADDED)
    assert commit_all(world, states) == [None, None]  # the update is in flight
    for state in states:
        state.on_reset()  # a failure's reset: a new Horovod context
    assert commit_all(world, states) == [None, None]
    assert commit_all(world, states) == [None, None]


class CountingBinding:
    """One rank; counts collectives and says whether each was started in the background."""

    framework = "count"

    def __init__(self):
        self.calls = []

    def rank(self):
        return 0

    def size(self):
        return 1

    def allreduce_max(self, array, name):
        self.calls.append(("blocking", name))
        return np.array(array, copy=True)

    def allreduce_max_start(self, array, name):
        self.calls.append(("started", name))
        result = np.array(array, copy=True)

        def wait():
            self.calls.append(("waited", name))
            return result
        return wait


def test_with_a_background_collective_no_commit_waits_for_its_own():
    binding = CountingBinding()
    hosts = HostUpdates(overlap=True)
    for commit_id in (1, 2, 3):
        assert hosts.agree(binding, commit_id, leaving=False) == (None, None)
    assert binding.calls == [("started", "elastic_ext.hosts"), ("waited", "elastic_ext.hosts"),
                             ("started", "elastic_ext.hosts"), ("waited", "elastic_ext.hosts"),
                             ("started", "elastic_ext.hosts")]
    blocking = CountingBinding()
    HostUpdates(overlap=False).agree(blocking, 1, leaving=False)
    assert blocking.calls == [("blocking", "elastic_ext.hosts")]


def test_overlap_commit_comes_from_the_environment():
    assert ElasticConfig.from_env({"ELASTIC_EXT_OVERLAP_COMMIT": "1"}).overlap_commit is True
    assert ElasticConfig.from_env({}).overlap_commit is False


def test_a_commit_waits_for_the_previous_collective_before_its_snapshot():
    """So that no rank takes snapshot k + 1 while another has not taken k: after a failure,
    survivors' commit ids still differ by one at most (what sync relies on)."""
    binding = CountingBinding()
    binding.broadcast = lambda array, root, name: np.array(array, copy=True)
    binding.allgather = lambda array, name: np.array(array, copy=True)
    binding.reset = lambda: None
    binding.as_internal_error = lambda exc: None
    state = State(binding=binding, config=ElasticConfig(overlap_commit=True), step=0)
    seen = []
    started = binding.allreduce_max_start

    def start(array, name):
        wait = started(array, name)
        return lambda: (seen.append(state.commit_id), wait())[1]

    binding.allreduce_max_start = start
    state.sync()
    for _ in range(3):
        state.commit()
    assert seen == [1, 2]  # commit 1's collective read while the newest snapshot was still 1, not 2
