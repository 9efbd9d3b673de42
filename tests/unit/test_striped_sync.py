"""Striped sync: a rank that lacks the commit gets it from every rank that holds it,
one contiguous stripe each, in one allgather (ranks simulated by threads)."""

import numpy as np
import pytest
import torch

from elastic_ext.binding import gather_striped, layout_sizes, stripe_bounds
from elastic_ext.config import ElasticConfig
from elastic_ext.testing import state_on

from elastic_ext.testing import ThreadWorld
from tests.unit.test_state_agreement import bn_model, train_on_own_batch


def layout_of(arrays):
    return [[key, a.dtype.str, list(a.shape)] for key, a in arrays.items()]


def some_arrays(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((7, 5)).astype(np.float32), "step": np.array([3], dtype=np.int64),
            "mask": rng.integers(0, 2, (9,)).astype(np.bool_), "h": rng.standard_normal(11).astype(np.float16),
            "empty": np.zeros((0, 4), dtype=np.float64)}


@pytest.mark.parametrize("holders", [[0], [0, 2, 3], [1, 2], [0, 1, 2, 3]])
def test_every_rank_gets_the_holders_bytes_and_each_holder_sends_one_share(holders):
    world = ThreadWorld(4)
    held = some_arrays(1)
    layout = layout_of(held)
    total = sum(layout_sizes(layout))
    sent = {}
    real_allgather = type(world.binding(0)).allgather

    def run(rank):
        binding = world.binding(rank)
        if len(holders) > 1:
            def allgather(array, name, _binding=binding):
                sent[rank] = array.nbytes
                return real_allgather(_binding, array, name)
            binding.allgather = allgather
        mine = {k: v.copy() for k, v in held.items()} if rank in holders else {}
        return gather_striped(binding, mine, layout, holders, "t")

    results = world.run(run)
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        assert sorted(got) == sorted(held)
        for key in held:
            assert got[key].dtype == held[key].dtype and got[key].shape == held[key].shape
            assert got[key].tobytes() == held[key].tobytes(), (rank, key)
    if len(holders) > 1:
        assert sum(sent.values()) == total
        assert {r for r, n in sent.items() if n} <= set(holders)
        assert max(sent.values()) - min(sent[r] for r in holders) <= 1  # near-equal shares
        assert all(sent[r] == 0 for r in range(4) if r not in holders)


def test_stripe_bounds_cover_everything_once_even_when_smaller_than_the_count():
    for total, count in ((0, 3), (2, 3), (10, 3), (437_000_000, 7)):
        bounds = stripe_bounds(total, count)
        assert bounds[0] == 0 and bounds[-1] == total and len(bounds) == count + 1
        assert all(b - a in (total // count, total // count + 1) for a, b in zip(bounds, bounds[1:]))


def test_a_newcomer_gets_the_commit_from_all_three_survivors_and_matches_them():
    world = ThreadWorld(4)
    models = [bn_model(seed=0) for _ in range(4)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    states = [state_on(world.binding(r), config=ElasticConfig(), model=models[r], optimizer=optimizers[r],
                    epoch=0) for r in range(4)]

    def train(rank):
        states[rank].sync()
        train_on_own_batch(models[rank], optimizers[rank], 0)  # the same batch: BatchNorm statistics agree
        states[rank].epoch = 1
        states[rank].commit()

    assert not any(isinstance(r, BaseException) for r in world.run(train))
    # Rank 2's process is replaced: a fresh model with other weights, never synced.
    models[2] = bn_model(seed=5)
    optimizers[2] = torch.optim.SGD(models[2].parameters(), lr=0.1, momentum=0.9)
    states[2] = state_on(world.binding(2), config=ElasticConfig(), model=models[2], optimizer=optimizers[2],
                      epoch=0)
    results = world.run(lambda rank: states[rank].sync())
    assert not any(isinstance(r, BaseException) for r in results), results
    for rank in range(4):
        event = [e for e in states[rank].events.history if e["event"] == "sync"][-1]
        assert event["senders"] == [0, 1, 3], event
        assert event["loaded"] == (rank == 2)
        assert event["newcomers"] == 1
    reference = models[0].state_dict()
    for key, value in models[2].state_dict().items():
        assert torch.equal(value, reference[key]), key
    assert states[2].epoch == 1
    assert optimizers[2].state_dict()["state"].keys() == optimizers[0].state_dict()["state"].keys()
    for pid, st in optimizers[0].state_dict()["state"].items():
        assert torch.equal(optimizers[2].state_dict()["state"][pid]["momentum_buffer"], st["momentum_buffer"])
