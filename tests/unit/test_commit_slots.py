"""The policies' interface to the commit: a row in the one collective, its own columns of the table back."""

import numpy as np
import pytest
from horovod.common.exceptions import HostsUpdatedInterrupt

from elastic_ext.config import ElasticConfig
from elastic_ext.policies.eviction import StragglerAtCommit
from elastic_ext.policies.replica_check import ReplicaCheck
from elastic_ext.state.commit_slots import CommitSlots, columns
from elastic_ext.state.host_updates import FIELDS
from elastic_ext.testing import state_on
from elastic_ext.testing.solo import SoloBinding


class Toy:
    """A policy at commit in a few lines: two slots, and what it was handed back."""

    blocking = False

    def __init__(self, values, changes=False):
        self.values, self.changes, self.seen = values, changes, []

    def row(self, at):
        return None if self.values is None else np.array(self.values, dtype=np.int64)

    def check(self, cols, at):
        self.seen.append(("check", at.commit_id, cols.tolist()))

    def observe(self, cols, at):
        self.seen.append(("observe", at.commit_id, None if cols is None else cols.tolist()))
        return False

    def enact(self, at):
        self.seen.append(("enact", at.commit_id))
        return self.changes


def test_columns_are_cut_by_the_layout_of_the_rows_that_were_given():
    a, b, c = Toy([1]), Toy(None), Toy([2, 3])
    slots = CommitSlots([a, b, c])
    extra, layout, blocking = slots.rows(None)
    assert extra.tolist() == [1, 2, 3] and layout == ((a, 1), (c, 2)) and not blocking
    table = np.array([7, 8, 9])
    assert columns(table, layout, a).tolist() == [7] and columns(table, layout, c).tolist() == [8, 9]
    assert columns(table, layout, b) is None and columns(None, layout, a) is None
    assert columns(table, ((a, 3),), a) is table  # a lone row is the whole table, as before


def test_a_policy_added_to_the_state_rides_on_the_commits_collective_and_gets_its_columns():
    sent = []
    binding = SoloBinding()
    binding.allreduce_max = lambda array, name: sent.append(np.array(array)) or np.array(array)
    state = state_on(binding, config=ElasticConfig(replica_check_every=0), step=0)
    assert [type(c) for c in state._slots.contributions] == [ReplicaCheck, StragglerAtCommit]
    toy = Toy([5, 6])
    state._slots.contributions.append(toy)
    state.commit()
    assert sent[-1][FIELDS:].tolist() == [5, 6], sent[-1]  # replica off, no straggler policy: only its row
    assert toy.seen == [("check", 1, [5, 6]), ("observe", 1, [5, 6]), ("enact", 1)]


def test_a_policy_that_changes_the_world_interrupts_every_rank_at_its_commit():
    binding = SoloBinding()
    state = state_on(binding, config=ElasticConfig(replica_check_every=0), step=0)
    state._slots.contributions.append(Toy([1], changes=True))
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    assert state.commit_id == 1  # the commit is made all the same
