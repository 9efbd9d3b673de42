"""Overlapped commits: where the binding runs the commit's collective in the background and commits
come less than a second apart, a commit's collective is read at the next commit. Every rank still
acts together, one commit later; commits further apart block again, on every rank at the same
commit; a reset drops the collective in flight (ranks simulated by threads)."""

import numpy as np
import pytest
from horovod.common.exceptions import HostsUpdatedInterrupt

from elastic_ext.config import ElasticConfig
from elastic_ext.errors import StateDivergenceError
from elastic_ext.state import host_updates
from elastic_ext.state.host_updates import HOSTS_ADDED, HOSTS_REMOVED, HostUpdates
from elastic_ext.testing import state_on

from tests.unit.test_state_agreement import ThreadWorld


def world_of(size, background):
    """``size`` synced States; with ``background`` their binding can start the commit's collective
    (here it runs at once and is read later: what matters is when a rank reads it)."""
    world = ThreadWorld(size)
    bindings = [world.binding(r) for r in range(size)]
    if background:
        for binding in bindings:
            binding.allreduce_max_start = lambda array, name, b=binding: (lambda r: lambda: r)(b.allreduce_max(array, name))
    states = [state_on(b, config=ElasticConfig(), step=0) for b in bindings]
    assert not any(isinstance(r, BaseException) for r in world.run(lambda r: states[r].sync()))
    return world, states


def commit_all(world, states):
    """One commit on every rank: None where it returned, else the exception."""
    def commit(rank):
        states[rank].step += 1
        states[rank].commit()
    return world.run(commit)


def overlapping(world, states):
    """Two commits in quick succession: the first blocks and votes to block (no interval yet), the
    second blocks and votes to overlap, so the commits after it overlap on every rank."""
    assert commit_all(world, states) == [None] * len(states)
    assert commit_all(world, states) == [None] * len(states)
    assert all(state._hosts.overlapping for state in states)
    return world, states


@pytest.mark.parametrize("background, acts_at", [(False, 1), (True, 2)])
def test_a_host_update_seen_by_rank_0_acts_on_every_rank_at_the_same_commit(background, acts_at):
    world, states = world_of(3, background)
    if background:
        overlapping(world, states)
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
        else:
            assert results == [None] * 3, (commit, results)  # acted on once, not again


def test_a_removal_acts_one_commit_later_without_a_sync():
    world, states = overlapping(*world_of(2, True))
    states[0].on_hosts_updated(100, HOSTS_REMOVED)
    assert commit_all(world, states) == [None, None]
    results = commit_all(world, states)
    assert [r.skip_sync for r in results] == [True, True]


def test_differing_commit_ids_fail_at_the_next_commit_on_every_rank():
    world, states = overlapping(*world_of(2, True))

    def commit(rank):
        if rank == 1:
            states[rank].save()  # a local snapshot: rank 1's id is now one ahead
        states[rank].commit()

    assert world.run(commit) == [None, None]  # this commit's allreduce is only read at the next commit
    results = commit_all(world, states)
    assert all(isinstance(r, StateDivergenceError) for r in results), results
    assert "from 3 to 4" in str(results[0])


def test_a_reset_drops_the_collective_in_flight():
    world, states = overlapping(*world_of(2, True))
    states[0].on_hosts_updated(100, HOSTS_ADDED)
    assert commit_all(world, states) == [None, None]  # the update is in flight
    for state in states:
        state.on_reset()  # a failure's reset: a new Horovod context
        assert not state._hosts.overlapping  # commits block again until a vote says otherwise
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
        self.calls.append("blocking")
        return np.array(array, copy=True)

    def allreduce_max_start(self, array, name):
        self.calls.append("started")
        result = np.array(array, copy=True)

        def wait():
            self.calls.append("waited")
            return result
        return wait


def test_commits_overlap_while_they_come_often_and_block_again_when_they_are_far_apart(monkeypatch):
    clock = iter([0.0, 0.1, 0.2, 0.3, 5.3, 5.4, 5.5])
    monkeypatch.setattr(host_updates.time, "monotonic", lambda: next(clock))
    binding, hosts = CountingBinding(), HostUpdates(overlap=True)
    for commit_id in range(1, 8):
        assert hosts.agree(binding, commit_id, leaving=False) == (None, None)
    assert binding.calls == [
        "blocking",              # 1: no interval yet: blocks, votes to block
        "blocking",              # 2: 0.1 s after: votes to overlap, agreed at once
        "started",               # 3: overlapped
        "waited", "started",     # 4: reads 3, starts its own
        "waited", "started",     # 5 (5 s later): reads 4 (overlap), starts its own with a vote to block
        "waited", "blocking",    # 6: reads 5 (block), so it blocks on its own, which votes to overlap
        "started"]               # 7: overlapped again


def test_a_binding_that_cannot_start_a_collective_in_the_background_always_blocks():
    class Blocking(CountingBinding):
        allreduce_max_start = None

    binding = Blocking()
    hosts = HostUpdates(overlap=False)
    for commit_id in (1, 2, 3):
        hosts.agree(binding, commit_id, leaving=False)
    assert binding.calls == ["blocking"] * 3


def test_a_commit_waits_for_the_previous_collective_before_its_snapshot():
    """So that no rank takes snapshot k + 1 while another has not taken k: after a failure,
    survivors' commit ids still differ by one at most (what sync relies on)."""
    binding = CountingBinding()
    binding.broadcast = lambda array, root, name: np.array(array, copy=True)
    binding.allgather = lambda array, name: np.array(array, copy=True)
    binding.reset = lambda: None
    binding.as_internal_error = lambda exc: None
    state = state_on(binding, config=ElasticConfig(), step=0)
    seen = []
    started = binding.allreduce_max_start

    def start(array, name):
        wait = started(array, name)
        return lambda: (seen.append(state.commit_id), wait())[1]

    binding.allreduce_max_start = start
    state.sync()
    for _ in range(5):
        state.commit()
    assert seen == [3, 4]  # commit 3's collective read while the newest snapshot was still 3, not 4
