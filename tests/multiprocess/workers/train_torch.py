"""Test worker: elastic (or plain) PyTorch training on the UCI digits.

Writes, under --out: steps-<pid>.jsonl (every step: generation, epoch,
cursor, rank, size, sample indices), final-<rank>.npz (weights, optimizer
state and the table at the end), and recovery events (ELASTIC_EXT_EVENTS_PATH).
Faults come from --faults "RANK:STEP:HOW[:WHERE]" (WHERE: step, allreduce,
commit) and fire once each.
"""

import argparse
import json
import os
import time

import numpy as np
import torch
from examples.digits import load_digits

import horovod.torch as hvd

import elastic_ext
from devkit.ledger import Ledger
from devkit.faults import CommitFaultProbe, FaultSchedule, HostFileSchedule
from elastic_ext.torch import ElasticSampler

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["elastic", "plain"], default="elastic")
p.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--faults", default="")
p.add_argument("--step-sleep-s", type=float, default=0.0)
p.add_argument("--sleep-below", type=int, default=0,
               help="SIZE: --step-sleep-s only while the world has fewer than SIZE workers (0: always)")
p.add_argument("--slow", default="", help="RANK:FROM:TO:FACTOR slows one rank's steps")
p.add_argument("--resize-at", default="", help="STEP:HOSTFILE:HOST,HOST[;...] (see devkit.faults.HostFileSchedule)")
args = p.parse_args()

torch.set_num_threads(1)
hvd.init()
faults = FaultSchedule.parse(args.faults, os.path.join(args.out, "faults"))
resizes = HostFileSchedule(args.resize_at)

digits = load_digits()
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
Y = torch.tensor(digits.target, dtype=torch.int64)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
if args.optimizer == "adam":
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
elif args.optimizer == "adamw":
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=1, policy="pad")
book = Ledger(args.out)
# 2 MiB the State restores on its background thread after a failed collective (elastic_ext.state.restore):
# each step adds to one slot, so a replayed step whose table was not restored shows in the final table.
table = torch.zeros(1 << 19)


commit_probe = CommitFaultProbe(faults, hvd.rank)


def allreduce_gradients(step):
    handles = [hvd.allreduce_async_(p.grad, name=f"grad.{i}", op=hvd.Sum) for i, p in enumerate(model.parameters())]
    faults.maybe_fire(hvd.rank(), step, where="allreduce")  # a collective is in flight here
    for handle in handles:
        hvd.synchronize(handle)


def train_step(state, indices, pad):
    keep = torch.tensor(~pad)
    x, y = X[torch.from_numpy(indices.astype(np.int64))], Y[torch.from_numpy(indices.astype(np.int64))]
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    # Sum over this rank's real samples / global batch, summed over ranks:
    # the global mean whatever the world size.
    loss = (losses * keep).sum() / args.global_batch
    optimizer.zero_grad()
    loss.backward()
    allreduce_gradients(state.step)
    optimizer.step()
    table[(state.step * 4099) % table.numel()] += 1.0


def maybe_resize(state):
    resizes.maybe_apply(state, hvd.rank(), state.step)


def slow_factor(state):
    if not args.slow:
        return 1.0
    rank, start, stop, factor = args.slow.split(":")
    return float(factor) if hvd.rank() == int(rank) and int(start) <= state.step < int(stop) else 1.0


def train(state):
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in sampler.batches():
            faults.maybe_fire(hvd.rank(), state.step, where="step")
            book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(),
                      indices[~pad], int(pad.sum()))
            train_step(state, indices, pad)
            if args.step_sleep_s and (not args.sleep_below or hvd.size() < args.sleep_below):
                time.sleep(args.step_sleep_s * slow_factor(state))
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                commit_probe.step = state.step
                maybe_resize(state)
                state.commit()
                commit_probe.step = None
        state.epoch += 1
    state.commit()


def save_final():
    arrays = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
    arrays["table"] = table.numpy()
    for pid, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            arrays[f"opt/{pid}/{k}"] = v.numpy() if torch.is_tensor(v) else np.asarray(v)
    np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **arrays)
    with open(os.path.join(args.out, f"final-{hvd.rank()}.json"), "w") as handle:
        json.dump({"step": state_step[0], "size": hvd.size(), "epoch": sampler.epoch}, handle)


state_step = [0]
if args.mode == "elastic":
    state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0, table=table,
                              commit_probe=commit_probe, adapters=[commit_probe])
    elastic_ext.run(train)(state)
    state_step[0] = state.step
else:
    # The same training without elastic: what a user would write with plain Horovod.
    class Plain:
        epoch, step, generation = 0, 0, 1

        def commit(self):
            pass

        def host_update_pending(self):
            return False
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    plain = Plain()
    train(plain)
    state_step[0] = plain.step
save_final()
book.end(state_step[0], hvd.rank(), hvd.size())
