"""The replica check: a rank whose committed state differs from the majority's is found at a
commit and healed from the majority; with no strict majority every rank stops; a host wrong
twice asks to leave and is excluded. Ranks simulated by threads (ThreadWorld); the
multi-process tier runs the same path under horovodrun (tests/multiprocess/test_replica.py)."""

import numpy as np
import pytest
import torch

from elastic_ext.config import ElasticConfig
from elastic_ext.errors import ConfigError, StateDivergenceError
from elastic_ext.liveness import Liveness
from elastic_ext.policies.replica import NOT_MINE, RepeatOffenders, judge, pack_digest
from elastic_ext.testing import flip_bit, state_on

from tests.unit.test_state_agreement import ThreadWorld, bn_model, train_on_own_batch


def make_states(size, every=1, exclude_file=None):
    world = ThreadWorld(size)
    models = [bn_model() for _ in range(size)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in models]
    config = ElasticConfig(replica_check_every=every, exclude_file=exclude_file)
    states = [state_on(world.binding(r), config=config, model=models[r], optimizer=optimizers[r], epoch=0)
              for r in range(size)]
    for state in states:
        object.__setattr__(state, "_liveness", Liveness())  # one process per rank, not one for all threads
    assert not any(isinstance(r, BaseException) for r in world.run(lambda r: states[r].sync()))
    return world, models, optimizers, states


def step_and_commit(world, models, optimizers, states, corrupt=None):
    """One training step with the same gradients everywhere, then a commit; ``corrupt(rank)`` runs
    after the step, before the commit. Returns each rank's result (exceptions included)."""
    def body(rank):
        train_on_own_batch(models[rank], optimizers[rank], rank)
        if corrupt is not None:
            corrupt(rank)
        states[rank].commit()
    return world.run(body)


def mismatches(state):
    return [e for e in state.events.history if e["event"] == "replica_mismatch"]


def assert_replicas_equal(models, optimizers, skip_buffers=True):
    reference = dict(models[0].named_parameters())
    for rank, model in enumerate(models[1:], 1):
        for name, value in model.named_parameters():
            assert torch.equal(value, reference[name]), (rank, name)
    ref_state = optimizers[0].state_dict()["state"]
    for rank, optimizer in enumerate(optimizers[1:], 1):
        for pid, entries in optimizer.state_dict()["state"].items():
            for key, value in entries.items():
                assert torch.equal(value, ref_state[pid][key]), (rank, pid, key)


def test_the_verdict_names_the_minority_and_needs_a_strict_majority():
    assert judge([5, 5, 5, 5]).agreed
    verdict = judge([5, 9, 5, 5])
    assert (verdict.majority, verdict.wrong, verdict.healable) == ((0, 2, 3), (1,), True)
    tie = judge([5, 9, 9, 5])  # two against two: nobody can tell
    assert not tie.healable and tie.majority == () and tie.wrong == (1, 2)
    two = judge([5, 9])
    assert not two.healable and two.wrong == (1,)
    assert judge([3, 4, 5]).majority == ()  # three different copies
    slots = np.maximum.reduce([pack_digest(r, 3, d) for r, d in enumerate((7, 0, 2**62))])
    assert list(slots) == [7, 0, 2**62] and pack_digest(1, 3, 4)[0] == NOT_MINE
    with pytest.raises(ValueError):
        judge([1, NOT_MINE])


def test_a_host_wrong_twice_within_the_window_is_named_once():
    now = [0.0]
    offenders = RepeatOffenders(window_s=100.0, clock=lambda: now[0])
    assert offenders.note(["a", "a", "b"]) == []
    now[0] = 50.0
    assert offenders.note(["a"]) == ["a"]
    now[0] = 200.0
    assert offenders.note(["b"]) == []  # b's first time is out of the window


def test_a_flipped_parameter_bit_on_one_of_four_ranks_is_healed_from_the_other_three():
    world, models, optimizers, states = make_states(4)

    def flip(rank):
        if rank == 2:
            flip_bit(models[2][0].weight.detach().numpy(), index=3, bit=5)  # a low mantissa bit: still finite
    results = step_and_commit(world, models, optimizers, states, flip)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert_replicas_equal(models, optimizers)
    for state in states:
        [event] = mismatches(state)
        assert event["wrong_ranks"] == [2] and event["majority_ranks"] == [0, 1, 3] and event["healed"]
        assert event["first_difference"] == "model['0.weight']", event
        assert event["senders"] == [0, 1, 3] and event["bytes"] > 0 and event["commit_id"] == 1
        assert event["wrong_hosts"] and event["repeat_hosts"] == []
    # The healed commit is what a restore brings back, and the next check agrees.
    results = step_and_commit(world, models, optimizers, states)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert all(len(mismatches(s)) == 1 for s in states) and states[0]._replica.last_agreed == 2


