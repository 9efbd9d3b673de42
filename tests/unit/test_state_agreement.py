"""What must agree across ranks and what may differ; collision-free keys,
reserved names, device-neutral entries, one first collective for every rank
at sync, and commit ids checked at every commit.

Several ranks are simulated by threads over :class:`elastic_ext.testing.ThreadWorld`, an
in-memory binding with the exact semantics of the three collectives (and a
check that every rank calls the same collective, which Horovod would answer
with a hang); the multi-process tier runs the same paths under horovodrun.
"""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ext import State
from elastic_ext.state import tree
from elastic_ext.state.snapshot import Entry
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import StateDivergenceError, StateError
from elastic_ext.runtime.assembly import reserved_names
from elastic_ext.testing import SoloBinding
from elastic_ext.testing import state_on
from elastic_ext.testing import CollectiveMismatch, ThreadWorld


def bn_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(2 * 6 * 6, 3))


def train_on_own_batch(model, optimizer, rank, same_grads=True):
    """One step; BatchNorm statistics come from this rank's batch, gradients are
    the same on every rank (as after an allreduce) unless same_grads is False."""
    model.train()
    model(torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(100 + rank)))
    gen = torch.Generator().manual_seed(7 if same_grads else 7 + rank)
    optimizer.zero_grad()
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    optimizer.step()


