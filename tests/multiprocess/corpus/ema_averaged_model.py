"""An exponential moving average of the weights with ``torch.optim.swa_utils.AveragedModel``.

The PyTorch recipe: ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))``
updated after every optimizer step with ``ema.update_parameters(model)``;
the average is what gets evaluated and saved. It is one more module in the
State (its averaged copy and its ``n_averaged`` counter), next to the
model, the optimizer and an ``ExponentialLR`` built before the wrapper.
SGD with Nesterov momentum, an MLP on the digits.

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
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=args.seed + 1,
                         **(_hooks.one_process() if args.reference else {}))

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0), (lambda fn: fn)
elif args.plain:
    import horovod.torch.elastic.state as hvd_state
    _hooks.plain_handlers(hvd_state, ElasticSampler, torch.optim.lr_scheduler.LRScheduler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, ema=ema, scheduler=scheduler, sampler=sampler,
                                   epoch=0, step=0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(model=model, optimizer=optimizer, ema=ema, scheduler=scheduler, sampler=sampler,
                              epoch=0, step=0)
    run = elastic_ext.run


def arrays():
    return {**_hooks.torch_arrays(model, optimizer), **_hooks.torch_arrays(ema, prefix="ema_")}


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
            optimizer.step()
            ema.update_parameters(model)
            scheduler.step()
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
