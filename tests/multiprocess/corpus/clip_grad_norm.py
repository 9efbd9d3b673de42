"""Gradient clipping the Horovod way: ``optimizer.synchronize()``, clip, then the step without a second allreduce.

Horovod's documented pattern for anything that must see the reduced
gradients before the step (clipping, unscaling)::

    loss.backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with optimizer.skip_synchronize():
        optimizer.step()

SGD with momentum and a ``StepLR`` schedule, an MLP on the digits; the norm (0.3) is below
every step's gradient norm, so every step is clipped, so the clip's factor (a function of the
reduced gradient's norm) is part of every update.

``--reference``: one process, no Horovod, the whole global batch per step.
``--plain``: Horovod's ``hvd.elastic.TorchState`` and ``hvd.elastic.run``.
"""

import _hooks

args = _hooks.arguments(__doc__.split("\n")[0]).parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import elastic_ext  # noqa: E402
from elastic_ext.torch import ElasticSampler  # noqa: E402

torch.set_num_threads(1)
if not args.reference:
    hvd.init()
hooks = _hooks.Hooks(args, *(() if args.reference else (hvd.rank, hvd.size)))

X, Y = map(torch.from_numpy, _hooks.digits(720, args.seed))
steps_per_epoch = len(X) // args.global_batch
total_steps = args.epochs * steps_per_epoch

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.5)
MAX_NORM = 0.3
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=args.seed + 1,
                         **(_hooks.one_process() if args.reference else {}))

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0), (lambda fn: fn)
elif args.plain:
    import horovod.torch.elastic.state as hvd_state
    _hooks.plain_handlers(hvd_state, ElasticSampler, torch.optim.lr_scheduler.LRScheduler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                                   epoch=0, step=0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                              epoch=0, step=0)
    run = elastic_ext.run


def arrays():
    return _hooks.torch_arrays(model, optimizer)


@run
def train(state):
    hooks.started(state, sampler.epoch, sampler.cursor)
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, _ in sampler.batches():
            hooks.step(state, sampler.epoch, sampler.cursor, indices)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(X[indices]), Y[indices])
            loss.backward()
            if args.reference:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
            else:
                optimizer.synchronize()
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                with optimizer.skip_synchronize():
                    optimizer.step()
            scheduler.step()
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=loss.item(), lr=optimizer.param_groups[0]["lr"], norm=norm.item())
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
