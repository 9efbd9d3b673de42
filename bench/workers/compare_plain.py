"""bench.compare worker, plain Horovod elastic: hvd.elastic.TorchState + @hvd.elastic.run + Horovod's ElasticSampler.

Written the way Horovod's elastic examples are: the sampler is part of the
state, ``record_batch`` after every step, ``set_epoch`` at the end of the
epoch, commit every ``--commit-every`` steps and at the end of each epoch.
The per-rank batch is global batch / world size at start (16 on 4 workers);
Horovod's sampler has no notion of a global batch, so after a shrink the
global batch shrinks with the world while the job runs on the survivors.
Loss and gradients as in Horovod's examples: each rank's mean, averaged by
the allreduce (all gradients in flight at once, as hvd.DistributedOptimizer
does).
"""

import time

import torch

import horovod.torch as hvd

from bench.workers import compare_common as common

args = common.parser(__doc__.splitlines()[0]).parse_args()
x, y, model, optimizer = common.start(args, hvd.init)
batch = args.global_batch // hvd.size()
sampler = hvd.elastic.ElasticSampler(range(common.DATASET_SIZE), shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(range(common.DATASET_SIZE), batch_size=batch, sampler=sampler)
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
log = common.StepLog(args.out, "plain")


@hvd.elastic.run
def train(state):
    # A generation id that every rank of this incarnation agrees on (Horovod has none).
    gen = hvd.broadcast_object(time.time_ns(), root_rank=0, name="compare.gen")
    log.start(gen, sampler.epoch, sampler.processed_num, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.max_epochs:
        steps_in_epoch = len(loader)
        for batch_idx, index in enumerate(loader):
            epoch, cursor = sampler.epoch, sampler.processed_num
            loss = torch.nn.functional.cross_entropy(model(x[index]), y[index])  # this rank's mean
            optimizer.zero_grad()
            loss.backward()
            common.compute(args.compute_ms_per_sample, len(index))
            log.step(gen, epoch, cursor, state.step, hvd.rank(), hvd.size(), index.tolist())
            common.allreduce_gradients(hvd, model, hvd.Average)
            optimizer.step()
            sampler.record_batch(batch_idx, batch)
            state.step += 1
            log.done(gen, state.step - 1, hvd.rank(), hvd.size(), len(index))
            end_of_epoch = batch_idx == steps_in_epoch - 1
            if end_of_epoch:
                state.epoch += 1
                sampler.set_epoch(state.epoch)
            if (end_of_epoch or state.step % args.commit_every == 0) \
                    and log.commit_point(state.commit, state.step, hvd.rank()):
                return


train(state)
