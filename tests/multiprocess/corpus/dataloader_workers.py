"""A ``DataLoader`` with two worker processes over ``ElasticSampler`` as its ``batch_sampler``.

The PyTorch tutorials' input pipeline: a ``Dataset`` class and a
``DataLoader(dataset, batch_sampler=sampler, num_workers=2)``; the elastic
sampler plans each rank's batches in the main process, and its position
moves only at ``sampler.record_step()``, so batches the workers prefetched
before a rollback or a resize are never counted. The dataset also returns
each sample's index (for the sample ledger of the tests). Adagrad with an
``ExponentialLR``, an MLP on the digits.

``--reference``: one process, no Horovod, the whole global batch per step,
through the same ``DataLoader``.
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


class Digits(torch.utils.data.Dataset):
    def __len__(self):
        return len(Y)

    def __getitem__(self, index):
        return X[index], Y[index], index


steps_per_epoch = len(X) // args.global_batch
total_steps = args.epochs * steps_per_epoch

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.97)
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=args.seed + 1,
                         **(_hooks.one_process() if args.reference else {}))
loader = torch.utils.data.DataLoader(Digits(), batch_sampler=sampler, num_workers=2)

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
        for x, y, indices in loader:
            hooks.step(state, sampler.epoch, sampler.cursor, indices)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
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
