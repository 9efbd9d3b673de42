"""``ReduceLROnPlateau`` on the epoch's training loss, averaged over the ranks with ``hvd.allreduce``.

The PyTorch tutorials' pattern: ``scheduler.step(metric)`` once per epoch.
The metric is the mean of every step's global loss (``hvd.allreduce`` of each
rank's loss, the average of equal shares), accumulated in the State so that
a rollback takes it back with the weights. The scheduler is built on the
wrapped optimizer; it keeps its own best value and bad-epoch count (its
``state_dict``). A demanding threshold makes it cut the learning rate in
most epochs. SGD with momentum, an MLP on the digits, 6 steps per epoch.

Launch::

    elastic-horovodrun -np 4 --min-np 2 --max-np 4 --network-interfaces lo \\
        --host-discovery-script "host_discovery/static.py /tmp/hosts" \\
        python tests/multiprocess/corpus/plateau.py --out /tmp/run

``--reference``: one process, no Horovod, the whole global batch per step.
``--plain``: Horovod's ``hvd.elastic.TorchState`` and ``hvd.elastic.run``.
"""

import _hooks

args = _hooks.arguments(__doc__.split("\n")[0], epochs=4).parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import elastic_ext  # noqa: E402
from elastic_ext.torch import ElasticSampler  # noqa: E402

torch.set_num_threads(1)
if not args.reference:
    hvd.init()
hooks = _hooks.Hooks(args, *(() if args.reference else (hvd.rank, hvd.size)))

X, Y = map(torch.from_numpy, _hooks.digits(360, args.seed))
steps_per_epoch = len(X) // args.global_batch
total_steps = args.epochs * steps_per_epoch

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0,
                                                       threshold=0.5)
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=args.seed + 1,
                         **(_hooks.one_process() if args.reference else {}))

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0, epoch_loss=0.0), (lambda fn: fn)
elif args.plain:
    import horovod.torch.elastic.state as hvd_state
    _hooks.plain_handlers(hvd_state, ElasticSampler, torch.optim.lr_scheduler.LRScheduler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                                   epoch=0, step=0, epoch_loss=0.0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                              epoch=0, step=0, epoch_loss=0.0)
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
            optimizer.step()
            global_loss = loss.detach() if args.reference else hvd.allreduce(loss.detach(), name="loss")
            state.epoch_loss += global_loss.item()
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=global_loss.item(), lr=optimizer.param_groups[0]["lr"])
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        scheduler.step(state.epoch_loss / steps_per_epoch)
        state.epoch += 1
        state.epoch_loss = 0.0
        state.commit()


train(state)
hooks.finish(state, arrays)
