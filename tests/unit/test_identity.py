"""A restore or a sync changes values, never identities: what the user holds keeps working.

The scripts users write keep references into the objects they hand to ``State``: an LR scheduler
built on the optimizer before ``hvd.DistributedOptimizer`` wrapped it (Horovod's wrapper is a new
optimizer built on the original's ``param_groups``, so both share the group dicts), a cached
``group = optimizer.param_groups[0]``, Adam's moment tensors, a list of metrics. Ranks are threads
(ThreadWorld); the wrapper is built the way ``horovod.torch.DistributedOptimizer`` builds it (a
subclass of the optimizer's class, constructed on its ``param_groups``), without its hooks, which
need ``hvd.init()``. The multi-process corpus runs the real wrapper under horovodrun.
"""

import math

import torch

from elastic_ext.config import ElasticConfig
from elastic_ext.testing import state_on

from tests.unit.test_state_agreement import ThreadWorld

BASE_LR = 0.1


def wrapped_like_horovod(optimizer):
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), {})
    return cls(optimizer.param_groups)  # as Horovod: the groups carry their own settings


def build(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    warmup_cosine = lambda step: min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(step, 20) / 20))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, warmup_cosine)  # built BEFORE the wrapper
    optimizer = wrapped_like_horovod(inner)
    return model, optimizer, scheduler


def step(model, optimizer, scheduler):
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()


def test_a_scheduler_built_before_the_wrapper_drives_every_rank_after_a_sync():
    world = ThreadWorld(3)
    jobs = [build(seed=r) for r in range(3)]  # different initial weights: the sync brings rank 0's
    states = [state_on(world.binding(r), config=ElasticConfig(replica_check_every=0), model=jobs[r][0],
                       optimizer=jobs[r][1], scheduler=jobs[r][2]) for r in range(3)]
    groups = [job[1].param_groups for job in jobs]
    dicts = [list(g) for g in groups]
    assert world.run(lambda r: states[r].sync()) == [None] * 3
    for r, (model, optimizer, scheduler) in enumerate(jobs):
        assert optimizer.param_groups is groups[r] and optimizer.param_groups[0] is dicts[r][0], r
        for _ in range(4):
            step(model, optimizer, scheduler)
        assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0], (r, optimizer.param_groups[0]["lr"])
    for model, _, _ in jobs[1:]:
        assert torch.equal(model.weight, jobs[0][0].weight)


def test_a_restore_keeps_the_groups_the_state_dicts_and_the_moment_tensors():
    world = ThreadWorld(1)
    model, optimizer, scheduler = build()
    state = state_on(world.binding(0), config=ElasticConfig(replica_check_every=0), model=model,
                     optimizer=optimizer, scheduler=scheduler, history=[], extra={"seen": []})
    assert world.run(lambda r: state.sync()) == [None]
    step(model, optimizer, scheduler)
    history, seen = state.history, state.extra["seen"]
    history.append(1.5)
    seen.append("a")
    cached_group = optimizer.param_groups[0]
    per_param = optimizer.state[model.weight]
    moment = per_param["exp_avg"]
    state.commit()
    committed = (model.weight.detach().clone(), moment.clone(), cached_group["lr"])
    step(model, optimizer, scheduler)
    history.append(2.5)
    seen.append("b")
    state.restore()
    assert state.history is history and history == [1.5]
    assert state.extra["seen"] is seen and seen == ["a"]
    assert optimizer.param_groups[0] is cached_group and cached_group["lr"] == committed[2]
    assert optimizer.state[model.weight] is per_param and per_param["exp_avg"] is moment
    assert torch.equal(moment, committed[1]) and torch.equal(model.weight, committed[0])
    # The scheduler goes on writing where the optimizer reads.
    step(model, optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]


def grow(survivors, newcomers, callback_scale=True):
    """Ranks 0..len(survivors)-1 survive a reset into a world with the newcomers; Horovod's documented
    reset callback sets every group's lr to BASE_LR * size. Returns the jobs of the new world."""
    size = len(survivors) + len(newcomers)
    world = ThreadWorld(size)
    jobs, states = [], []
    for r, (job, state) in enumerate(survivors):
        object.__setattr__(state, "_binding", world.binding(r))
        jobs.append(job)
        states.append(state)
    for r, job in enumerate(newcomers, len(survivors)):
        jobs.append(job)
        states.append(state_on(world.binding(r), config=ElasticConfig(replica_check_every=0), model=job[0],
                               optimizer=job[1], scheduler=job[2]))

    def body(r):
        if r < len(survivors):
            states[r].on_reset()
        states[r].sync()
    assert world.run(body) == [None] * size
    return jobs, states


def test_what_the_reset_callbacks_change_reaches_the_newcomers():
    world = ThreadWorld(2)
    jobs = [build() for _ in range(2)]
    states = [state_on(world.binding(r), config=ElasticConfig(replica_check_every=0), model=jobs[r][0],
                       optimizer=jobs[r][1], scheduler=jobs[r][2]) for r in range(2)]
    for r, state in enumerate(states):
        def on_reset(optimizer=jobs[r][1], state=state):
            for group in optimizer.param_groups:
                group["lr"] = BASE_LR * state.binding.size()
        state.register_reset_callbacks([on_reset])
    assert world.run(lambda r: states[r].sync()) == [None] * 2
    for r in range(2):
        step(*jobs[r])
    assert world.run(lambda r: states[r].commit()) == [None] * 2
    jobs, states = grow(list(zip(jobs, states)), [build(seed=5)])
    for r, (model, optimizer, _) in enumerate(jobs):
        assert optimizer.param_groups[0]["lr"] == BASE_LR * 3, (r, optimizer.param_groups[0]["lr"])
        assert torch.equal(model.weight, jobs[0][0].weight), r
    assert [s.commit_id for s in states] == [1, 1, 1]


def test_a_scheduler_whose_optimizer_is_not_tracked_is_refused_at_construction():
    import pytest

    from elastic_ext.errors import StateError

    model, optimizer, scheduler = build()
    with pytest.raises(StateError, match=r"scheduler 'sched' \(LambdaLR\) drives an optimizer \(AdamW\) .*"
                                         r"Track the optimizer too"):
        state_on(ThreadWorld(1).binding(0), model=model, sched=scheduler)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(StateError, match="does not track"):
        state_on(ThreadWorld(1).binding(0), model=model, optimizer=other, sched=scheduler)
    state_on(ThreadWorld(1).binding(0), model=model, optimizer=optimizer, sched=scheduler)  # the wrapper counts
