"""bench.compare worker, elastic_ext: elastic_ext.State + @elastic_ext.run + its ElasticSampler.

The loop of examples/pytorch_elastic.py: commit every ``--commit-every``
steps and at the end of each epoch, constant global batch. Launched by
bench/compare.py under ``horovodrun`` (see there for the command).

``BENCH_FLIP_AT=STEP`` (bench.replica_check's flip arm): rank 1 flips one
bit of its first layer's weight before that step's forward pass, once per job.
"""

import os

import numpy as np
import torch

import horovod.torch as hvd

import elastic_ext
from bench.workers import compare_common as common
from devkit.faults import FaultSchedule
from elastic_ext.torch import ElasticSampler

args = common.parser(__doc__.splitlines()[0]).parse_args()
x, y, model, optimizer = common.start(args, hvd.init)
sampler = ElasticSampler(common.DATASET_SIZE, global_batch_size=args.global_batch, seed=1, policy="pad")
state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
log = common.StepLog(args.out, "ext")
flips = FaultSchedule.parse(f"1:{os.environ['BENCH_FLIP_AT']}:flip:step:param" if os.environ.get("BENCH_FLIP_AT")
                            else "", os.path.join(args.out, "faults"))


@elastic_ext.run
def train(state):
    log.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.max_epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in sampler.batches():
            first_weight = next(model.parameters())
            flips.maybe_fire(hvd.rank(), state.step, where="step", targets={"param": first_weight.detach().numpy()})
            epoch, cursor = sampler.epoch, sampler.cursor
            index = torch.from_numpy(indices.astype(np.int64))
            loss = common.local_loss(model, x, y, index, torch.from_numpy(~pad), args.global_batch)
            optimizer.zero_grad()
            loss.backward()
            common.compute(args.compute_ms_per_sample, int((~pad).sum()))
            log.step(state.generation, epoch, cursor, state.step, hvd.rank(), hvd.size(), indices[~pad],
                     int(pad.sum()))
            common.allreduce_gradients(hvd, model, hvd.Sum)
            optimizer.step()
            sampler.record_step()
            state.step += 1
            log.done(state.generation, state.step - 1, hvd.rank(), hvd.size(), int((~pad).sum()))
            end_of_epoch = sampler.epoch_done
            if end_of_epoch:
                state.epoch += 1
            if (end_of_epoch or state.step % args.commit_every == 0) \
                    and log.commit_point(state.commit, state.step, hvd.rank()):
                return


train(state)
