"""The replica check explains a mismatch before it heals anything: every rank goes back to the last
commit on which all agreed and trains again to the commit that differed. A transient fault (a bit
flipped in a parameter or an Adam moment, at any step between two commits) is undone, and the job ends
bitwise equal to the failure-free run, with the wrong rank's host struck; a deterministic divergence
(one rank stepping its schedule twice) stops every rank with StateDivergenceError and strikes nobody.

Ranks are threads (ThreadWorld). Each step's gradient is computed from the rank's own parameters and
averaged over the ranks (an allgather, as Horovod's allreduce would), so a corrupt copy's gradients
reach every rank's weights before the check sees them. ``train`` drives the State as ``run`` does:
on ``ReplicaMismatchError`` every rank replays from the agreed commit. The multi-process tier runs the
same path under horovodrun (tests/multiprocess/test_replica.py).
"""

import numpy as np
import pytest
import torch

from elastic_ext.config import ElasticConfig
from elastic_ext.errors import ConfigError, ReplicaMismatchError, StateDivergenceError
from elastic_ext.liveness import Liveness
from elastic_ext.policies.replica import NOT_MINE, RepeatOffenders, judge, pack_digest
from elastic_ext.testing import state_on
from devkit.faults import flip_bit

from tests.unit.test_state_agreement import ThreadWorld


def make_job(size, every=1, exclude_file=None):
    world = ThreadWorld(size)
    models, optimizers, schedulers = [], [], []
    for _ in range(size):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        models.append(model)
        optimizers.append(optimizer)
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)))
    config = ElasticConfig(replica_check_every=every, exclude_file=exclude_file)
    states = [state_on(world.binding(r), config=config, model=models[r], optimizer=optimizers[r],
                       scheduler=schedulers[r], step=0) for r in range(size)]
    for state in states:
        object.__setattr__(state, "_liveness", Liveness())  # one process per rank, not one for all threads
    assert not any(isinstance(r, BaseException) for r in world.run(lambda r: states[r].sync()))
    return world, models, optimizers, schedulers, states


def train(job, steps, commit_every, faults=None, twice=None):
    """Trains every rank to ``steps`` as ``run`` would; ``faults[(rank, step)](rank)`` fires once after
    that step's update; ``twice = (rank, step)``: that rank steps its scheduler twice from ``step`` on.
    Returns each rank's result (None, or the exception that ended it)."""
    world, models, optimizers, schedulers, states = job
    pending = dict(faults or {})

    def one_step(rank):
        state = states[rank]
        gen = torch.Generator().manual_seed(1000 * state.step + rank)
        x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 2, generator=gen)
        optimizers[rank].zero_grad()
        torch.nn.functional.mse_loss(models[rank](x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in models[rank].parameters()]).numpy()
        mean = world_binding(rank).allgather(flat[None], "grads").mean(axis=0)
        offset = 0
        for p in models[rank].parameters():
            p.grad.copy_(torch.from_numpy(mean[offset:offset + p.numel()].reshape(p.shape)))
            offset += p.numel()
        optimizers[rank].step()
        schedulers[rank].step()
        if twice is not None and rank == twice[0] and state.step >= twice[1]:
            schedulers[rank].step()

    def world_binding(rank):
        return states[rank].binding

    def body(rank):
        state = states[rank]
        while True:
            try:
                while state.step < steps:
                    one_step(rank)
                    fault = pending.pop((rank, state.step), None)
                    if fault is not None:
                        fault(rank)
                    state.step += 1
                    if state.step % commit_every == 0:
                        state.commit()
                return None
            except ReplicaMismatchError:
                state.replay_from_agreed()
    return world.run(body)


def events(state, kind):
    return [e for e in state.events.history if e["event"] == kind]


def weights(job, rank):
    _, models, optimizers, _, _ = job
    return ([p.detach().clone() for p in models[rank].parameters()],
            [t.clone() for s in optimizers[rank].state.values() for t in s.values() if torch.is_tensor(t)],
            [g["lr"] for g in optimizers[rank].param_groups])


