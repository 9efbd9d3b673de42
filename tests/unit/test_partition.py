"""Re-partitioning: pure functions, exactly-once under resizes and rollbacks (hypothesis)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ext.data import partition
from elastic_ext.data import permutation
from elastic_ext.errors import PartitionError, StateDivergenceError
from elastic_ext.data.sampler import ElasticPartitioner


def test_order_is_a_seeded_permutation():
    a = permutation.epoch_order(1000, seed=3, epoch=1)[:]
    assert sorted(a.tolist()) == list(range(1000))
    assert np.array_equal(a, permutation.epoch_order(1000, seed=3, epoch=1)[:])
    assert not np.array_equal(a, permutation.epoch_order(1000, seed=3, epoch=2)[:])
    assert np.array_equal(permutation.epoch_order(10, 0, 0, shuffle=False)[:], np.arange(10))
    assert permutation.epoch_order(10, 0, 0)[:].dtype == np.int32
    assert permutation.epoch_order(2 ** 31, 0, 0)[:2].dtype == np.int64


@pytest.mark.parametrize("size, cursor, global_batch, world, policy", [
    (1000, 0, 24, 4, "drop"), (1000, 37, 24, 5, "pad"), (10, 0, 4, 2, "pad"), (5, 0, 12, 3, "pad"),
    (0, 0, 4, 2, "pad"), (97, 97, 8, 8, "pad"), (10 ** 6 + 3, 5 * 10 ** 5, 960, 6, "pad"),
])
def test_plan_steps_read_the_order_at_consecutive_positions(size, cursor, global_batch, world, policy):
    order = permutation.epoch_order(size, 4, 1)
    explicit = order[:]
    for rank in range(world):
        plan = partition.plan(order, cursor, global_batch, world, rank, policy)
        start, count = partition.share(global_batch, world, rank)
        assert plan.steps == partition.steps_left(size, cursor, global_batch, policy)
        one_by_one = [plan.batch(step) for step in range(plan.steps)]
        for block in (1, count, 3 * count + 1, partition.BLOCK_ELEMENTS):
            streamed = list(plan.batches(block_elements=block))
            assert len(streamed) == plan.steps
            assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                       for a, b in zip(streamed, one_by_one))
        for step in sorted(set(range(min(50, plan.steps))) | set(range(max(0, plan.steps - 2), plan.steps))):
            indices, pad = one_by_one[step]
            positions = cursor + step * global_batch + start + np.arange(count)
            assert np.array_equal(indices, explicit[positions % size]) and np.array_equal(pad, positions >= size)
        # An explicit array gives the same plan as the virtual order.
        same = partition.plan(explicit, cursor, global_batch, world, rank, policy)
        assert same.steps == plan.steps
        if plan.steps and size <= 1000:
            assert np.array_equal(same.indices, plan.indices) and np.array_equal(same.pad, plan.pad)


def test_a_plan_holds_no_indices():
    plan = partition.plan(permutation.epoch_order(10 ** 12, 0, 0), 12345, 4096, 16, 5, "pad")
    assert not any(isinstance(value, np.ndarray) for value in vars(plan).values())
    assert plan.steps == (10 ** 12 - 12345) // 4096 + 1
    indices, pad = plan.batch(plan.steps - 1)
    assert indices.shape == (256,) and pad.tolist() == [False] * 256


def test_the_padded_step_wraps_to_the_start_of_a_virtual_order():
    order = permutation.epoch_order(5, 2, 0)
    plans = [partition.plan(order, 0, 12, 3, r, policy="pad") for r in range(3)]
    last = np.concatenate([p.indices[-1] for p in plans])
    pads = np.concatenate([p.pad[-1] for p in plans])
    assert last.tolist() == (order[:].tolist() * 3)[:12] and pads.tolist() == [False] * 5 + [True] * 7
    assert plans[0].advance.tolist() == [5]


def test_shares_are_balanced_and_cover_the_batch():
    spans = [partition.share(10, 4, r) for r in range(4)]
    assert spans == [(0, 3), (3, 3), (6, 2), (8, 2)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(global_batch=2, world_size=3, rank=0), r"global batch \(2\) must be >= world_size \(3\)"),
    (dict(global_batch=4, world_size=2, rank=2), r"rank \(2\) must be in \[0, world_size \(2\)\)"),
    (dict(global_batch=4, world_size=0, rank=0), r"world_size \(0\) must be >= 1"),
])
def test_share_rejects_bad_input(kwargs, message):
    with pytest.raises(PartitionError, match=message):
        partition.share(**kwargs)


def test_plan_rejects_bad_cursor_and_policy():
    order = permutation.epoch_order(10, 0, 0)
    with pytest.raises(PartitionError, match=r"cursor \(11\) must be in \[0, 10\]"):
        partition.plan(order, 11, 2, 1, 0)
    with pytest.raises(PartitionError, match=r"policy \('wrap'\) must be one of"):
        partition.plan(order, 0, 2, 1, 0, policy="wrap")


def test_pad_policy_marks_padding_in_the_last_step():
    order = np.arange(10, dtype=np.int32)
    plans = [partition.plan(order, 0, 4, 2, r, policy="pad") for r in range(2)]
    assert [p.steps for p in plans] == [3, 3]
    last = np.concatenate([plans[0].indices[-1], plans[1].indices[-1]])
    pads = np.concatenate([plans[0].pad[-1], plans[1].pad[-1]])
    assert last.tolist() == [8, 9, 0, 1] and pads.tolist() == [False, False, True, True]
    assert plans[0].advance.tolist() == [4, 4, 2]


def test_sampler_constructor_errors_quote_values():
    with pytest.raises(PartitionError, match="exactly one of batch_size"):
        ElasticPartitioner(10, world=lambda: (0, 1))
    with pytest.raises(PartitionError, match=r"batch_size \(0\) must be an integer >= 1"):
        ElasticPartitioner(10, batch_size=0, world=lambda: (0, 1))
    with pytest.raises(PartitionError, match=r"size \(-1\)"):
        ElasticPartitioner(-1, batch_size=1, world=lambda: (0, 1))


def test_loading_a_sampler_state_for_another_dataset_is_divergence():
    a = ElasticPartitioner(100, batch_size=4, seed=1, world=lambda: (0, 1))
    b = ElasticPartitioner(90, batch_size=4, seed=1, world=lambda: (0, 1))
    with pytest.raises(StateDivergenceError, match="size=100"):
        b.load_state_dict(a.state_dict())


def test_constant_global_batch_and_accumulation():
    world = {"size": 4}
    s = ElasticPartitioner(1000, global_batch_size=24, micro_batch_size=4, world=lambda: (0, world["size"]))
    assert s.global_batch == 24 and s.accumulation_steps == 2
    world["size"] = 3
    assert s.global_batch == 24 and s.accumulation_steps == 2
    world["size"] = 2
    assert s.accumulation_steps == 3


def test_set_epoch_keeps_cursor_for_the_same_epoch():
    s = ElasticPartitioner(100, batch_size=4, world=lambda: (0, 1))
    s.record_step()
    s.set_epoch(0)
    assert s.cursor == 4
    s.set_epoch(1)
    assert (s.epoch, s.cursor) == (1, 0)


class Job:
    """A whole job, every rank simulated: commit, fail, resize, step."""

    def __init__(self, size, batch, policy, global_batch=None):
        self.world = 2
        kwargs = dict(global_batch_size=global_batch) if global_batch else dict(batch_size=batch)
        self.kwargs = dict(size=size, seed=11, policy=policy, **kwargs)
        self.sampler = ElasticPartitioner(world=lambda: (0, self.world), **self.kwargs)
        self.committed = self.sampler.state_dict()
        self.pending = []         # steps since the last commit: (epoch, indices without padding)
        self.history = []         # committed steps
        self.ends = {}            # epoch -> (cursor, global batch) when the epoch ran out

    def ranks(self):
        out = []
        for rank in range(self.world):
            s = ElasticPartitioner(world=lambda r=rank: (r, self.world), **self.kwargs)
            s.load_state_dict(self.sampler.state_dict())
            out.append(s.plan())
        return out

    def step(self, epochs):
        if self.sampler.epoch_done:
            self.ends[self.sampler.epoch] = (self.sampler.cursor, self.sampler.global_batch)
            if self.sampler.epoch + 1 >= epochs:
                return False
            self.sampler.set_epoch(self.sampler.epoch + 1)
            return True
        plans = self.ranks()
        assert len(self.sampler) == plans[0].steps, "the arithmetic step count must match the plan"
        firsts = []  # each rank's first step: (indices, pad)
        for plan in plans:
            # Every step as the sampler streams it (blocks), and batch() at both ends;
            # batch() at every step is checked by test_plan_steps_read_the_order_at_consecutive_positions
            # (computing each step alone here made this test take hours).
            all_indices, all_pad = plan.indices, plan.pad
            streamed = list(plan.batches())
            assert len(streamed) == plan.steps
            for step, (indices, pad) in enumerate(streamed):
                assert np.array_equal(indices, all_indices[step]) and np.array_equal(pad, all_pad[step])
            for step in {0, plan.steps - 1}:
                indices, pad = plan.batch(step)
                assert np.array_equal(indices, all_indices[step]) and np.array_equal(pad, all_pad[step])
            firsts.append((all_indices[0], all_pad[0]))
        taken = np.concatenate([indices[~pad] for indices, pad in firsts])
        padded = np.concatenate([indices[pad] for indices, pad in firsts])
        assert all(p.advance[0] == plans[0].advance[0] for p in plans)
        self.pending.append((self.sampler.epoch, taken, padded))
        self.sampler.record_step()
        return True

    def commit(self):
        self.history.extend(self.pending)
        self.pending = []
        self.committed = self.sampler.state_dict()

    def fail(self, new_world):
        self.pending = []
        self.sampler.load_state_dict(self.committed)
        self.world = new_world

    def resize(self, new_world):
        # Graceful: HostsUpdatedInterrupt is raised inside commit, after the save.
        self.commit()
        self.world = new_world


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 300), batch=st.integers(1, 9), policy=st.sampled_from(["drop", "pad"]),
       constant=st.booleans(),
       actions=st.lists(st.tuples(st.sampled_from(["step", "step", "step", "commit", "fail", "resize"]),
                                  st.integers(1, 6)), max_size=120))
def test_committed_history_covers_every_index_exactly_once(size, batch, policy, constant, actions):
    epochs = 2
    global_batch = batch * 6 if constant else None
    job = Job(size, batch, policy, global_batch)
    for action, world in actions:
        if action == "step":
            job.step(epochs)
        elif action == "commit":
            job.commit()
        elif action == "fail":
            job.fail(world)
        else:
            job.resize(world)
    while job.step(epochs):
        pass
    job.commit()
    for epoch in range(epochs):
        seen = np.concatenate([t for e, t, _ in job.history if e == epoch] or [np.zeros(0, np.int32)])
        assert len(seen) == len(set(seen.tolist())), "an index was processed twice in the committed history"
        missing = set(range(size)) - set(seen.tolist())
        if policy == "pad":
            assert not missing, f"epoch {epoch} skipped {sorted(missing)[:10]}"
        else:
            # Only the tail of the order, shorter than one global batch, is dropped.
            cursor, last_batch = job.ends[epoch]
            order = permutation.epoch_order(size, 11, epoch)
            assert missing == set(order[cursor:].tolist()) and len(missing) < last_batch
        pads = [p for e, _, p in job.history if e == epoch and p.size]
        assert policy == "pad" or not pads
