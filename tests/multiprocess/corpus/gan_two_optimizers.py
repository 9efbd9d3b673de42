"""Two models with two optimizers, GAN-style: a generator and a discriminator, each with its own
``hvd.DistributedOptimizer``.

The DCGAN tutorial's loop on the digits, with MLPs: the discriminator's
step on real images and detached fakes, then the generator's step through a
discriminator whose parameters are switched off (``requires_grad_(False)``,
so its gradient hooks do not fire during the generator's backward, which
Horovod requires). Each optimizer is wrapped with its own parameter names;
both models, both optimizers and a ``StepLR`` per optimizer are in the State.
The latent vector of each sample is fixed (a table indexed by sample), so
the reference draws the same ones.

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
LATENT = 8
Z = torch.randn(len(X), LATENT, generator=torch.Generator().manual_seed(args.seed + 7))
generator = torch.nn.Sequential(torch.nn.Linear(LATENT, 32), torch.nn.ReLU(), torch.nn.Linear(32, 64),
                                torch.nn.Sigmoid())
discriminator = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999))
if not args.reference:
    opt_g = hvd.DistributedOptimizer(opt_g, named_parameters=generator.named_parameters(prefix="generator"))
    opt_d = hvd.DistributedOptimizer(opt_d, named_parameters=discriminator.named_parameters(prefix="discriminator"))
sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=10, gamma=0.5)
sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=10, gamma=0.5)
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=args.seed + 1,
                         **(_hooks.one_process() if args.reference else {}))

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0), (lambda fn: fn)
elif args.plain:
    import horovod.torch.elastic.state as hvd_state
    _hooks.plain_handlers(hvd_state, ElasticSampler, torch.optim.lr_scheduler.LRScheduler)
    state = hvd.elastic.TorchState(generator=generator, discriminator=discriminator, opt_g=opt_g, opt_d=opt_d,
                                   sched_g=sched_g, sched_d=sched_d, sampler=sampler, epoch=0, step=0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(generator=generator, discriminator=discriminator, opt_g=opt_g, opt_d=opt_d,
                              sched_g=sched_g, sched_d=sched_d, sampler=sampler, epoch=0, step=0)
    run = elastic_ext.run


def arrays():
    return {**_hooks.torch_arrays(generator, opt_g, prefix="g_"),
            **_hooks.torch_arrays(discriminator, opt_d, prefix="d_")}


@run
def train(state):
    hooks.started(state, sampler.epoch, sampler.cursor)
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, _ in sampler.batches():
            hooks.step(state, sampler.epoch, sampler.cursor, indices)
            real, z = X[indices], Z[indices]
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            opt_d.zero_grad()
            fake = generator(z)
            loss_d = F.binary_cross_entropy_with_logits(discriminator(real), ones) + \
                F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros)
            loss_d.backward()
            opt_d.step()
            discriminator.requires_grad_(False)
            opt_g.zero_grad()
            loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
            loss.backward()
            opt_g.step()
            discriminator.requires_grad_(True)
            sched_g.step()
            sched_d.step()
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=loss.item(), loss_d=loss_d.item(), lr=opt_g.param_groups[0]["lr"])
            if state.step % args.commit_every == 0:
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        state.commit()


train(state)
hooks.finish(state, arrays)
