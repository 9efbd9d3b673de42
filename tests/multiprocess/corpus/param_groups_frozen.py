"""Parameter groups with their own learning rate and weight decay, and frozen parameters.

The fine-tuning pattern of the PyTorch tutorials: a pretrained-looking
embedding layer is frozen (``requires_grad_(False)``: no gradient, no hook,
not in the optimizer), the body trains at a base rate with weight decay, the
head at ten times the rate, and biases and norms without weight decay::

    optimizer = torch.optim.AdamW([
        {"params": body_decay, "weight_decay": 0.05},
        {"params": body_no_decay, "weight_decay": 0.0},
        {"params": head, "lr": 10 * base_lr},
    ], lr=base_lr)

A ``LambdaLR`` with one function per group, built after the wrapper, scales
each group from its own base rate. The frozen layer is in the State as
part of the model.

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
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(),          # frozen "stem"
                            torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 10))
for param in model[0].parameters():
    param.requires_grad_(False)
body = [p for p in model[2:5].parameters()]
body_decay = [p for p in body if p.dim() > 1]
body_no_decay = [p for p in body if p.dim() <= 1]
base_lr = 2e-3
optimizer = torch.optim.AdamW([
    {"params": body_decay, "weight_decay": 0.05},
    {"params": body_no_decay, "weight_decay": 0.0},
    {"params": list(model[5].parameters()), "lr": 10 * base_lr, "weight_decay": 0.01},
], lr=base_lr)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0, lambda s: 1.0,
                                                          lambda s: 1.0 / (1.0 + 0.1 * s)])
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
                        head_lr=optimizer.param_groups[2]["lr"])
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