def make_world_states(world, **extra):
    models = [bn_model() for _ in range(world.size)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    # The replica check would heal a diverging rank at its commit; these tests are about sync's own check.
    config = ElasticConfig(replica_check_every=0)
    states = [state_on(world.binding(r), config=config, model=models[r], optimizer=optimizers[r],
                    epoch=0, **{k: v(r) for k, v in extra.items()}) for r in range(world.size)]
    return models, optimizers, states


# ---------------------------------------------------------------- agreement

def test_differing_batchnorm_buffers_are_taken_from_the_root_and_parameters_checked():
    world = ThreadWorld(3)
    models, optimizers, states = make_world_states(world)
    assert not any(isinstance(r, BaseException) for r in world.run(lambda r: states[r].sync()))

    def step_commit_sync(rank):
        train_on_own_batch(models[rank], optimizers[rank], rank)
        states[rank].commit()
        states[rank].sync()  # every rank a survivor at the same commit: the recovery case

    results = world.run(step_commit_sync)
    assert not any(isinstance(r, BaseException) for r in results), results
    for rank in (1, 2):
        for key, value in models[rank].state_dict().items():
            assert torch.equal(value, models[0].state_dict()[key]), (rank, key)
    loaded = [e for s in states for e in s.events.history if e["event"] == "sync" and e["generation"] == 2]
    assert [e["loaded"] for e in loaded] == [False, True, True]


def test_differing_parameters_raise_naming_the_first_entry_and_the_ranks():
    world = ThreadWorld(3)
    models, optimizers, states = make_world_states(world)
    world.run(lambda r: states[r].sync())

    def diverge(rank):
        train_on_own_batch(models[rank], optimizers[rank], rank, same_grads=(rank != 2))
        states[rank].commit()
        states[rank].sync()

    results = world.run(diverge)
    assert all(isinstance(r, StateDivergenceError) for r in results), results
    message = str(results[0])
    # The first entry in commit order that differs: the conv weight (parameters come before buffers).
    assert "ranks [2]" in message and "than rank 0" in message and "first difference: model['0.weight']" in message, message
    assert all(str(r) == message for r in results)


def test_differing_plain_value_names_its_metadata():
    world = ThreadWorld(2)
    states = [state_on(world.binding(r), config=ElasticConfig(replica_check_every=0), epoch=0, lr=0.1)
              for r in range(2)]
    world.run(lambda r: states[r].sync())

    def diverge(rank):
        states[rank].lr = 0.1 * (rank + 1)
        states[rank].commit()
        states[rank].sync()

    results = world.run(diverge)
    assert all(isinstance(r, StateDivergenceError) for r in results), results
    assert "ranks [1]" in str(results[0]) and "first difference: lr (metadata)" in str(results[0])


def test_per_rank_objects_may_differ_and_are_never_broadcast():
    world = ThreadWorld(2)
    states = [state_on(world.binding(r), config=ElasticConfig(), per_rank=("metric",), epoch=0,
                    metric=np.zeros(2)) for r in range(2)]
    world.run(lambda r: states[r].sync())

    def own_metric(rank):
        states[rank].metric[:] = rank + 1
        states[rank].commit()
        states[rank].sync()
        states[rank].metric[:] = -1
        states[rank].restore()
        return states[rank].metric.copy()

    results = world.run(own_metric)
    assert [r.tolist() for r in results] == [[1.0, 1.0], [2.0, 2.0]], results
    with pytest.raises(StateError, match=r"per_rank names \['nope'\] that are not tracked"):
        state_on(SoloBinding(), per_rank=("nope",), epoch=0)


# ------------------------------------------------------ 18.1: one collective

def test_survivors_and_a_newcomer_meet_in_the_same_first_collective():
    """A removal-only resize whose freed slot a newcomer fills: survivors used to
    call verify() (allgather "elastic_ext.verify") while the newcomer called
    sync() (allgather "elastic_ext.state.sync.ids"): a hang under Horovod."""
    world = ThreadWorld(2)
    survivor_model, newcomer_model = bn_model(0), bn_model(1)
    survivor = state_on(world.binding(0), config=ElasticConfig(), model=survivor_model, step=0)
    solo = survivor._binding
    survivor._binding = SoloBinding()
    survivor.sync()
    survivor.step = 4
    survivor.commit()
    survivor._binding = solo
    newcomer = state_on(world.binding(1), config=ElasticConfig(), model=newcomer_model, step=0)
    results = world.run(lambda r: survivor.sync() if r == 0 else newcomer.sync())
    assert not any(isinstance(r, BaseException) for r in results), results
    assert newcomer.step == 4 and newcomer.commit_id == survivor.commit_id == 1
    assert newcomer.generation == survivor.generation
    for key, value in survivor_model.state_dict().items():
        assert torch.equal(value, newcomer_model.state_dict()[key]), key


def test_sync_sends_nothing_more_when_every_rank_already_agrees():
    world = ThreadWorld(2)
    models, optimizers, states = make_world_states(world)
    world.run(lambda r: states[r].sync())
    calls = []
    for state in states:
        original = state._binding.broadcast

        def counted(array, root_rank, name, original=original):
            calls.append(name)
            return original(array, root_rank, name)

        state._binding.broadcast = counted
    results = world.run(lambda r: (states[r].commit(), states[r].sync(), states[r].generation))
    assert [r[2] for r in results] == [2, 2], results
    assert calls == []  # identical state, every rank a survivor: only the allgather


# ---------------------------------------------------- 18.6: ids at each commit

def test_commit_ids_that_differ_fail_at_that_commit():
    world = ThreadWorld(2)
    states = [state_on(world.binding(r), config=ElasticConfig(), step=0) for r in range(2)]
    world.run(lambda r: states[r].sync())

    def commit(rank):
        if rank == 1:
            states[rank].save()  # a local snapshot: rank 1's id is now one ahead
        states[rank].commit()

    results = world.run(commit)
    assert all(isinstance(r, StateDivergenceError) for r in results), results
    assert "from 1 to 2" in str(results[0]) and "this rank: 1" in str(results[0])
    assert "this rank: 2" in str(results[1])


# -------------------------------------------------------------- tree keys

@pytest.mark.parametrize("value", [
    {"a.b": 1.0, "a": {"b": 2.0}},
    {1: 1.0, "1": 2.0},
    {"a[0]": 1.0, "a": [2.0]},
    {"": {"a": 1.0}, "a": 2.0, ".a": 3.0},
    {"x\\": {"y": 1.0}, "x\\.y": 2.0, "x": {"\\": {"y": 3.0}}},
    [[1.0], {0: 2.0}, {"0": 3.0}],
], ids=["dot", "int-vs-str", "bracket", "empty-key", "backslash", "list-vs-int-key"])
def test_split_keys_never_collide_and_join_restores_each_array(value):
    def arrays_of(tree_value):
        if isinstance(tree_value, dict):
            return {k: arrays_of(v) for k, v in tree_value.items()}
        if isinstance(tree_value, list):
            return [arrays_of(v) for v in tree_value]
        return np.array([tree_value])

    def leaves(tree_value):
        if isinstance(tree_value, dict):
            return sum(leaves(v) for v in tree_value.values())
        if isinstance(tree_value, list):
            return sum(leaves(v) for v in tree_value)
        return 1

    original = arrays_of(value)
    arrays, skeleton = tree.split(original)
    assert len(arrays) == leaves(value)  # one key per leaf: none overwrote another
    back = tree.join(skeleton, {k: np.array(s.array, copy=True) for k, s in arrays.items()})
    assert repr(back) == repr(original)


components = st.one_of(st.text(alphabet="ab.[]\\0", max_size=3), st.integers(-3, 12))


@settings(max_examples=300, deadline=None)
@given(st.lists(components, max_size=4), st.lists(components, max_size=4))
def test_path_key_is_injective_and_parses_back(a, b):
    assert tree.parse_key(tree.path_key(a)) == a
    assert (tree.path_key(a) == tree.path_key(b)) == (a == b)


# ------------------------------------------------------------ reserved names

def test_every_public_member_of_state_is_a_reserved_name():
    public = {name for name in dir(State) if not name.startswith("_")}
    assert public <= reserved_names()
    assert {"generation", "checkpoint_now", "rollbacks", "host_update_pending", "seconds_since_commit",
            "register_adapter", "per_rank"} <= reserved_names()
    keywords = {"framework", "binding", "adapters", "config", "per_rank", "guard"}  # never reach **objects
    for name in sorted(public - keywords):
        with pytest.raises(StateError, match=f"object name '{name}' is reserved"):
            state_on(SoloBinding(), **{name: 7})
    with pytest.raises(StateError, match="must be a Python identifier"):
        state_on(SoloBinding(), **{"my model": 7})


# ---------------------------------------------------------- device neutral

def test_committed_entries_carry_no_device_and_old_cuda_tags_load_on_cpu():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = state_on(SoloBinding(), model=model, optimizer=optimizer, weights=torch.zeros(2))
    state.commit()
    for name, entry in state._entries.items():
        assert '"device"' not in json.dumps(entry.meta), (name, entry.meta)
    committed = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}

    def with_device(meta, device):
        if isinstance(meta, dict):
            out = {k: with_device(v, device) for k, v in meta.items()}
            if "dtype" in out and "requires_grad" in out:
                out["device"] = device
            return out
        if isinstance(meta, list):
            return [with_device(v, device) for v in meta]
        return meta

    # An entry (or checkpoint) from an older version, written on rank 3 of a GPU host.
    for name in ("model", "optimizer", "weights"):
        entry = state._entries[name]
        state._entries[name] = Entry(arrays=entry.arrays, meta=with_device(entry.meta, "cuda:3"))
    assert '"cuda:3"' in json.dumps(state._entries["optimizer"].meta)
    optimizer.step()
    state.restore()
    restored = optimizer.state_dict()["state"][0]
    for key, value in committed.items():
        assert restored[key].device.type == "cpu" and torch.equal(restored[key], value), key
    assert restored["exp_avg"].data_ptr() != state._entries["optimizer"].arrays["state[0].exp_avg"].ctypes.data


