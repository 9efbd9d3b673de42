"""A rollback's restore on a thread beside Horovod's re-forming (elastic_ext.state.restore).

Ranks are threads over :class:`elastic_ext.testing.ThreadWorld`.
"""

import threading

import numpy as np
import pytest
import torch

from elastic_ext.config import ElasticConfig
from elastic_ext.errors import StateDivergenceError
from elastic_ext.state import digests as digests_module
from elastic_ext.state.restore import LARGE_BYTES
from elastic_ext.testing import SoloBinding, state_on
from elastic_ext.torch import ElasticSampler
from elastic_ext.testing import ThreadWorld

TABLE = LARGE_BYTES // 4 * 2  # float32 elements: 2x the size that goes to the thread


def make_states(world):
    tables = [torch.zeros(TABLE) for _ in range(world.size)]
    states = [state_on(world.binding(r), config=ElasticConfig(replica_check_every=0), table=tables[r],
                       small=np.zeros(4), step=0) for r in range(world.size)]
    assert not any(isinstance(r, BaseException) for r in world.run(lambda r: states[r].sync()))
    return tables, states


def count_digests(monkeypatch):
    """(name, thread name) of every digest computed from here on."""
    calls = []
    original = digests_module.entry_items

    def counted(name, entry, buffers):
        calls.append((name, threading.current_thread().name))
        return original(name, entry, buffers)

    monkeypatch.setattr(digests_module, "entry_items", counted)
    return calls


def test_large_objects_are_restored_on_a_thread_that_also_digests_for_the_next_sync(monkeypatch):
    world = ThreadWorld(2)
    tables, states = make_states(world)

    def commit_then_fail(rank):
        tables[rank][:5] = 1.0
        states[rank].small[:] = 2.0
        states[rank].step = 5
        states[rank].commit()
        tables[rank][:] = -1.0  # the steps after the commit, undone by the rollback
        states[rank].small[:] = -1.0
        states[rank].step = 7

    world.run(commit_then_fail)
    calls = count_digests(monkeypatch)
    for state in states:
        state.restore(background=True)
        # What run reads at once is back before the call returns: the step counter, the small array.
        assert state.step == 5 and state.small.tolist() == [2.0] * 4
        assert state._restorer.background is not None
    results = world.run(lambda r: (states[r].sync(), states[r].generation))
    assert not any(isinstance(r, BaseException) for r in results), results
    for rank, state in enumerate(states):
        assert state._restorer.background is None
        expected = torch.zeros(TABLE)
        expected[:5] = 1.0
        assert torch.equal(tables[rank], expected), rank
    # Every rank held the same bytes: nothing sent; each digest was computed once, on the restore's thread.
    assert [r[1] for r in results] == [2, 2]
    assert sorted(calls) == sorted([(name, "elastic_ext-restore") for name in ("table", "small", "step")] * 2), calls
    assert all(state._digests._kept == {} for state in states)  # cleared by the sync


def test_survivors_that_differ_are_still_caught_with_the_threads_digests():
    world = ThreadWorld(2)
    tables, states = make_states(world)

    def diverge(rank):
        tables[rank][3] = float(rank)  # rank 1 committed a different table
        states[rank].commit()

    world.run(diverge)
    for state in states:
        state.restore(background=True)
    results = world.run(lambda r: states[r].sync())
    assert all(isinstance(r, StateDivergenceError) for r in results), results
    assert "ranks [1]" in str(results[0]) and "first difference: table" in str(results[0]), results[0]


def test_an_error_on_the_restore_thread_is_raised_where_the_state_is_next_used():
    table = torch.zeros(TABLE)
    state = state_on(SoloBinding(), config=ElasticConfig(), table=table, step=0)
    state.sync()
    state.commit()
    table[:] = 3.0
    original = state._tracked.apply

    def failing(name, entry):
        if name == "table":
            raise RuntimeError("copy failed on the restore thread")
        original(name, entry)

    state._tracked.apply = failing
    state.restore(background=True)
    with pytest.raises(RuntimeError, match="copy failed on the restore thread"):
        state.commit()
    state._tracked.apply = original
    state.restore()  # the failed restore no longer stands in the way; a plain one works
    assert torch.equal(table, torch.zeros(TABLE))


def test_samplers_never_go_to_the_thread():
    """run adds a numeric rollback's skipped ranges to the samplers right after the restore."""
    state = state_on(SoloBinding(), config=ElasticConfig(), sampler=ElasticSampler(64, global_batch_size=8, seed=1),
                     table=torch.zeros(TABLE), step=0)
    assert not state._restorer.may_restore_later("sampler") and state._restorer.may_restore_later("table")
