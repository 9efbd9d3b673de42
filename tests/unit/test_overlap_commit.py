"""Overlapped commits: where the binding runs the commit's collective in the background (PyTorch), a
commit's collective is read at the next commit. Every rank still acts together, one commit later; a
reset drops the collective in flight; a leaver whose grace is shorter than a commit interval leaves at
its commit, once every rank has taken it (ranks simulated by threads)."""

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
    assert all(state._hosts.overlap for state in states)
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
    assert "from 1 to 2" in str(results[0])


def test_a_reset_drops_the_collective_in_flight():
    world, states = overlapping(*world_of(2, True))
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
        self.calls.append("blocking")
        return np.array(array, copy=True)

    def allreduce_max_start(self, array, name):
        self.calls.append("started")
        result = np.array(array, copy=True)

        def wait():
            self.calls.append("waited")
            return result
        return wait


def test_with_a_background_collective_no_commit_waits_for_its_own():
    binding, hosts = CountingBinding(), HostUpdates(overlap=True)
    for commit_id in (1, 2, 3):
        assert hosts.agree(binding, commit_id, leaving=False) == (None, None)
    assert binding.calls == ["started", "waited", "started", "waited", "started"]


def test_an_eviction_read_from_the_previous_collective_leaves_none_in_flight():
    """Found by test_straggler.py: the eviction, agreed from commit k's table read at commit k + 1,
    was acted on after commit k + 1's collective had started; a rank slower to start it found the
    evicted rank gone and failed (a rollback) where the others resized. A decision that changes
    the world starts no collective, as a resize does not."""
    binding, hosts = CountingBinding(), HostUpdates(overlap=True)
    seen = []
    assert hosts.agree(binding, 1, leaving=False, changes_world=lambda t: seen.append(t) or False) == (None, None)
    assert seen == [None]  # no earlier collective: nothing to decide on yet
    result = hosts.agree(binding, 2, leaving=False, changes_world=lambda t: True)
    assert result == (None, None)
    assert binding.calls == ["started", "waited"]  # commit 2's collective was never started
    assert hosts._in_flight is None


def test_a_leaver_whose_grace_ends_before_the_next_commit_leaves_at_this_one(monkeypatch):
    """Its leave would act at the commit after this one (it is in this commit's collective, read at
    the next). With less grace left than a commit interval, it leaves now, after waiting for this
    commit's collective: every rank then holds this commit, and rolls back to it."""
    from elastic_ext.liveness import Liveness
    world, states = world_of(2, True)
    live = Liveness()
    monkeypatch.setattr(states[1], "_liveness", live)
    clock = iter([0.0, 0.0, 10.0, 10.0])  # rank 0's and rank 1's collectives, commit 1 then 2: 10 s apart
    monkeypatch.setattr(host_updates, "_now", lambda: next(clock))
    assert commit_all(world, states) == [None, None]
    live.ask_to_leave(5.0)  # SIGTERM on rank 1: 5 s left, commits come every 10 s
    results = commit_all(world, states)
    assert results[0] is None, results  # rank 0 reads the leave only at the next commit
    assert isinstance(results[1], HostsUpdatedInterrupt) and results[1].skip_sync, results
    assert states[1]._hosts._in_flight is None  # its commit's collective was waited for: rank 0 took commit 2


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
    for _ in range(3):
        state.commit()
    assert seen == [1, 2]  # commit 1's collective read while the newest snapshot was still 1, not 2
