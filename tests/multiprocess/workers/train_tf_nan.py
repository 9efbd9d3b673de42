"""Test worker: elastic TensorFlow (Keras 3) training with the numeric guard; one rank's loss turns NaN once.

The TensorFlow twin of train_torch_nan.py: BatchNorm and dropout on
the UCI digits, a custom loop with ``tf.GradientTape``, gradients
averaged by elastic_ext's ``DistributedGradientTape`` (which carries the
guard's signal on the same allreduce), then ``state.guard_step`` before
``apply_gradients``. At global step --nan-step, rank --nan-rank poisons one
input sample with a NaN the first time only. Writes the same outputs:
the ledger with ``skipped`` records, final-<rank>.npz (trainable weights and
optimizer variables; BatchNorm's moving statistics are per-rank buffers and
left out) and the events.
"""

import argparse
import os

import numpy as np
import tensorflow as tf
from examples.digits import load_digits

import keras

import horovod.tensorflow as hvd

import elastic_ext
from elastic_ext.tensorflow import DistributedGradientTape, ElasticSampler, index_dataset
from devkit.ledger import Ledger

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--nan-step", type=int, required=True)
p.add_argument("--nan-rank", type=int, required=True)
p.add_argument("--samples", type=int, default=1792)
args = p.parse_args()

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
if hvd.rank() == 0:
    print(f"elastic_ext from {elastic_ext.__file__}", flush=True)
digits = load_digits()
X = tf.constant(digits.data[:args.samples] / 16.0, dtype=tf.float32)
Y = tf.constant(digits.target[:args.samples], dtype=tf.int64)

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(48), keras.layers.BatchNormalization(),
                          keras.layers.ReLU(), keras.layers.Dropout(0.2), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam(0.01)
sampler = ElasticSampler(int(X.shape[0]), global_batch_size=args.global_batch, seed=1, policy="drop")
book = Ledger(args.out)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
fired = []


def train_step(state, indices):
    x, y = tf.gather(X, indices), tf.gather(Y, indices)
    if hvd.rank() == args.nan_rank and state.step == args.nan_step and not fired:
        fired.append(state.step)
        x = tf.tensor_scatter_nd_update(x, [[0, 0]], [float("nan")])  # one poisoned sample on one rank
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = DistributedGradientTape(tape)  # the guard's signal rides on its gradient allreduce
    grads = tape.gradient(loss, model.trainable_variables)
    state.guard_step(loss, grads, samples=int(x.shape[0]))  # raises on every rank together, no collective
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


@elastic_ext.run
def train(state):
    book.skipped_by_rollbacks(state.events.history, sampler, hvd.rank())
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in index_dataset(sampler):
            real = indices.numpy()[~pad.numpy()]
            book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(), real, 0)
            train_step(state, real)
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
        state.epoch += 1
    state.commit()


state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                          guard=elastic_ext.NumericGuard())
train(state)
variables = {f"param/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(model.trainable_variables)}
variables.update({f"opt/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(optimizer.variables)})
np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **variables)
book.end(state.step, hvd.rank(), hvd.size())
