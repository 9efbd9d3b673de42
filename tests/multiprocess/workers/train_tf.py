"""Test worker: elastic TensorFlow training on the UCI digits, with
Keras 2 (tf_keras, --keras 2) or Keras 3 (--keras 3).

Same outputs and fault flags as train_torch.py: a sample ledger, final-<rank>.npz
with weights and optimizer variables, and faults "RANK:STEP:HOW[:WHERE]" (WHERE:
step or commit). The gradients are reduced by elastic_ext's
DistributedGradientTape inside the ``tf.function`` step, so the tape goes
through every join, leave and rollback of the jobs that run this worker (the
eager step is the TensorFlow example's, tests/multiprocess/test_examples.py).
"""

import argparse
import os
import time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--keras", choices=["2", "3"], default="3")
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--faults", default="")
p.add_argument("--resize-at", default="")
p.add_argument("--step-sleep-s", type=float, default=0.0)
p.add_argument("--sleep-below", type=int, default=0,
               help="SIZE: --step-sleep-s only while the world has fewer than SIZE workers (0: always)")
args = p.parse_args()
if args.keras == "2":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from examples.digits import load_digits  # noqa: E402

if args.keras == "2":
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

import elastic_ext  # noqa: E402
from devkit.ledger import Ledger  # noqa: E402
import elastic_ext.tensorflow as etf  # noqa: E402
from elastic_ext.tensorflow import ElasticSampler, index_dataset  # noqa: E402
from devkit.faults import CommitFaultProbe, FaultSchedule, HostFileSchedule  # noqa: E402

assert keras.__version__.startswith(args.keras), keras.__version__
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
faults = FaultSchedule.parse(args.faults, os.path.join(args.out, "faults"))
resizes = HostFileSchedule(args.resize_at)
digits = load_digits()
X = tf.constant(digits.data / 16.0, dtype=tf.float32)
Y = tf.constant(digits.target, dtype=tf.int64)

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam(0.01)
sampler = ElasticSampler(int(X.shape[0]), global_batch_size=args.global_batch, seed=1, policy="pad")
book = Ledger(args.out)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


commit_probe = CommitFaultProbe(faults, hvd.rank)


@tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.bool)])
def train_step(indices, pad):
    keep = tf.cast(tf.logical_not(pad), tf.float32)
    x, y = tf.gather(X, indices), tf.gather(Y, indices)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loss_fn(y, model(x)) * keep) / args.global_batch
    # elastic_ext's tape, summing: the loss is already divided by the global batch,
    # so the update is the global mean whatever the world size.
    grads = etf.DistributedGradientTape(tape, op=hvd.Sum).gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def maybe_resize(state):
    resizes.maybe_apply(state, hvd.rank(), state.step)


@elastic_ext.run
def train(state):
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in index_dataset(sampler):
            faults.maybe_fire(hvd.rank(), state.step, where="step")
            book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(),
                      indices.numpy()[~pad.numpy()], int(pad.numpy().sum()))
            train_step(indices, pad)
            if args.step_sleep_s and (not args.sleep_below or hvd.size() < args.sleep_below):
                time.sleep(args.step_sleep_s)
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                commit_probe.step = state.step
                maybe_resize(state)
                state.commit()
                commit_probe.step = None
        state.epoch += 1
    state.commit()


state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0,
                          commit_probe=commit_probe, adapters=[commit_probe])
train(state)
variables = {f"model/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(model.variables)}
opt_vars = optimizer.variables() if callable(optimizer.variables) else optimizer.variables
variables.update({f"opt/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(opt_vars)})
np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **variables)
book.end(state.step, hvd.rank(), hvd.size())
