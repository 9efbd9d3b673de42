"""Worker for the plain-Horovod side of bench/horovod_scenarios.py: the job of
scenario_train.py with Horovod's own elastic state and decorator instead of
elastic_ext's (the baseline, never a test of elastic_ext).

Flavours (--flavour): ``torch`` (``hvd.elastic.TorchState``,
``hvd.DistributedOptimizer``), ``tf`` (``hvd.elastic.TensorFlowKerasState``,
``hvd.DistributedGradientTape``) and ``keras`` (``hvd.elastic.KerasState``
with Horovod's Commit/UpdateBatch/UpdateEpoch callbacks around
``model.fit``); --keras 2 runs the TF flavours on tf_keras
(TF_USE_LEGACY_KERAS=1). Same flags and epoch log as scenario_train.py:
rank 0 appends epoch, start_rank, size, hostname and generation (1 + the
resets this process went through) to --logfile, which
schedule_discovery.py reads.

Two differences from scenario_train.py, both so that the script is correct
under Horovod's own semantics rather than failing for our bookkeeping:
- resets are counted per process, not in the state: Horovod's
  ``ObjectState.sync`` broadcasts the committed values and sets them again
  after the reset callbacks ran, so a counter a callback bumps in the state
  is back at its committed value when training resumes. Rank 0 is always a
  survivor (Horovod keeps the existing hosts first), so its count is the
  job's. A scheduled exit fires only in a process that has not been through a
  reset, as in scenario_train.py.
- the TF2 loop builds the optimizer's variables with one local step (no
  allreduce) before the state is made, as Horovod's own TF2 elastic scripts
  do, and the ``fit`` flavour builds them with ``optimizer.build``:
  otherwise a newcomer's optimizer has fewer variables than the survivors'
  and the state's broadcast does not match (the job hangs).
- the ``fit`` callbacks come in the order that makes Horovod's epoch-end
  commit hold the next epoch (UpdateEpoch, UpdateBatch, then Commit); with
  Commit first, a failure early in an epoch replays the previous epoch's end.
  ``fit`` gets ``epochs=left`` and no ``initial_epoch``: the callback counts
  the committed epoch plus fit's own epoch index, which would count an
  ``initial_epoch`` twice and skip epochs. Data: each global batch of 32 digits split by
rank, the batch index kept in the state (Horovod has no sampler for TF).
"""

import argparse
import json
import os
import signal
import time

p = argparse.ArgumentParser()
p.add_argument("--flavour", choices=["torch", "tf", "keras"], required=True)
p.add_argument("--keras", choices=["2", "3"], default="3")
p.add_argument("--logfile", required=True)
p.add_argument("--out", default="", help="unused; accepted for the same command line as scenario_train.py")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batches", type=int, default=6)
p.add_argument("--commit-every", type=int, default=2)
p.add_argument("--exit-schedule", default="{}")
p.add_argument("--exit-mode", choices=["exception", "kill"], default="exception")
p.add_argument("--epoch-wait-s", type=float, default=0.0)
args = p.parse_args()
if args.keras == "2":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
from examples.digits import load_digits  # noqa: E402

GLOBAL_BATCH = 32
digits = load_digits()
SIZE = args.batches * GLOBAL_BATCH
features = (digits.data[:SIZE] / 16.0).astype(np.float32)
labels = digits.target[:SIZE].astype(np.int64)
exits = {tuple(int(x) for x in key.split(",")): set(ranks) for key, ranks in json.loads(args.exit_schedule).items()}
hostname = os.environ.get("HOROVOD_HOSTNAME", "?")

if args.flavour == "torch":
    import torch
    import horovod.torch as hvd
    torch.set_num_threads(1)
else:
    import tensorflow as tf
    if args.keras == "2":
        import tf_keras as keras
    else:
        import keras
    if args.flavour == "keras":
        import horovod.tensorflow.keras as hvd
    else:
        import horovod.tensorflow as hvd
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)

hvd.init()
start_rank = hvd.rank()
fired = set()
resets = [0]  # this process's resets (see the module docstring)


def maybe_exit(state, epoch, batch):
    if resets[0] or (epoch, batch) in fired or hvd.rank() not in exits.get((epoch, batch), ()):
        return
    fired.add((epoch, batch))
    if args.exit_mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"scheduled exit of rank {hvd.rank()} at epoch {epoch} batch {batch}")


def log_epoch(state, epoch):
    if hvd.rank() == 0:
        with open(args.logfile, "a") as handle:
            handle.write(json.dumps({"epoch": epoch, "rank": hvd.rank(), "start_rank": start_rank,
                                     "size": hvd.size(), "hostname": hostname,
                                     "generation": 1 + resets[0]}) + "\n")
    if args.epoch_wait_s:
        time.sleep(args.epoch_wait_s)


def shard(batch):
    """This rank's rows of global batch ``batch``."""
    rows = np.arange(batch * GLOBAL_BATCH, (batch + 1) * GLOBAL_BATCH)[hvd.rank()::hvd.size()]
    return features[rows], labels[rows]


def count_reset(state):
    state.register_reset_callbacks([lambda: resets.__setitem__(0, resets[0] + 1)])


def loop(state, step):
    while state.epoch < args.epochs:
        while state.batch < args.batches:
            maybe_exit(state, state.epoch, state.batch)
            step(*shard(state.batch))
            state.batch += 1
            if state.batch % args.commit_every == 0:
                state.commit()
        log_epoch(state, state.epoch)
        state.epoch += 1
        state.batch = 0
        state.commit()


if args.flavour == "torch":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)
    count_reset(state)

    def step(x, y):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()

    hvd.elastic.run(lambda state: loop(state, step))(state)

elif args.flavour == "tf":
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y, allreduce=True):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step(*shard(0), allreduce=False)  # builds the optimizer's variables; the sync overwrites the result
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
    count_reset(state)

    hvd.elastic.run(lambda state: loop(state, step))(state)

else:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)  # see the module docstring
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    count_reset(state)

    class Scenario(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            maybe_exit(state, state.epoch, state.batch + (1 if batch else 0))

        def on_epoch_end(self, epoch, logs=None):
            log_epoch(state, state.epoch)

    @hvd.elastic.run
    def train(state):
        # Horovod's callbacks keep the epoch and the last finished batch; fit
        # runs the epochs left (UpdateEpochStateCallback adds the epoch fit
        # counts from 0 to the committed one, so no initial_epoch) and skips
        # the batches already done.
        data = tf.data.Dataset.from_generator(
            lambda: (shard(b % args.batches) for b in range(state.batch, args.batches * args.epochs)),
            output_signature=(tf.TensorSpec((None, 64), tf.float32), tf.TensorSpec((None,), tf.int64)))
        model.fit(data, steps_per_epoch=args.batches, epochs=args.epochs - state.epoch, verbose=0,
                  callbacks=[Scenario(), hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every)])

    train(state)
