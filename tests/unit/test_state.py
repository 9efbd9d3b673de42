"""Committed state: exact restore per adapter, commit ids, buffer reuse, atomicity."""

import random

import numpy as np
import pytest
import torch

import elastic_ext
from elastic_ext import GlobalRNG
from elastic_ext.config import ElasticConfig
from elastic_ext.errors import NotCommittedError, StateError
from elastic_ext.state.snapshot import copy_meta
from elastic_ext.testing import SoloBinding
from elastic_ext.testing import state_on


def make_state(**objects):
    return state_on(SoloBinding(), config=ElasticConfig(), **objects)


def train_steps(model, optimizer, steps, scheduler=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def snapshot(model, optimizer):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {pid: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
             for pid, st in optimizer.state_dict()["state"].items()})


def assert_bitwise(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for key in ma:
        assert torch.equal(ma[key], mb[key]), key
    assert oa.keys() == ob.keys()
    for pid in oa:
        for key in oa[pid]:
            va, vb = oa[pid][key], ob[pid][key]
            assert (torch.equal(va, vb) if torch.is_tensor(va) else va == vb), (pid, key)


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-3),
], ids=["adam", "adamw", "sgd_momentum"])
def test_restore_is_bitwise_for_model_optimizer_and_scheduler(make_opt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = make_opt(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    state = make_state(model=model, optimizer=optimizer, scheduler=scheduler, step=0)
    train_steps(model, optimizer, 3, scheduler)
    state.step = 3
    state.commit()
    expected = snapshot(model, optimizer)
    expected_sched = scheduler.state_dict()
    expected_lr = optimizer.param_groups[0]["lr"]
    train_steps(model, optimizer, 4, scheduler, seed=2)
    state.step = 7
    assert not torch.equal(model[0].weight, expected[0]["0.weight"])
    state.restore()
    assert_bitwise(snapshot(model, optimizer), expected)
    assert scheduler.state_dict() == expected_sched
    assert optimizer.param_groups[0]["lr"] == expected_lr
    assert state.step == 3
    # Training on from the restored state matches training on from the original.
    train_steps(model, optimizer, 2, scheduler, seed=3)
    after_restore = snapshot(model, optimizer)
    state.restore()
    train_steps(model, optimizer, 2, scheduler, seed=3)
    assert_bitwise(snapshot(model, optimizer), after_restore)


def test_a_rollback_restores_adam_moments_into_their_own_storage_and_a_fresh_optimizer_gets_copies():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = make_state(model=model, optimizer=optimizer)
    train_steps(model, optimizer, 2)
    state.commit()
    committed = snapshot(model, optimizer)
    def storages():  # (parameter index, state key) -> where the tensor's data lives
        return {(i, key): t.data_ptr() for i, st in enumerate(optimizer.state.values()) for key, t in st.items()
                if isinstance(t, torch.Tensor) and t.dim() > 0}

    where = storages()
    train_steps(model, optimizer, 3, seed=2)
    state.restore()
    assert_bitwise(snapshot(model, optimizer), committed)
    assert storages() == where  # copied in place: nothing allocated
    buffers = {a.ctypes.data for e in state._buffers.entries.values() for a in e.arrays.values()}
    assert not buffers & set(where.values())
    # A fresh optimizer (no state yet, as on a newcomer) gets fresh tensors, not the buffers.
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    state._tracked.objects["optimizer"] = fresh
    state.restore()
    assert_bitwise(snapshot(model, fresh), committed)
    assert not buffers & {t.data_ptr() for st in fresh.state.values() for t in st.values()
                          if isinstance(t, torch.Tensor)}


def test_optimizer_steps_after_restore_do_not_write_into_the_commit():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters())
    state = make_state(model=model, optimizer=optimizer)
    x = torch.ones(2, 3)
    model(x).sum().backward()
    optimizer.step()
    state.commit()
    committed = snapshot(model, optimizer)
    state.restore()
    for _ in range(3):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    state.restore()
    assert_bitwise(snapshot(model, optimizer), committed)


def test_commit_ids_increase_and_buffers_are_reused():
    model = torch.nn.Linear(100, 100)
    state = make_state(model=model)
    assert state.commit_id == 0
    state.commit()
    first = {k: v for k, v in state._entries["model"].arrays.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    state.commit()
    assert state.commit_id == 2
    second = state._entries["model"].arrays
    for key in first:
        assert second[key] is first[key], "commit must reuse its host buffers"
    np.testing.assert_array_equal(second["weight"], model.weight.detach().numpy())


def test_bfloat16_and_generator_and_bare_tensor_round_trip():
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(42)
    tensor = torch.arange(6.0)
    state = make_state(model=model, gen=gen, tensor=tensor)
    state.commit()
    expected_w = model.weight.detach().clone()
    expected_draw = torch.rand(4, generator=gen)
    with torch.no_grad():
        model.weight.mul_(3)
        tensor.add_(1)
    state.restore()
    assert model.weight.dtype == torch.bfloat16
    assert torch.equal(model.weight, expected_w)
    assert torch.equal(torch.rand(4, generator=gen), expected_draw)
    assert torch.equal(tensor, torch.arange(6.0))


def test_global_rng_streams_roll_back():
    state = make_state(rng=GlobalRNG(), step=0)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state.commit()
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), random.gauss(0, 1))
    state.restore()
    assert (random.random(), np.random.rand(), torch.rand(1).item(), random.gauss(0, 1)) == expected


