"""Elastic PyTorch training on handwritten digits with elastic_ext.

Launch (two pseudo-hosts on one machine; host_discovery/static.py re-reads
the host file every second, so editing it grows or shrinks the job)::

    printf 'localhost:2\\n127.0.0.1:2\\n' > /tmp/hosts
    elastic-horovodrun -np 4 --min-np 2 --max-np 6 --network-interfaces lo \\
        --host-discovery-script "host_discovery/static.py /tmp/hosts" \\
        python examples/pytorch_elastic.py --epochs 6

On a Slurm allocation use ``--host-discovery-script host_discovery/slurm.py``.
``examples/run_demo.py`` runs this with a scheduled failure and a scale-up,
watched from outside the script (``devkit/watched.py``: the fault, the
sample ledger); the script itself carries no hook for it.

What happens on failures: every ``--commit-every`` steps the state (model,
optimizer, sampler position, epoch, step) is committed to host memory. If a
worker dies, the others' allreduce fails, they roll back to the last commit,
Horovod re-forms the job on the healthy hosts, and training continues; the
samples of the lost steps are processed again, exactly once. When hosts are
added, the job grows at the next commit, without a rollback.
"""

import argparse
import logging

import elastic_ext

import numpy as np
import torch
from digits import load_digits

import horovod.torch as hvd

from elastic_ext.torch import ElasticSampler

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--global-batch", type=int, default=64, help="kept constant whatever the world size")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--commit-every", type=int, default=5, help="steps between commits")
args = parser.parse_args()

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
torch.set_num_threads(1)
hvd.init()


def say(message):
    if hvd.rank() == 0:
        print(message, flush=True)


# The data: 1797 8x8 digit images, in digits.npz beside this script (no download).
digits = load_digits()
features = torch.tensor(digits.data / 16.0, dtype=torch.float32)
labels = torch.tensor(digits.target, dtype=torch.int64)
rng = np.random.default_rng(0)
holdout = rng.permutation(len(labels))
test_idx, train_idx = holdout[:297], holdout[297:]
train_x, train_y = features[train_idx], labels[train_idx]
test_x, test_y = features[test_idx], labels[test_idx]

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
sampler = ElasticSampler(len(train_y), global_batch_size=args.global_batch, seed=1, policy="pad")
state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)


def on_reset():
    say(f"[elastic] reset: the job now has {hvd.size()} workers")


state.register_reset_callbacks([on_reset])


def evaluate():
    with torch.no_grad():
        return (model(test_x).argmax(1) == test_y).float().mean().item()


@elastic_ext.run
def train(state):
    last = state.events.history[-1] if state.events.history else None
    if last is not None and last["event"] == "recovered":
        say(f"[elastic] recovered from {last['cause']} in {last['recovery_s']:.1f}s, "
            f"{last['steps_rolled_back']} steps rolled back, resuming at step {state.step}")
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        losses = []
        for indices, pad in sampler.batches():
            index = torch.from_numpy(indices.astype(np.int64))
            per_sample = torch.nn.functional.cross_entropy(model(train_x[index]), train_y[index], reduction="none")
            # Sum over real samples / global batch, summed over ranks = the mean
            # over the global batch, whatever the number of workers.
            loss = (per_sample * torch.from_numpy(~pad)).sum() / args.global_batch
            optimizer.zero_grad()
            loss.backward()
            for i, param in enumerate(model.parameters()):
                hvd.allreduce_(param.grad, op=hvd.Sum, name=f"grad.{i}")
            optimizer.step()
            losses.append(loss.item() * args.global_batch / max(1, int((~pad).sum())))
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
        state.epoch += 1
        state.commit()
        # No step here when the job re-formed at the epoch's last commit: nothing was trained since.
        trained = f"loss {np.mean(losses):.4f}" if losses else "no step since the job re-formed"
        say(f"epoch {state.epoch - 1}: {trained}  "
            f"test accuracy {evaluate():.3f}  workers {hvd.size()}  step {state.step}")
    return evaluate()


accuracy = train(state)
say(f"done: test accuracy {accuracy:.3f} after {state.step} steps on {hvd.size()} workers")
