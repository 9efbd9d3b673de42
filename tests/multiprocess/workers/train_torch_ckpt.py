"""Test worker: elastic PyTorch training on the UCI digits with durable checkpoints.

The checkpoint settings come from ELASTIC_EXT_CHECKPOINT_* variables; a fresh
job resumes from the newest valid checkpoint there. Writes, under --out:
steps-<pid>.jsonl (the ledger: every step's generation, epoch, cursor and
sample indices), final-<rank>.npz (weights and optimizer state at the end)
and final-<rank>.json. --stop-after-commit K ends the job cleanly at commit K,
which ``run`` writes as a checkpoint before it returns (the first half of a
reference run).
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
from elastic_ext.torch import ElasticSampler

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--step-sleep-s", type=float, default=0.0)
p.add_argument("--stop-after-commit", type=int, default=-1)
args = p.parse_args()

torch.set_num_threads(1)
hvd.init()

digits = load_digits()
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
Y = torch.tensor(digits.target, dtype=torch.int64)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
sampler = ElasticSampler(len(X), global_batch_size=args.global_batch, seed=1, policy="pad")
book = Ledger(args.out)


def train_step(indices, pad):
    keep = torch.tensor(~pad)
    rows = torch.from_numpy(indices.astype(np.int64))
    losses = torch.nn.functional.cross_entropy(model(X[rows]), Y[rows], reduction="none")
    loss = (losses * keep).sum() / args.global_batch  # the global mean whatever the world size
    optimizer.zero_grad()
    loss.backward()
    handles = [hvd.allreduce_async_(p.grad, name=f"grad.{i}", op=hvd.Sum) for i, p in enumerate(model.parameters())]
    for handle in handles:
        hvd.synchronize(handle)
    optimizer.step()


def stop_here(state):
    """Every rank ends training at this commit (run then writes it as a checkpoint, whatever the cadence)."""
    return state.commit_id == args.stop_after_commit


def train(state):
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in sampler.batches():
            book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(),
                      indices[~pad], int(pad.sum()))
            train_step(indices, pad)
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
                if stop_here(state):
                    return "stopped"
        state.epoch += 1
    state.commit()
    return "finished"


state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
outcome = elastic_ext.run(train)(state)
if outcome == "finished":
    arrays = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
    for pid, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            arrays[f"opt/{pid}/{k}"] = v.numpy() if torch.is_tensor(v) else np.asarray(v)
    np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **arrays)
    with open(os.path.join(args.out, f"final-{hvd.rank()}.json"), "w") as handle:
        json.dump({"step": state.step, "size": hvd.size(), "epoch": sampler.epoch, "commit_id": state.commit_id},
                  handle)
book.end(state.step, hvd.rank(), hvd.size())