def test_an_adam_moment_flip_is_healed_and_batchnorm_statistics_are_left_alone():
    world, models, optimizers, states = make_states(3)
    step_and_commit(world, models, optimizers, states)  # Adam has moments from here on
    own_stats = [m[1].running_mean.clone() for m in models]  # each rank's own batch: they differ

    def flip(rank):
        if rank == 0:
            moment = optimizers[0].state[models[0][3].weight]["exp_avg_sq"]
            flip_bit(moment.numpy(), index=0, bit=30)
    results = step_and_commit(world, models, optimizers, states, flip)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert_replicas_equal(models, optimizers)
    event = mismatches(states[1])[0]
    assert event["wrong_ranks"] == [0] and event["majority_ranks"] == [1, 2]
    assert "exp_avg_sq" in event["first_difference"], event
    assert not torch.equal(models[0][1].running_mean, models[1][1].running_mean), "buffers were overwritten"
    assert not torch.equal(own_stats[0], own_stats[1])


def test_with_two_ranks_a_difference_stops_every_rank_naming_the_last_agreed_commit():
    world, models, optimizers, states = make_states(2)
    step_and_commit(world, models, optimizers, states)

    def flip(rank):
        if rank == 1:
            flip_bit(models[1][3].bias.detach().numpy(), index=0, bit=1)
    results = step_and_commit(world, models, optimizers, states, flip)
    for result in results:
        assert isinstance(result, StateDivergenceError), results
        assert "no strict majority" in str(result) and "last commit on which every rank agreed is 1" in str(result)
    assert [e["healed"] for e in mismatches(states[0])] == [False]


def test_a_host_wrong_twice_asks_to_leave_and_is_excluded(tmp_path):
    exclude = tmp_path / "exclude"
    world, models, optimizers, states = make_states(3, exclude_file=str(exclude))
    for _ in range(2):
        results = step_and_commit(
            world, models, optimizers, states,
            lambda rank: rank == 1 and flip_bit(models[1][0].bias.detach().numpy(), index=0, bit=2))
        assert not any(isinstance(r, BaseException) for r in results), results
    assert [e["repeat_hosts"] for e in mismatches(states[0])][-1] == mismatches(states[0])[-1]["wrong_hosts"]
    assert states[1]._liveness.leaving() and states[1]._liveness.leave_cause == "replica"
    assert not states[0]._liveness.leaving() and not states[2]._liveness.leaving()
    host = mismatches(states[1])[-1]["wrong_hosts"][0]
    assert exclude.read_text().split()[0] == host


def test_the_check_runs_only_at_its_cadence_and_not_at_all_when_off():
    world, models, optimizers, states = make_states(3, every=2)
    flips = lambda rank: rank == 2 and flip_bit(models[2][0].bias.detach().numpy(), index=1, bit=3)  # noqa: E731
    step_and_commit(world, models, optimizers, states, flips)  # commit 1: not checked
    assert not mismatches(states[0])
    step_and_commit(world, models, optimizers, states)  # commit 2: checked, rank 2 still differs
    assert [e["commit_id"] for e in mismatches(states[0])] == [2]
    world, models, optimizers, states = make_states(3, every=0)
    step_and_commit(world, models, optimizers, states, flips)
    assert not mismatches(states[0]) and states[0]._replica.last_agreed is None


def test_bad_settings_name_the_value():
    with pytest.raises(ConfigError, match="replica_check_every"):
        ElasticConfig(replica_check_every=-1)
    with pytest.raises(ConfigError, match="exclude_file"):
        ElasticConfig(exclude_file=" ")
    assert ElasticConfig.from_env({"ELASTIC_EXT_REPLICA_CHECK_EVERY": "7"}).replica_check_every == 7


def test_where_commits_overlap_a_checked_commit_blocks_and_heals_at_once():
    # PyTorch's binding starts the commit's collective in the background and the next commit reads it;
    # a checked commit runs its own blocking, so that the heal comes before the wrong rank trains on.
    world, models, optimizers, states = make_states(3, every=2)
    for rank, state in enumerate(states):
        binding = state.binding

        def start(array, name, _binding=binding):
            result = _binding.allreduce_max(array, name)
            return lambda: result
        binding.allreduce_max_start = start
        state._hosts.overlap = True
    step_and_commit(world, models, optimizers, states)  # commit 1: overlapped, in flight
    assert states[0]._hosts._in_flight is not None
    flips = lambda rank: rank == 1 and flip_bit(models[1][0].weight.detach().numpy(), index=2)  # noqa: E731
    results = step_and_commit(world, models, optimizers, states, flips)  # commit 2: checked, blocking
    assert not any(isinstance(r, BaseException) for r in results), results
    assert [e["commit_id"] for e in mismatches(states[0])] == [2] and states[0]._hosts._in_flight is None
    assert_replicas_equal(models, optimizers)
    step_and_commit(world, models, optimizers, states)  # commit 3: overlapped again
    assert states[0]._hosts._in_flight is not None and len(mismatches(states[2])) == 1
