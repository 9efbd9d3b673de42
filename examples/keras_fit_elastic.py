"""Elastic ``model.fit`` on handwritten digits with elastic_ext (Keras 2 or Keras 3).

Launch (two pseudo-hosts on one machine; host_discovery/static.py re-reads
the host file every second, so editing it grows or shrinks the job)::

    printf 'localhost:2\\n127.0.0.1:2\\n' > /tmp/hosts
    elastic-horovodrun -np 4 --min-np 2 --max-np 6 --network-interfaces lo \\
        --host-discovery-script "host_discovery/static.py /tmp/hosts" \\
        python examples/keras_fit_elastic.py --keras 3 --epochs 6

``--keras 2`` trains a tf_keras (Keras 2) model instead of a Keras 3 one; the
script sets ``TF_USE_LEGACY_KERAS=1`` itself, before TensorFlow is imported.
On a Slurm allocation use ``--host-discovery-script host_discovery/slurm.py``.
This is the ``model.fit`` twin of ``examples/tensorflow_elastic.py``.

What changes from a plain Keras script: the optimizer is wrapped in
``elastic_ext.tensorflow.DistributedOptimizer`` (Horovod's, which fails on
Keras 3), the data comes from ``load(indices, pad)`` over an elastic sampler
with a constant global batch, and ``fit`` runs inside an
``@elastic_ext.run`` function through ``ElasticCallback.fit``, which commits
every ``--commit-every`` batches and at every epoch end, and after a failure
or a resize restarts ``fit`` at the committed epoch and batch. If a worker
dies, the others roll back to the last commit and go on without it; the
samples of the lost steps are trained on again, exactly once. When hosts are
added, the job grows at the next commit, without a rollback.
"""

import argparse
import logging
import os

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--keras", choices=["2", "3"], default="3", help="2: tf_keras, 3: Keras 3")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--global-batch", type=int, default=64, help="kept constant whatever the world size")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--commit-every", type=int, default=5, help="batches between commits")
args = parser.parse_args()

# tf.keras resolves to tf_keras only if this is set before TensorFlow is imported.
if args.keras == "2":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from digits import load_digits  # noqa: E402

if args.keras == "2":
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

import elastic_ext  # noqa: E402
import elastic_ext.tensorflow as etf  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()

# The data: 1797 8x8 digit images, in digits.npz beside this script (no download).
# The same split as the other examples: 297 held out, 1500 to train on.
digits = load_digits()
holdout = np.random.default_rng(0).permutation(len(digits.target))
test_idx, train_idx = holdout[:297], holdout[297:]
features = (digits.data / 16.0).astype(np.float32)
train_x, train_y = tf.constant(features[train_idx]), tf.constant(digits.target[train_idx], dtype=tf.int64)
test_x, test_y = features[test_idx], digits.target[test_idx]

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer=etf.DistributedOptimizer(keras.optimizers.Adam(args.lr)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
              jit_compile=False)  # Horovod's ops have no XLA kernel (Keras 3 uses XLA on GPUs by default)
sampler = etf.ElasticSampler(int(train_y.shape[0]), global_batch_size=args.global_batch, seed=1, policy="pad")
state = elastic_ext.State(model=model, optimizer=model.optimizer, sampler=sampler, epoch=0, batch=0, step=0)


def load(indices, pad):
    """This rank's share of a global step; padding (end of epoch) weighs nothing."""
    return tf.gather(train_x, indices), tf.gather(train_y, indices), 1.0 - tf.cast(pad, tf.float32)


class Report(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 0:
            _, accuracy = model.evaluate(test_x, test_y, verbose=0)
            print(f"epoch {epoch}: loss {logs['loss']:.4f}  test accuracy {accuracy:.3f}  "
                  f"workers {hvd.size()}  step {state.step}", flush=True)


elastic = etf.ElasticCallback(state, load, commit_every=args.commit_every)


def on_reset():
    if hvd.rank() == 0:
        print(f"[elastic] reset: the job now has {hvd.size()} workers", flush=True)


state.register_reset_callbacks([on_reset])


@elastic_ext.run
def train(state):
    return elastic.fit(model, epochs=args.epochs, callbacks=[Report()], verbose=0)


train(state)
if hvd.rank() == 0:
    _, accuracy = model.evaluate(test_x, test_y, verbose=0)
    print(f"done: test accuracy {accuracy:.3f} after {state.step} steps on {hvd.size()} workers "
          f"(Keras {keras.__version__})", flush=True)
