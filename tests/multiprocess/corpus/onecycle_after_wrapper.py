"""``OneCycleLR`` built AFTER ``hvd.DistributedOptimizer``, on SGD with Nesterov momentum.

The order Horovod's examples use: wrap the optimizer, then attach the
scheduler to the wrapper. OneCycleLR also cycles the momentum, so it writes
two entries of each param group per step. An MLP with LayerNorm on the
digits (not BatchNorm: per-rank batch statistics are other math than the
one-process run's), a commit every 4 steps.

Launch::

    elastic-horovodrun -np 4 --min-np 2 --max-np 4 --network-interfaces lo \\
        --host-discovery-script "host_discovery/static.py /tmp/hosts" \\
        python tests/multiprocess/corpus/onecycle_after_wrapper.py --out /tmp/run

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
model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48), torch.nn.ReLU(),
                            torch.nn.Linear(48, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=total_steps)
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
            optimizer.step()
            scheduler.step()
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=loss.item(), lr=optimizer.param_groups[0]["lr"],
                        momentum=optimizer.param_groups[0]["momentum"])
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
