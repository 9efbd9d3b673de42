"""Test worker: elastic ``model.fit`` on the UCI digits, Keras 2 (--keras 2) or Keras 3.

Same outputs and fault flags as train_tf.py: a sample ledger (written from the
steps Keras actually trained on), final-<rank>.npz with weights and optimizer
variables, faults "RANK:STEP:HOW" fired at the start of global step STEP,
and --resize-at host-file rewrites at a commit. --side-callbacks adds
ModelCheckpoint and TensorBoard on rank 0 next to the elastic callback.
--grad-checks compares, once training is over, elastic_ext's gradient API
with Horovod's in the job's last world (keras_grads.py).

Soft failures: --guard (State(guard=NumericGuard())), --nan "RANK:STEP" (that
rank's loss is NaN at that global step, once), --straggler
"FACTOR:WINDOW:WARMUP" (StragglerPolicy(..., min_size=1), exclude file
OUT/exclude), --compute-s S (simulated compute in the training graph, before
the gradients: S seconds per step) and --slow "WHO:STEP:FACTOR" (from STEP
the process that started as rank WHO, or every process on host WHO, computes
FACTOR x longer).
"""

import argparse
import os
import time

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
p.add_argument("--guard", action="store_true")
p.add_argument("--nan", default="")
p.add_argument("--straggler", default="")
p.add_argument("--compute-s", type=float, default=0.0)
p.add_argument("--slow", default="")
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
from devkit.ledger import Ledger  # noqa: E402
from devkit.faults import FaultSchedule, HostFileSchedule  # noqa: E402

assert keras.__version__.startswith(args.keras), keras.__version__
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
faults = FaultSchedule.parse(args.faults, os.path.join(args.out, "faults"))
resizes = HostFileSchedule(args.resize_at)
digits = load_digits()
X = tf.constant(digits.data / 16.0, dtype=tf.float32)
Y = tf.constant(digits.target, dtype=tf.int64)

first_rank = hvd.rank()  # --slow follows the process, not whoever holds its rank after a resize
HOST = os.environ.get("HOROVOD_HOSTNAME", "")
POISON = tf.Variable(0.0, trainable=False)  # NaN while the --nan batch trains
cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compute_seconds():
    """This step's simulated compute: --compute-s, times the --slow factor on the slow process."""
    seconds = args.compute_s
    if args.slow:
        who, start, factor = args.slow.rsplit(":", 2)
        if (first_rank == int(who) if who.isdigit() else HOST == who) and state.step >= int(start):
            seconds *= float(factor)
    return seconds


def simulated_compute():
    time.sleep(compute_seconds())
    return np.float32(0.0)


def loss_fn(y_true, y_pred):
    loss = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)  # per sample
    if args.nan:
        loss = loss + POISON
    if args.compute_s:  # part of the training step, before its gradients: what the callback times
        loss = loss + tf.stop_gradient(tf.reshape(tf.py_function(simulated_compute, [], tf.float32), []))
    return loss


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer=etf.DistributedOptimizer(keras.optimizers.Adam(0.01)),
              loss=loss_fn if (args.nan or args.compute_s) else cross_entropy, jit_compile=False)
sampler = etf.ElasticSampler(int(X.shape[0]), global_batch_size=args.global_batch, seed=1, policy="pad")
straggler, config = None, None
if args.straggler:
    factor, window, warmup = args.straggler.split(":")
    straggler = elastic_ext.StragglerPolicy(factor=float(factor), window_steps=int(window), warmup_steps=int(warmup),
                                            min_size=1)
    config = elastic_ext.ElasticConfig.from_env(exclude_file=os.path.join(args.out, "exclude"))
state = elastic_ext.State(model=model, optimizer=model.optimizer, sampler=sampler, epoch=0, batch=0, step=0,
                          guard=elastic_ext.NumericGuard() if args.guard else None, straggler=straggler,
                          config=config)
book = Ledger(args.out)
nan_fired = []


def load(indices, pad):
    return tf.gather(X, indices), tf.gather(Y, indices), 1.0 - tf.cast(pad, tf.float32)


def record(step):
    book.step(state.generation, step.epoch, step.cursor, state.step, hvd.rank(), hvd.size(),
              step.indices[~step.pad], int(step.pad.sum()))


class TestSeams(keras.callbacks.Callback):
    """Faults at the start of a global step; host-file resizes just before a commit."""

    def on_train_batch_begin(self, batch, logs=None):
        faults.maybe_fire(hvd.rank(), state.step, where="step")
        if args.nan:
            rank, step = (int(x) for x in args.nan.split(":"))
            bad = hvd.rank() == rank and state.step == step and not nan_fired
            if bad:
                nan_fired.append(step)
            POISON.assign(float("nan") if bad else 0.0)

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
    book.skipped_by_rollbacks(state.events.history, sampler, hvd.rank())
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