def assert_same(job_a, rank_a, job_b, rank_b):
    for a, b in zip(weights(job_a, rank_a), weights(job_b, rank_b)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert (torch.equal(x, y) if torch.is_tensor(x) else x == y), (rank_a, rank_b)


def failure_free(size, steps, commit_every):
    job = make_job(size)
    assert train(job, steps, commit_every) == [None] * size
    return job


def flip_param(job, rank_to_flip, bit):
    def fault(rank):
        flip_bit(job[1][rank][0].weight.detach().numpy(), index=3, bit=bit)
    return fault


def flip_moment(job, bit):
    def fault(rank):
        first = job[1][rank][0].weight
        flip_bit(job[2][rank].state[first]["exp_avg"].numpy(), index=1, bit=bit)
    return fault


def test_the_verdict_names_the_minority_and_needs_a_strict_majority():
    assert judge([5, 5, 5, 5]).agreed
    verdict = judge([5, 9, 5, 5])
    assert (verdict.majority, verdict.wrong, verdict.healable) == ((0, 2, 3), (1,), True)
    tie = judge([5, 9, 9, 5])  # two against two: nobody can tell
    assert not tie.healable and tie.majority == () and tie.wrong == (1, 2)
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


@pytest.mark.parametrize("where, bit", [("param", 5), ("param", 30), ("moment", 30), ("moment", 3)])
@pytest.mark.parametrize("step", [4, 5, 6])  # two, one and no steps before the commit at step 7
def test_a_flip_at_any_step_between_commits_ends_bitwise_equal_to_the_failure_free_run(where, bit, step):
    reference = failure_free(4, 14, 7)
    job = make_job(4)
    fault = flip_param(job, 2, bit) if where == "param" else flip_moment(job, bit)
    assert train(job, 14, 7, faults={(2, step): fault}) == [None] * 4
    for rank in range(4):
        assert_same(job, rank, reference, 0)
    for state in job[4]:
        [replay] = events(state, "replica_replay")
        assert replay["commit_id"] == 1 and replay["back_to"] == 0 and replay["wrong_ranks"] == [2]
        # A flipped moment changes the next updates' weights, or (a low bit) only itself.
        expected = ("model['0.weight']", "['exp_avg']") if where == "moment" else ("model['0.weight']",)
        assert any(e in replay["first_difference"] for e in expected), replay
        [event] = events(state, "replica_mismatch")
        assert event["cause"] == "transient" and event["healed"] and event["wrong_ranks"] == [2], event
        assert event["struck_hosts"] == event["wrong_hosts"] and event["repeat_hosts"] == [], event
        assert event["replayed_from"] == 0 and state.commit_id == 2


def test_a_flip_that_spreads_to_every_rank_through_the_gradients_is_still_undone():
    # Checked every 2nd commit: the flip at step 1 is in every rank's weights by commit 2 (all
    # ranks averaged the corrupt copy's gradients), but rank 1's own weights differ too.
    reference = failure_free(3, 8, 2)
    job = make_job(3, every=2)
    assert train(job, 8, 2, faults={(1, 1): flip_param(job, 1, 28)}) == [None] * 3
    for rank in range(3):
        assert_same(job, rank, reference, 0)
    [replay] = events(job[4][0], "replica_replay")
    assert replay["commit_id"] == 2 and replay["back_to"] == 0, replay


def test_a_scheduler_stepped_twice_on_one_rank_stops_every_rank_and_strikes_no_host(tmp_path):
    exclude = tmp_path / "exclude"
    job = make_job(4, exclude_file=str(exclude))
    results = train(job, 12, 3, twice=(1, 4))  # from step 4 on: first checked commit after it is commit 2
    for result in results:
        assert isinstance(result, StateDivergenceError), results
        message = str(result)
        assert "ranks [1]" in message and "deterministic" in message and "back to commit 1" in message, message
        assert "no host was struck" in message and "scheduler" in message, message
    for state in job[4]:
        assert [e["commit_id"] for e in events(state, "replica_replay")] == [2]
        [event] = events(state, "replica_mismatch")
        assert event["cause"] == "divergence" and not event["healed"] and event["struck_hosts"] == [], event
        assert not state._liveness.leaving()
    assert not exclude.exists()


def test_with_two_ranks_a_transient_flip_is_undone_and_nobody_is_struck():
    reference = failure_free(2, 6, 3)
    job = make_job(2)
    assert train(job, 6, 3, faults={(1, 1): flip_param(job, 1, 4)}) == [None, None]
    assert_same(job, 0, reference, 0)
    assert_same(job, 1, reference, 0)
    [event] = events(job[4][0], "replica_mismatch")
    assert event["cause"] == "transient" and event["majority_ranks"] == [] and event["struck_hosts"] == [], event


def test_a_host_wrong_twice_asks_to_leave_and_is_excluded(tmp_path):
    exclude = tmp_path / "exclude"
    job = make_job(3, exclude_file=str(exclude))
    faults = {(1, 1): flip_param(job, 1, 2), (1, 4): flip_param(job, 1, 3)}
    assert train(job, 6, 3, faults=faults) == [None] * 3
    states = job[4]
    found = events(states[0], "replica_mismatch")
    assert [e["cause"] for e in found] == ["transient", "transient"]
    assert found[-1]["repeat_hosts"] == found[-1]["wrong_hosts"]
    assert states[1]._liveness.leaving() and states[1]._liveness.leave_cause == "replica"
    assert not states[0]._liveness.leaving() and not states[2]._liveness.leaving()
    assert exclude.read_text().split()[0] == found[-1]["wrong_hosts"][0]


def test_a_mismatch_at_the_first_check_after_a_sync_before_any_step_is_a_divergence():
    # The training function sets a learning rate that depends on the rank, then commits before any
    # step: state that must agree differs from the start, and again after the replay.
    world, _, optimizers, _, states = job = make_job(3)

    def body(rank):
        while True:
            try:
                if rank == 2:
                    optimizers[rank].param_groups[0]["lr"] *= 2
                states[rank].commit()
                return None
            except ReplicaMismatchError:
                states[rank].replay_from_agreed()
    results = world.run(body)
    assert all(isinstance(r, StateDivergenceError) for r in results), results
    assert "first difference: optimizer (metadata)" in str(results[0]) and "ranks [2]" in str(results[0]), results[0]
    [event] = events(job[4][0], "replica_mismatch")
    assert event["cause"] == "divergence" and event["commit_id"] == 1 and event["replayed_from"] == 0, event


def test_the_check_runs_only_at_its_cadence_and_keeps_nothing_when_off():
    job = make_job(3, every=0)
    assert train(job, 4, 1, faults={(2, 1): flip_param(job, 2, 3)}) == [None] * 3
    assert not events(job[4][0], "replica_replay") and job[4][0]._replica.agreed.entries is None
    job = make_job(3, every=2)
    assert train(job, 4, 1) == [None] * 3
    kept = job[4][0]._replica.agreed
    assert kept.commit_id == 4 and job[4][0]._replica.last_agreed == 4
    assert all(np.array_equal(kept.entries["model"].arrays[k], a)
               for k, a in job[4][0]._entries["model"].arrays.items())


def test_bad_settings_name_the_value():
    with pytest.raises(ConfigError, match="replica_check_every"):
        ElasticConfig(replica_check_every=-1)
    with pytest.raises(ConfigError, match="exclude_file"):
        ElasticConfig(exclude_file=" ")
    assert ElasticConfig.from_env({"ELASTIC_EXT_REPLICA_CHECK_EVERY": "7"}).replica_check_every == 7


def test_where_commits_overlap_a_checked_commit_blocks_and_replays_at_once():
    # PyTorch's binding starts the commit's collective in the background and the next commit reads it;
    # a checked commit runs its own blocking, so that the replay starts before any rank trains on.
    reference = failure_free(3, 8, 2)
    job = make_job(3, every=2)
    for state in job[4]:
        binding = state.binding

        def start(array, name, _binding=binding):
            result = _binding.allreduce_max(array, name)
            return lambda: result
        binding.allreduce_max_start = start
        state._hosts.overlap = True
    assert train(job, 8, 2, faults={(1, 2): flip_param(job, 1, 9)}) == [None] * 3
    assert [e["commit_id"] for e in events(job[4][0], "replica_replay")] == [2]
    for rank in range(3):
        assert_same(job, rank, reference, 0)


class HeldCheckpoints:
    """Records what the replica check asks of the checkpoint writer's retention."""

    def __init__(self):
        self.calls = []

    def hold(self, commit_id):
        self.calls.append(("hold", commit_id))

    def release(self):
        self.calls.append(("release",))


def test_retention_keeps_the_last_agreed_checkpoint_until_the_mismatch_is_explained():
    job = make_job(3)
    writers = [HeldCheckpoints() for _ in job[4]]
    for state, writer in zip(job[4], writers):
        state._replica.checkpoints = writer
    assert train(job, 6, 2, faults={(1, 3): flip_param(job, 1, 7)}) == [None] * 3
    assert all(w.calls == [("hold", 1), ("release",)] for w in writers), [w.calls for w in writers]
    job = make_job(3)
    writers = [HeldCheckpoints() for _ in job[4]]
    for state, writer in zip(job[4], writers):
        state._replica.checkpoints = writer
    assert all(isinstance(r, StateDivergenceError) for r in train(job, 6, 2, twice=(0, 2)))
    assert all(w.calls == [("hold", 1)] for w in writers), [w.calls for w in writers]  # never released
