"""Test worker for Horovod's elastic scenarios, with elastic_ext's State and run.

Two flavours of the same job (--flavour): a PyTorch loop, and Keras 3
``model.fit`` with ``ElasticCallback``. Each trains --epochs epochs of
--batches batches on digits, commits every --commit-every batches and at
every epoch end, and rank 0 appends one JSON line per finished epoch to
--logfile: epoch, rank, start_rank (the rank this process had at its start),
size, hostname and the State's generation (+1 per reset). The discovery
script (schedule_discovery.py) reads the number of lines of that file to
pick the hosts, as in Horovod's own integration tests.

--exit-schedule '{"EPOCH,BATCH": [RANKS]}' makes those ranks fail at the
start of that batch the first time they reach it, in whatever generation
(the ranks are those of the original world, as in Horovod's tests; newcomers
never fail): --exit-mode exception raises an error (the worker exits 1),
kill SIGKILLs itself. The sample ledger goes to --out.
"""

import argparse
import json
import os
import signal
import time

p = argparse.ArgumentParser()
p.add_argument("--flavour", choices=["torch", "keras"], required=True)
p.add_argument("--logfile", required=True)
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batches", type=int, default=6, help="global steps per epoch")
p.add_argument("--commit-every", type=int, default=2)
p.add_argument("--exit-schedule", default="{}")
p.add_argument("--exit-mode", choices=["exception", "kill"], default="exception")
p.add_argument("--notice-after", default="",
               help="EPOCH[:SIZE],...: after those epochs rank 0 waits (up to 60 s) for Horovod's notice of a host "
                    "change, unless the job already has SIZE workers: the change the discovery script makes once "
                    "the epoch is logged, or a blacklisted host back after its cooldown")
args = p.parse_args()

import numpy as np  # noqa: E402
from examples.digits import load_digits  # noqa: E402

import elastic_ext  # noqa: E402
from devkit.ledger import Ledger  # noqa: E402

GLOBAL_BATCH = 32
digits = load_digits()
SIZE = args.batches * GLOBAL_BATCH
features = (digits.data[:SIZE] / 16.0).astype(np.float32)
labels = digits.target[:SIZE].astype(np.int64)
exits = {tuple(int(x) for x in key.split(",")): set(ranks) for key, ranks in json.loads(args.exit_schedule).items()}
book = Ledger(args.out)
hostname = os.environ.get("HOROVOD_HOSTNAME", "?")

if args.flavour == "torch":
    import torch
    import horovod.torch as hvd
    from elastic_ext.torch import ElasticSampler
    torch.set_num_threads(1)
else:
    import tensorflow as tf
    import keras
    import horovod.tensorflow as hvd
    import elastic_ext.tensorflow as etf
    from elastic_ext.tensorflow import ElasticSampler
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)

hvd.init()
start_rank = hvd.rank()
notice_after = {int(e): int(size or 1 << 30) for e, _, size in (spec.partition(":") for spec in
                                                                 args.notice_after.split(",") if spec)}
origin = []  # (generation, rank) at this process's first batch


def maybe_exit(state, epoch, batch):
    """Fails here if the schedule says so for this process's rank in the original world.

    A listed process fails the first time it reaches the batch, in whatever
    generation: a peer's earlier failure can roll it back before it gets
    there, and it must still fail when it replays the batch. A newcomer (a
    process whose first batch is after generation 1) never fails."""
    if not origin:
        origin.append((state.generation, hvd.rank()))
    first_generation, rank = origin[0]
    if first_generation != 1 or rank not in exits.get((epoch, batch), ()):
        return
    if args.exit_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"scheduled exit of rank {rank} at epoch {epoch} batch {batch}")


def log_epoch(state, epoch):
    if hvd.rank() == 0:
        with open(args.logfile, "a") as handle:
            handle.write(json.dumps({"epoch": epoch, "rank": hvd.rank(), "start_rank": start_rank,
                                     "size": hvd.size(), "hostname": hostname,
                                     "generation": state.generation}) + "\n")
    if hvd.rank() == 0 and epoch in notice_after and hvd.size() < notice_after[epoch]:
        deadline = time.monotonic() + 60
        while not state.host_update_pending() and time.monotonic() < deadline:
            time.sleep(0.05)


def record(state, epoch, cursor, indices, pad):
    book.step(state.generation, epoch, cursor, state.step, hvd.rank(), hvd.size(), indices[~pad], int(pad.sum()))


sampler = ElasticSampler(SIZE, global_batch_size=GLOBAL_BATCH, seed=1, policy="drop")

if args.flavour == "torch":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    X, Y = torch.from_numpy(features), torch.from_numpy(labels)
    state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0, step=0)

    @elastic_ext.run
    def train(state):
        book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)
            for indices in sampler:
                maybe_exit(state, state.epoch, state.batch)
                record(state, sampler.epoch, sampler.cursor, np.asarray(indices), np.zeros(len(indices), bool))
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(X[indices]), Y[indices]).backward()
                optimizer.step()
                sampler.record_step()
                state.batch += 1
                state.step += 1
                if state.batch % args.commit_every == 0:
                    state.commit()
            log_epoch(state, state.epoch)
            state.epoch += 1
            state.batch = 0
            state.commit()

else:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=etf.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    X, Y = tf.constant(features), tf.constant(labels)
    state = elastic_ext.State(model=model, optimizer=model.optimizer, sampler=sampler, epoch=0, batch=0, step=0)

    class Scenario(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            maybe_exit(state, state.epoch, state.batch)

        def on_epoch_end(self, epoch, logs=None):
            log_epoch(state, epoch)

    elastic = etf.ElasticCallback(
        state, lambda indices, pad: (tf.gather(X, indices), tf.gather(Y, indices)),
        commit_every=args.commit_every, on_step=lambda s: record(state, s.epoch, s.cursor, s.indices, s.pad))

    @elastic_ext.run
    def train(state):
        book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
        elastic.fit(model, epochs=args.epochs, callbacks=[Scenario()], verbose=0)

train(state)
book.end(state.step, hvd.rank(), hvd.size())
