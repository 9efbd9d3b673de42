"""Gradient accumulation with ``hvd.DistributedOptimizer(backward_passes_per_step=2)``.

Each rank splits its share of the global batch in two micro-batches and
calls ``backward()`` on each; Horovod accumulates locally and allreduces on
the second pass (its documented way to accumulate). Each micro-batch's loss
is its per-sample sum over the rank's share, so the two passes add up to the
rank's mean, and the ranks' average (equal shares: the global batch of 60
divides by 2, 3, 4 and 5) is the mean of the global batch. RMSprop with a
cosine ``CosineAnnealingLR`` built after the wrapper, an MLP on the digits.

``--reference``: one process, no Horovod, the whole global batch per step
(the same two halves, accumulated by ``backward()``).
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
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.SiLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.RMSprop(model.parameters(), lr=2e-3, momentum=0.5)
PASSES = 2
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=PASSES)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
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
            share = torch.from_numpy(indices)
            for micro in share.chunk(PASSES):
                loss = F.cross_entropy(model(X[micro]), Y[micro], reduction="sum") / len(share)
                loss.backward()
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
