"""The learning rate scaled by ``hvd.size()`` in a reset callback (Horovod's elastic guide), through a
grow and a shrink.

Horovod's documented pattern for a job whose size changes: each rank keeps
its own batch size (the global batch follows the world size) and the
learning rate is ``base_lr * hvd.size()``, set at the start and again by a
reset callback after every resize::

    def on_state_reset():
        for param_group in optimizer.param_groups:
            param_group["lr"] = base_lr * hvd.size()

    state.register_reset_callbacks([on_state_reset])

Every rank, survivor or newcomer, must then train at the new size's rate.
SGD with momentum, an MLP on the digits, 15 samples per rank per step (the
epoch's last step padded: every sample once per epoch at any world size).

The reference (``--reference``) depends on the world size: it follows the
per-step world sizes the elastic run went through (``--sizes``, a JSON file
``{step: size}`` that the test reads from the run's sample ledger): at step
``k`` it trains on ``15 * size_k`` samples at ``base_lr * size_k``, one
process, no Horovod. Without ``--sizes`` it trains as a world of 1.
"""

import _hooks

parser = _hooks.arguments(__doc__.split("\n")[0])
parser.add_argument("--batch-size", type=int, default=15, help="samples per rank per step")
parser.add_argument("--base-lr", type=float, default=0.02)
args = parser.parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import elastic_ext  # noqa: E402
from elastic_ext.torch import ElasticSampler  # noqa: E402

torch.set_num_threads(1)
if not args.reference:
    hvd.init()
hooks = _hooks.Hooks(args, *(() if args.reference else (hvd.rank, hvd.size)))
size = hvd.size if not args.reference else (lambda: hooks.world_size_at(state.step))

X, Y = map(torch.from_numpy, _hooks.digits(720, args.seed))

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * (1 if args.reference else hvd.size()),
                            momentum=0.9)
if not args.reference:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = ElasticSampler(len(X), batch_size=args.batch_size, seed=args.seed + 1, policy="pad",
                         **(_hooks.one_process() if args.reference else {}))

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0), (lambda fn: fn)
elif args.plain:
    import horovod.torch.elastic.state as hvd_state
    _hooks.plain_handlers(hvd_state, ElasticSampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
    run = elastic_ext.run


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.base_lr * hvd.size()


state.register_reset_callbacks([on_state_reset])


def arrays():
    return _hooks.torch_arrays(model, optimizer)


def follow_the_world_size():
    """Reference only: this step's global batch and learning rate are those of the elastic run's world."""
    sampler.batch_size = args.batch_size * size()
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.base_lr * size()


@run
def train(state):
    hooks.started(state, sampler.epoch, sampler.cursor)
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        if args.reference:
            follow_the_world_size()
        while not sampler.epoch_done:
            for indices, pad in sampler.batches():
                hooks.step(state, sampler.epoch, sampler.cursor, indices[~pad])
                optimizer.zero_grad()
                # The epoch's last step is padded: pads weigh nothing, the divisor stays the batch size.
                keep = torch.from_numpy(~pad).float()
                losses = F.cross_entropy(model(X[indices]), Y[indices], reduction="none")
                loss = (losses * keep).sum() / len(indices)
                loss.backward()
                optimizer.step()
                sampler.record_step()
                state.step += 1
                hooks.trace(state, loss=loss.item(), lr=optimizer.param_groups[0]["lr"])
                if state.step % args.commit_every == 0:
                    hooks.before_commit(state)
                    state.commit()
                    hooks.committed(state, arrays)
                if args.reference and sampler.batch_size != args.batch_size * size():
                    follow_the_world_size()
                    break  # plan the epoch's rest with the new global batch
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
