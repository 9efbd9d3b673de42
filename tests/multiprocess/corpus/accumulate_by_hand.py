"""Gradient accumulation by hand: micro-batches from ``ElasticSampler(micro_batch_size=...)``, then one
``hvd.allreduce_`` per gradient and the step of a plain optimizer.

The README's own loop: forward and backward on each micro-batch (the sampler
says how many: ``sampler.accumulation_steps``, which follows the world
size), then the gradients summed over the ranks by hand with ``op=hvd.Sum``
(each micro-batch's loss is its per-sample sum divided by the global batch,
so the sum over ranks is the global mean), then ``optimizer.step()``.
No ``hvd.DistributedOptimizer``. Adam with a ``MultiStepLR``, an MLP on the digits.

``--reference``: one process, no Horovod, the whole global batch per step in
the same micro-batches of at most 8.
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
model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[10, 18], gamma=0.3)
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, micro_batch_size=8, seed=args.seed + 1,
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
            share = torch.from_numpy(indices)
            for micro in share.chunk(sampler.accumulation_steps):
                loss = F.cross_entropy(model(X[micro]), Y[micro], reduction="sum") / args.global_batch
                loss.backward()
            if not args.reference:
                for i, param in enumerate(model.parameters()):
                    hvd.allreduce_(param.grad, op=hvd.Sum, name=f"grad.{i}")
            optimizer.step()
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