def test_a_checkpoint_written_on_gpu_rank_3_resumes_on_cpu(tmp_path):
    from elastic_ext.checkpoint import write_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    writer = state_on(SoloBinding(), model=model, optimizer=optimizer, step=3)
    writer.commit()

    def on_gpu(meta):  # the tags an older version wrote on cuda:3
        if isinstance(meta, dict):
            out = {k: on_gpu(v) for k, v in meta.items()}
            if "dtype" in out and "requires_grad" in out:
                out["device"] = "cuda:3"
            return out
        return [on_gpu(v) for v in meta] if isinstance(meta, list) else meta

    entries = {name: Entry(arrays=e.arrays, meta=on_gpu(e.meta)) for name, e in writer._entries.items()}
    write_checkpoint(str(tmp_path), 1, entries, {"world_size": 8, "generation": 1})

    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    reader = state_on(SoloBinding(), config=ElasticConfig(checkpoint_dir=str(tmp_path)), model=fresh,
                   optimizer=fresh_opt, step=0)
    reader.sync()
    assert reader.step == 3 and reader.commit_id == 1
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    momentum = fresh_opt.state_dict()["state"][0]["momentum_buffer"]
    assert momentum.device.type == "cpu"
    assert torch.equal(momentum, optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_the_thread_world_meets_in_collectives_and_names_a_mismatch():
    """The public seam itself: exact collectives across threads; ranks in different collectives fail, not hang."""
    world = ThreadWorld(3, barrier_timeout_s=5)
    gathered = world.run(lambda r: world.binding(r).allgather(np.array([r, 10 * r]).reshape(1, 2), "g"))
    assert [g.tolist() for g in gathered] == [[[0, 0], [1, 10], [2, 20]]] * 3
    assert world.run(lambda r: world.binding(r).broadcast(np.array([r]), 2, "b").tolist()) == [[2]] * 3
    mismatched = world.run(lambda r: world.binding(r).allreduce_max(np.array([r]), "m" if r else "other"))
    assert all(isinstance(result, CollectiveMismatch) for result in mismatched), mismatched
    with pytest.raises(ValueError, match=r"size \(0\) must be >= 1"):
        ThreadWorld(0)
    with pytest.raises(ValueError, match=r"rank \(3\) must be in \[0, 3\)"):
        world.binding(3)