def test_numpy_generator_random_instance_and_plain_values():
    gen = np.random.default_rng(7)
    legacy = np.random.RandomState(3)
    rnd = random.Random(5)
    array = np.arange(4.0)
    state = make_state(gen=gen, legacy=legacy, rnd=rnd, array=array,
                       info={"epoch": 2, "history": [1.5, float("nan")], "pair": (1, "a")})
    state.commit()
    expected = (gen.random(3), legacy.rand(2), rnd.random())
    array += 5
    state.info["epoch"] = 99
    state.restore()
    np.testing.assert_array_equal(gen.random(3), expected[0])
    np.testing.assert_array_equal(legacy.rand(2), expected[1])
    assert rnd.random() == expected[2]
    np.testing.assert_array_equal(array, np.arange(4.0))
    assert state.info["epoch"] == 2 and state.info["pair"] == (1, "a")
    assert np.isnan(state.info["history"][1])


def test_a_commit_shares_no_container_with_what_it_captured_or_what_it_restored():
    meta = {"a": [1, {"b": 2}], "t": (3, [4])}  # a tuple is not JSON: deep-copied
    copied = copy_meta(meta)
    meta["a"][1]["b"] = 99
    meta["t"][1].append(5)
    assert copied == {"a": [1, {"b": 2}], "t": (3, [4])}
    state = make_state(info={"history": [1, 2]})
    state.commit()
    state.info["history"].append(3)
    state.restore()
    state.info["history"].append(4)  # into the restored value, not into the commit
    state.restore()
    assert state.info == {"history": [1, 2]}


def test_failed_commit_leaves_previous_commit_intact():
    model = torch.nn.Linear(2, 2)
    state = make_state(model=model, extra={"ok": 1})
    state.commit()
    committed = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.fill_(7.0)
    state.extra = {"bad": object()}
    with pytest.raises(StateError, match="'extra'.*object"):
        state.commit()
    assert state.commit_id == 1
    state.restore()
    assert torch.equal(model.weight, committed)
    assert state.extra == {"ok": 1}


class ExplodingSource:
    """A source whose copy fails halfway, after other buffers were written."""

    def __init__(self, shape):
        self.shape, self.dtype = shape, np.dtype(np.float32)

    def copy_into(self, buffer):
        raise RuntimeError("device copy failed")


class ExplodingAdapter:
    name, synced = "exploding", True

    def __init__(self):
        self.armed = False

    def handles(self, obj):
        return isinstance(obj, dict) and "explode" in obj

    def capture(self, obj):
        from elastic_ext.state.snapshot import Capture, NumpySource
        source = ExplodingSource((2,)) if self.armed else NumpySource(np.array(obj["explode"], np.float32))
        return Capture(arrays={"a": source}, meta=None)

    def apply(self, obj, entry):
        obj["explode"] = entry.arrays["a"].tolist()
        return obj


