"""Elastic TensorFlow training on handwritten digits with elastic_ext (Keras 2 or Keras 3).

Launch (two pseudo-hosts on one machine; host_discovery/static.py re-reads
the host file every second, so editing it grows or shrinks the job)::

    printf 'localhost:2\\n127.0.0.1:2\\n' > /tmp/hosts
    elastic-horovodrun -np 4 --min-np 2 --max-np 6 --network-interfaces lo \\
        --host-discovery-script "host_discovery/static.py /tmp/hosts" \\
        python examples/tensorflow_elastic.py --keras 3 --epochs 6

``--keras 2`` trains a tf_keras (Keras 2) model instead of a Keras 3 one; the
script sets ``TF_USE_LEGACY_KERAS=1`` itself, before TensorFlow is imported.
On a Slurm allocation use ``--host-discovery-script host_discovery/slurm.py``.
This is the TensorFlow twin of ``examples/pytorch_elastic.py``.

What happens on failures: every ``--commit-every`` steps the state (model,
optimizer, sampler position, epoch, step) is committed to host memory. If a
worker dies, the others' allreduce fails, they roll back to the last commit,
Horovod re-forms the job on the healthy hosts, and training continues; the
samples of the lost steps are processed again, exactly once. When hosts are
added, the job grows at the next commit, without a rollback.

Gradients are summed with ``hvd.allreduce`` one tensor at a time rather than
through ``hvd.DistributedGradientTape``, which fails on Keras 3 variables
(horovod/horovod#4290); the loss is already divided by the global batch, so
the sum is the global mean.
"""

import argparse
import logging
import os

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--keras", choices=["2", "3"], default="3", help="2: tf_keras, 3: Keras 3")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--global-batch", type=int, default=64, help="kept constant whatever the world size")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--commit-every", type=int, default=5, help="steps between commits")
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
from elastic_ext.tensorflow import ElasticSampler, index_dataset  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()


def say(message):
    if hvd.rank() == 0:
        print(message, flush=True)


# The data: 1797 8x8 digit images, in digits.npz beside this script (no download).
# The same split as the PyTorch example: 297 held out, 1500 to train on.
digits = load_digits()
rng = np.random.default_rng(0)
holdout = rng.permutation(len(digits.target))
test_idx, train_idx = holdout[:297], holdout[297:]
features = (digits.data / 16.0).astype(np.float32)
train_x, train_y = tf.constant(features[train_idx]), tf.constant(digits.target[train_idx], dtype=tf.int64)
test_x, test_y = tf.constant(features[test_idx]), tf.constant(digits.target[test_idx], dtype=tf.int64)

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam(args.lr)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
sampler = ElasticSampler(int(train_y.shape[0]), global_batch_size=args.global_batch, seed=1, policy="pad")
state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)


def on_reset():
    say(f"[elastic] reset: the job now has {hvd.size()} workers")


state.register_reset_callbacks([on_reset])


def evaluate():
    predicted = tf.argmax(model(test_x), axis=1)
    return float(tf.reduce_mean(tf.cast(predicted == test_y, tf.float32)))


def train_step(indices, pad):
    """One optimizer step on this rank's share of the global batch; returns its mean loss."""
    keep = tf.cast(tf.logical_not(pad), tf.float32)
    x, y = tf.gather(train_x, indices), tf.gather(train_y, indices)
    with tf.GradientTape() as tape:
        per_sample = loss_fn(y, model(x, training=True)) * keep
        # Sum over real samples / global batch, summed over ranks = the mean
        # over the global batch, whatever the number of workers.
        loss = tf.reduce_sum(per_sample) / args.global_batch
    grads = tape.gradient(loss, model.trainable_variables)
    grads = [hvd.allreduce(g, op=hvd.Sum, name=f"grad_{i}") for i, g in enumerate(grads)]
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return float(tf.reduce_sum(per_sample)) / max(1.0, float(tf.reduce_sum(keep)))


@elastic_ext.run
def train(state):
    last = state.events.history[-1] if state.events.history else None
    if last is not None and last["event"] == "recovered":
        say(f"[elastic] recovered from {last['cause']} in {last['recovery_s']:.1f}s, "
            f"{last['steps_rolled_back']} steps rolled back, resuming at step {state.step}")
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        losses = []
        # A fresh iterator per epoch and per (re)start: index_dataset plans the
        # steps from the committed cursor and the world size of that moment.
        for indices, pad in index_dataset(sampler):
            losses.append(train_step(indices, pad))
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
        state.epoch += 1
        state.commit()
        say(f"epoch {state.epoch - 1}: loss {np.mean(losses) if losses else float('nan'):.4f}  "
            f"test accuracy {evaluate():.3f}  workers {hvd.size()}  step {state.step}")
    return evaluate()


accuracy = train(state)
say(f"done: test accuracy {accuracy:.3f} after {state.step} steps on {hvd.size()} workers (Keras {keras.__version__})")
