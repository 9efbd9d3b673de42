"""CPU autocast to bfloat16 with ``torch.amp.GradScaler``, the reduced gradients unscaled before the step.

PyTorch's AMP recipe on a Horovod job (Horovod's documented order)::

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ...
    scaler.scale(loss).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()

The scaler's scale and growth tracker are in the State. An MLP on the
digits, AdamW, a ``LinearLR`` warmup built after the wrapper. bfloat16 needs
no loss scaling (its range is float32's); the scaler runs all the same, as
in scripts written for float16 and moved to bfloat16.

``--reference``: one process, no Horovod, the whole global batch per step
under the same autocast (weights and optimizer in float32).
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
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=6)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=5)
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=args.seed + 1,
                         **(_hooks.one_process() if args.reference else {}))

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0), (lambda fn: fn)
elif args.plain:
    import horovod.torch.elastic.state as hvd_state
    _hooks.plain_handlers(hvd_state, ElasticSampler, torch.optim.lr_scheduler.LRScheduler,
                          torch.amp.GradScaler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                   sampler=sampler, epoch=0, step=0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                              sampler=sampler, epoch=0, step=0)
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
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(X[indices]), Y[indices])
            scaler.scale(loss).backward()
            if args.reference:
                scaler.step(optimizer)
            else:
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=loss.item(), lr=optimizer.param_groups[0]["lr"], scale=scaler.get_scale())
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
