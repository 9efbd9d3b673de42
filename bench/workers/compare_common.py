"""What the three bench.compare workers share: data, model, one training step, the step log.

The same for plain Horovod, elastic_ext and torchrun, so that only the
elastic machinery differs: the UCI digits (1500 training images after
the same hold-out split as examples/pytorch_elastic.py), a 64-64-10 MLP with
Adam (lr 0.01), a global batch of 64 and an emulated compute time per sample
(``--compute-ms-per-sample``, slept before the allreduce: the MLP itself takes
about a millisecond per step).

The step log (``steps-<pid>.jsonl`` under ``--out``) uses the record format
of :mod:`devkit.ledger` for the sample audit, plus records of its own
for timing:

- a *start* record each time training (re)starts: ``start`` (the generation
  id, the same on every rank of one incarnation of the job, increasing),
  the data position it resumes from (``epoch``, ``cursor``: samples of the
  epoch's order already consumed) and ``step`` (steps done);
- a *step* record (ledger format) when the step's samples have gone through
  forward and backward, just before the gradient allreduce: the generation,
  the position the step started from, the step's index and the sample ids
  this rank processed. Written before the collective, because a worker
  killed right after its allreduce has still contributed its samples to a
  step the survivors complete and commit; whether a step counts is decided
  by the positions the next generations resume from, not by this record;
- a *done* record after the optimizer step: ``done`` (the step index),
  ``g`` (generation), ``n`` (samples), ``t``: what timings are taken from;
- a *commit* record (``commit_s``) after each commit or checkpoint save:
  the seconds this rank spent in it;
- a *proc* record when the log opens: ``proc`` (the pid) and ``created``
  (when the process began, before its imports).

The ledger's functions read only start and step records.

``stop_step`` reads the step at which the job ends, written by the driver
into ``<out>/stop``; it is read at commit steps only, so every rank learns it
at the same step (see bench/compare.py).
"""

import argparse
import json
import os
import time

import numpy as np
import torch

from bench.models import mlp

DATASET_SIZE = 1500
LR = 0.01


def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits / checkpoints")
    p.add_argument("--data", required=True, help="the .npz written by bench/compare.py (features, labels)")
    p.add_argument("--compute-ms-per-sample", type=float, default=3.0,
                   help="emulated compute per sample this rank processes, slept before the allreduce")
    p.add_argument("--max-epochs", type=int, default=1000, help="a bound; the driver's stop file ends the job")
    return p


def write_data(path):
    """Saves the 1500 training images (the split of examples/pytorch_elastic.py) for the workers.

    Done once by the driver, so that no worker reads and splits the digits
    when it (re)starts: start-up time is part of what is measured.
    """
    from examples.digits import load_digits
    digits = load_digits()
    train_idx = np.random.default_rng(0).permutation(len(digits.target))[297:]
    assert len(train_idx) == DATASET_SIZE
    np.savez(path, features=(digits.data[train_idx] / 16.0).astype(np.float32),
             labels=digits.target[train_idx].astype(np.int64))


def load_data(path):
    with np.load(path) as data:
        return torch.from_numpy(data["features"]), torch.from_numpy(data["labels"])


def build_model():
    torch.set_num_threads(1)
    model = mlp([64, 64, 10])
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return model, optimizer


def start(args, init):
    """What every worker does before its loop: ``init()`` (its framework's), then the data and the model.

    Returns ``(features, labels, model, optimizer)``.
    """
    init()
    x, y = load_data(args.data)
    model, optimizer = build_model()
    return x, y, model, optimizer


def local_loss(model, x, y, index, real, global_batch):
    """This rank's share of the global mean loss: sum over its real samples / global batch."""
    per_sample = torch.nn.functional.cross_entropy(model(x[index]), y[index], reduction="none")
    return (per_sample * real).sum() / global_batch


def compute(ms_per_sample, samples):
    """The emulated compute of a step (forward and backward of a bigger model), before the allreduce:
    proportional to the samples this rank processes, so a rank that takes a bigger share is slower."""
    if ms_per_sample > 0 and samples:
        time.sleep(ms_per_sample * samples / 1000.0)


def allreduce_gradients(hvd, model, op):
    """Every gradient's allreduce in flight at once, as ``hvd.DistributedOptimizer`` does, then waited for."""
    handles = [hvd.allreduce_async_(param.grad, op=op, name=f"grad.{i}") for i, param in enumerate(model.parameters())]
    for handle in handles:
        hvd.synchronize(handle)


def started_at():
    """Unix time this process began, to 10 ms: its age from /proc (psutil's create_time adds the boot
    time, which the kernel gives in whole seconds, so it can be a second off against time.time())."""
    with open("/proc/uptime", encoding="ascii") as handle:
        uptime = float(handle.read().split()[0])
    with open("/proc/self/stat", encoding="ascii") as handle:
        start_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def manager_allreduce(manager, model):
    """torchft: every gradient in one flat buffer (as DDP's one bucket for these models) through
    ``Manager.allreduce`` (the average over the replica groups taking part; a healing group sends zeros),
    waited for and copied back. On an error the Manager records it and its ``should_commit`` says no."""
    grads = [param.grad for param in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class StepLog:
    """Appends ledger-format records to ``<out>/steps-<pid>.jsonl`` (line-buffered)."""

    def __init__(self, out, system):
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.system = system
        self._file = open(os.path.join(out, f"steps-{os.getpid()}.jsonl"), "a", buffering=1, encoding="utf-8")
        self._stop = None
        # When this process began (before its imports): a replacement worker's start, for "back to full size".
        self._write({"proc": os.getpid(), "created": started_at(), "t": time.time()})

    def start(self, gen, epoch, cursor, step, rank, size):
        self._write({"start": gen, "epoch": int(epoch), "cursor": int(cursor), "step": int(step), "rank": rank,
                     "size": size, "pid": os.getpid(), "t": time.time()})

    def step(self, gen, epoch, cursor, step, rank, size, indices, pads=0):
        self._write({"gen": gen, "epoch": int(epoch), "cursor": int(cursor), "step": int(step), "rank": rank,
                     "size": size, "indices": [int(i) for i in indices], "pads": int(pads), "t": time.time()})

    def done(self, gen, step, rank, size, samples):
        self._write({"done": int(step), "g": gen, "rank": rank, "size": size, "n": int(samples), "t": time.time()})

    def commit(self, step, rank, seconds):
        """A commit (or checkpoint save) that followed step ``step`` took ``seconds`` on this rank."""
        self._write({"commit_s": seconds, "after_step": int(step), "rank": rank, "t": time.time()})

    def commit_point(self, commit, step, rank):
        """Runs ``commit()`` after ``step`` steps and logs its seconds; True once the driver's stop step is
        reached (call at commit steps only, where every rank reads the same stop step)."""
        started = time.perf_counter()
        commit()
        self.commit(step - 1, rank, time.perf_counter() - started)
        stop = self.stop_step()
        return stop is not None and step >= stop

    def stop_step(self):
        """The step the driver asked the job to end at (None until it asks); call at commit steps only."""
        if self._stop is None:
            try:
                with open(os.path.join(self.out, "stop"), encoding="utf-8") as handle:
                    self._stop = int(handle.read().strip())
            except (OSError, ValueError):
                pass
        return self._stop

    def _write(self, record):
        self._file.write(json.dumps(record) + "\n")
