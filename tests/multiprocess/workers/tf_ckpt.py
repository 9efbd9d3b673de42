"""Test worker: elastic TensorFlow training with durable checkpoints, a Keras 3 model
(or Keras 2 with --keras 2) trained by a custom ``tf.function`` step.

The TF twin of train_torch_ckpt.py, same outputs and flags: the checkpoint
settings come from ELASTIC_EXT_CHECKPOINT_* variables and a fresh job resumes
from the newest valid checkpoint there; under --out it writes the sample
ledger, final-<rank>.npz (model and optimizer variables at the end) and
final-<rank>.json. --stop-after-commit K ends the job cleanly once the
checkpoint of commit K is durable; --resize-at rewrites a host file at a
commit (devkit.faults.HostFileSchedule), for a reference run that
changes its world size where a failed job restarted from storage.

The step is one traced function for the whole job: it reduces with
elastic_ext's DistributedGradientTape (op=Sum of a loss already divided by
the global batch, so the update is the global mean whatever the world size),
and the optimizer is built by the State before a checkpoint is restored
into it, not by its first apply.
"""

import argparse
import json
import os
import time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--keras", choices=["2", "3"], default="3")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--step-sleep-s", type=float, default=0.0)
p.add_argument("--stop-after-commit", type=int, default=-1)
p.add_argument("--resize-at", default="", help="STEP:HOSTFILE:HOST,HOST[;...] (see devkit.faults.HostFileSchedule)")
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
from devkit.faults import HostFileSchedule  # noqa: E402
from devkit.ledger import Ledger  # noqa: E402

assert keras.__version__.startswith(args.keras), keras.__version__
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
resizes = HostFileSchedule(args.resize_at)

digits = load_digits()
X = tf.constant(digits.data / 16.0, dtype=tf.float32)
Y = tf.constant(digits.target, dtype=tf.int64)

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam(0.01)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
sampler = etf.ElasticSampler(int(X.shape[0]), global_batch_size=args.global_batch, seed=1, policy="pad")
book = Ledger(args.out)


@tf.function
def train_step(indices, pad):
    keep = tf.cast(tf.logical_not(pad), tf.float32)
    with tf.GradientTape() as tape:
        losses = loss_fn(tf.gather(Y, indices), model(tf.gather(X, indices), training=True))
        loss = tf.reduce_sum(losses * keep) / args.global_batch
    tape = etf.DistributedGradientTape(tape, op=hvd.Sum)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def stop_here(state):
    """All ranks leave together once rank 0's checkpoint of this commit is durable."""
    if state.commit_id != args.stop_after_commit:
        return False
    written = state.wait_for_checkpoint()
    if hvd.rank() == 0 and written != args.stop_after_commit:
        raise RuntimeError(f"checkpoint of commit {args.stop_after_commit} was not written (newest: {written})")
    hvd.allreduce(tf.zeros(1), name="stop.barrier")
    return True


def train(state):
    book.start(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size())
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, pad in etf.index_dataset(sampler):
            book.step(state.generation, sampler.epoch, sampler.cursor, state.step, hvd.rank(), hvd.size(),
                      indices.numpy()[~pad.numpy()], int(pad.numpy().sum()))
            train_step(indices, pad)
            if args.step_sleep_s:
                time.sleep(args.step_sleep_s)
            sampler.record_step()
            state.step += 1
            if state.step % args.commit_every == 0:
                resizes.maybe_apply(state, hvd.rank(), state.step)
                state.commit()
                if stop_here(state):
                    return "stopped"
        state.epoch += 1
    state.commit()
    state.wait_for_checkpoint()
    return "finished"


state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
outcome = elastic_ext.run(train)(state)
if outcome == "finished":
    arrays = {f"model/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(model.variables)}
    opt_vars = optimizer.variables() if callable(optimizer.variables) else optimizer.variables
    arrays.update({f"opt/{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(opt_vars)})
    np.savez(os.path.join(args.out, f"final-{hvd.rank()}.npz"), **arrays)
    with open(os.path.join(args.out, f"final-{hvd.rank()}.json"), "w") as handle:
        json.dump({"step": state.step, "size": hvd.size(), "epoch": sampler.epoch, "commit_id": state.commit_id},
                  handle)
book.end(state.step, hvd.rank(), hvd.size())
