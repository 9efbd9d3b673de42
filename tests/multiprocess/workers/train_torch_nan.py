"""Test worker: elastic PyTorch training with the numeric guard; one rank's loss turns NaN once.

A small network with BatchNorm and dropout on the UCI digits, Horovod's
DistributedOptimizer, ``state.guard_step`` between ``optimizer.synchronize()``
and ``optimizer.step()``. At global step --nan-step, rank --nan-rank poisons
its input batch with a NaN (the loss, its BatchNorm statistics and, through
the allreduce, every rank's gradients go non-finite) the first time only.
Writes under --out: the ledger (steps, and a ``skipped`` record per skipped
range), final-<rank>.npz (parameters and optimizer state; BatchNorm running
statistics are per-rank buffers and left out) and the events
(ELASTIC_EXT_EVENTS_PATH).
"""

import argparse
import os

import numpy as np
import torch
from examples.digits import load_digits

import horovod.torch as hvd

import elastic_ext
from devkit.ledger import Ledger
from elastic_ext.torch import ElasticSampler

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--nan-step", type=int, required=True)
p.add_argument("--nan-rank", type=int, required=True)
p.add_argument("--samples", type=int, default=1792, help="digits used (1792 = 28 steps of 64, no remainder)")
args = p.parse_args()

torch.set_num_threads(1)
hvd.init()
if hvd.rank() == 0:
    print(f"elastic_ext from {elastic_ext.__file__}", flush=True)

digits = load_digits()
X = torch.tensor(digits.data[:args.samples] / 16.0, dtype=torch.float32)
Y = torch.tensor(digits.target[:args.samples], dtype=torch.int64)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.BatchNorm1d(48), torch.nn.ReLU(),
                            torch.nn.Dropout(0.2), torch.nn.Linear(48, 10))
optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=1, policy="drop")
book = Ledger(args.out)
fired = []


def train_step(state, indices):
    x, y = X[torch.from_numpy(indices.astype(np.int64))], Y[torch.from_numpy(indices.astype(np.int64))]
    if hvd.rank() == args.nan_rank and state.step == args.nan_step and not fired:
        fired.append(state.step)
        x = x.clone()
        x[0, 0] = float("nan")  # one poisoned sample on one rank
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.synchronize()
    state.guard_step(loss, model.parameters(), samples=len(indices))  # raises on every rank together
    with optimizer.skip_synchronize():
        optimizer.step()


def train(state):
    book.skipped_by_rollbacks(state.events.history, sampler, hvd.rank())
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in sampler.batches():
            book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(),
                      indices[~pad], int(pad.sum()))
            train_step(state, indices[~pad])
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
        state.epoch += 1
    state.commit()


state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                          guard=elastic_ext.NumericGuard())
elastic_ext.run(train)(state)
arrays = {f"param/{k}": v.detach().numpy() for k, v in model.named_parameters()}
for pid, st in optimizer.state_dict()["state"].items():
    for k, v in st.items():
        arrays[f"opt/{pid}/{k}"] = v.numpy() if torch.is_tensor(v) else np.asarray(v)
np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **arrays)
book.end(state.step, hvd.rank(), hvd.size())
