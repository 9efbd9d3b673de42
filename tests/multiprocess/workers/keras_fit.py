"""Test worker: elastic ``model.fit`` on the UCI digits, Keras 2 (--keras 2) or Keras 3.

Same outputs and fault flags as train_tf.py: a sample ledger (written from the
steps Keras actually trained on), final-<rank>.npz with weights and optimizer
variables, faults "RANK:STEP:HOW" fired at the start of global step STEP,
and --resize-at host-file rewrites at a commit. --side-callbacks adds
ModelCheckpoint and TensorBoard on rank 0 next to the elastic callback.
--grad-checks compares, once training is over, elastic_ext's gradient API
with Horovod's in the job's last world (keras_grads.py).
"""

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--keras", choices=["2", "3"], default="3")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--faults", default="")
p.add_argument("--resize-at", default="")
p.add_argument("--side-callbacks", action="store_true")
p.add_argument("--grad-checks", action="store_true",
               help="at the end, compare the gradient API with Horovod's (keras_grads.py) on every rank")
p.add_argument("--lr-per-worker", type=float, default=0.0, help="learning rate = this * world size, set on reset")
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
import elastic_ext.tensorflow as etf  # noqa: E402
from elastic_ext.testing.ledger import Ledger  # noqa: E402
from elastic_ext.testing import FaultSchedule, HostFileSchedule  # noqa: E402

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
model.compile(optimizer=etf.DistributedOptimizer(keras.optimizers.Adam(0.01)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
sampler = etf.ElasticSampler(int(X.shape[0]), global_batch_size=args.global_batch, seed=1, policy="pad")
state = elastic_ext.State(model=model, optimizer=model.optimizer, sampler=sampler, epoch=0, batch=0, step=0)
book = Ledger(args.out)


def load(indices, pad):
    return tf.gather(X, indices), tf.gather(Y, indices), 1.0 - tf.cast(pad, tf.float32)


def record(step):
    book.step(state.generation, step.epoch, step.cursor, state.step, hvd.rank(), hvd.size(),
              step.indices[~step.pad], int(step.pad.sum()))


class TestSeams(keras.callbacks.Callback):
    """Faults at the start of a global step; host-file resizes just before a commit."""

    def on_train_batch_begin(self, batch, logs=None):
        faults.maybe_fire(hvd.rank(), state.step, where="step")

    def on_train_batch_end(self, batch, logs=None):
        if (state.batch + 1) % args.commit_every == 0:
            resizes.maybe_apply(state, hvd.rank(), state.step + 1)


elastic = etf.ElasticCallback(state, load, commit_every=args.commit_every, on_step=record,
                              lr_for_size=(lambda size: args.lr_per_worker * size) if args.lr_per_worker else None)
side = []
if args.side_callbacks and hvd.rank() == 0:
    suffix = ".weights.h5" if args.keras == "3" else ".h5"
    side = [keras.callbacks.ModelCheckpoint(os.path.join(args.out, "ckpt-{epoch:02d}" + suffix),
                                            save_weights_only=True),
            keras.callbacks.TensorBoard(os.path.join(args.out, "tensorboard"), update_freq="epoch")]


@elastic_ext.run
def train(state):
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    return elastic.fit(model, epochs=args.epochs, callbacks=[TestSeams(), *side], verbose=0)


train(state)
variables = {f"model/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(model.variables)}
opt_vars = model.optimizer.variables() if callable(model.optimizer.variables) else model.optimizer.variables
variables.update({f"opt/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(opt_vars)})
variables["lr"] = np.asarray(float(np.asarray(model.optimizer.learning_rate)))
np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **variables)
book.end(state.step, hvd.rank(), hvd.size())
if args.grad_checks:
    import keras_grads  # noqa: E402  (next to this script)
    keras_grads.check(args.out, keras)