@pytest.mark.parametrize("buffers", [1, 2])
def test_interrupted_copy(buffers):
    adapter = ExplodingAdapter()
    model = torch.nn.Linear(2, 2)
    state = state_on(SoloBinding(), config=ElasticConfig(commit_buffers=buffers), adapters=[adapter],
                  model=model, thing={"explode": [1.0, 2.0]})
    state.commit()
    committed = model.weight.detach().clone()
    adapter.armed = True
    with torch.no_grad():
        model.weight.fill_(3.0)
    with pytest.raises(RuntimeError, match="device copy failed"):
        state.commit()
    assert state.commit_id == 1
    if buffers == 2:
        state.restore()  # the spare buffers took the damage; the commit is whole
        assert torch.equal(model.weight, committed)
    else:
        with pytest.raises(StateError, match="torn"):
            state.restore()


def test_restore_before_commit_and_unknown_objects_are_clear_errors():
    state = make_state(step=0)
    with pytest.raises(NotCommittedError, match="before any commit"):
        state.restore()
    with pytest.raises(StateError, match="no adapter for 'thing'"):
        make_state(thing=object())
    with pytest.raises(StateError, match="reserved"):
        make_state(commit=1)


def test_sync_in_a_world_of_one_marks_participation_and_generation():
    model = torch.nn.Linear(2, 2)
    state = make_state(model=model, step=0)
    state.sync()
    assert state.generation == 1 and state.commit_id == 0
    state.step = 5
    state.commit()
    state.sync()
    assert state.generation == 2 and state.commit_id == 1 and state.step == 5


def test_run_rolls_back_on_horovod_internal_error_and_limits_rollbacks():
    from horovod.common.exceptions import HorovodInternalError
    binding = SoloBinding()
    state = state_on(binding, config=ElasticConfig(rollback_limit=2), step=0)
    calls = []

    @elastic_ext.run
    def train(state):
        calls.append(state.step)
        if len(calls) == 1:
            state.step = 1
            state.commit()
            state.step = 2
            raise HorovodInternalError("allreduce failed")
        return state.step

    assert train(state) == 1
    assert calls == [0, 1] and binding.resets == 1
    rollback = [e for e in state.events.history if e["event"] == "rollback"][0]
    assert rollback["steps_rolled_back"] == 1 and rollback["commit_id"] == 1

    always = state_on(SoloBinding(), config=ElasticConfig(rollback_limit=2), step=0)

    @elastic_ext.run
    def never_progresses(state):
        raise HorovodInternalError("peer gone")

    with pytest.raises(elastic_ext.RollbackLimitError, match=r"3 rollbacks in a row.*rollback_limit \(2\)"):
        never_progresses(always)


def test_run_propagates_ordinary_errors():
    state = make_state(step=0)

    @elastic_ext.run
    def broken(state):
        raise KeyError("user bug")

    with pytest.raises(KeyError, match="user bug"):
        broken(state)


def test_grad_scaler_and_plateau_scheduler_round_trip():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = make_state(optimizer=optimizer, plateau=plateau, scaler=scaler)
    assert {type(a).__name__ for a in state._adapter_of.values()} == {"TorchStatefulAdapter"}
    plateau.step(1.0)
    scaler.scale(torch.tensor(1.0))  # initialises the scale tensor
    state.commit()
    expected = (plateau.state_dict(), scaler.state_dict(), optimizer.param_groups[0]["lr"])
    plateau.step(2.0), plateau.step(3.0)
    scaler.update(new_scale=7.0)
    assert optimizer.param_groups[0]["lr"] != expected[2]
    state.restore()
    assert (plateau.state_dict(), scaler.state_dict(), optimizer.param_groups[0]["lr"]) == expected


def test_run_restores_the_sigterm_handler_and_stops_its_guardian():
    import signal

    import psutil

    from devkit.launch import command_line
    before = signal.getsignal(signal.SIGTERM)
    state = make_state(step=0)
    seen = {}

    @elastic_ext.run
    def train(state):
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        seen["children"] = [command_line(p) for p in psutil.Process().children()]
        return 1

    assert train(state) == 1
    assert seen["handler"] is not before, "SIGTERM is handled while training"
    assert any("elastic_ext.runtime.guardian" in " ".join(c) for c in seen["children"]), seen["children"]
    assert signal.getsignal(signal.SIGTERM) is before
    assert not [p for p in psutil.Process().children() if "elastic_ext.runtime.guardian" in " ".join(command_line(p))]
