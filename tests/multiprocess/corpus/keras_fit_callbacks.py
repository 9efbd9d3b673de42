"""Keras 3 ``model.fit`` with ``ReduceLROnPlateau``, ``EarlyStopping`` and ``ModelCheckpoint``,
made elastic by ``elastic_ext.tensorflow.ElasticCallback``.

The Keras guide's callbacks on an elastic ``fit`` (``docs/keras.md``): the
optimizer wrapped in ``elastic_ext.tensorflow.DistributedOptimizer``, the data
from ``load(indices, pad)`` over an elastic sampler, ``fit`` run by
``ElasticCallback.fit`` inside ``@elastic_ext.run``. Keras computes each
epoch's ``loss`` on each rank from its own batches, so a callback first
averages it over the ranks (what Horovod's ``MetricAverageCallback`` does;
Horovod's own fails on Keras 3), then ``ReduceLROnPlateau`` and
``EarlyStopping`` read it; rank 0 alone writes a ``ModelCheckpoint`` every
epoch. An MLP on the digits, Adam, 12 steps per epoch.

``--reference``: one process, no Horovod, the whole global batch per step,
a plain ``model.fit`` over the same batches with the same callbacks.
``--plain``: Horovod's ``hvd.elastic.KerasState`` (TensorFlowKerasState) and
``hvd.elastic.run`` around a plain ``fit`` with Horovod's Keras optimizer.
"""

import os

import _hooks

args = _hooks.arguments(__doc__.split("\n")[0], epochs=4).parse_args()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

import elastic_ext  # noqa: E402
import elastic_ext.tensorflow as etf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
if not args.reference:
    hvd.init()
hooks = _hooks.Hooks(args, *(() if args.reference else (hvd.rank, hvd.size)))
rank = 0 if args.reference else hvd.rank()

features, labels = _hooks.digits(720, args.seed)
X, Y = tf.constant(features), tf.constant(labels)
steps_per_epoch = len(labels) // args.global_batch

keras.utils.set_random_seed(args.seed)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam(4e-3)
if args.plain:
    import horovod.tensorflow.keras as hvd_keras  # Horovod's Keras integration (what its guide uses)
    optimizer = hvd_keras.DistributedOptimizer(optimizer)
elif not args.reference:
    optimizer = etf.DistributedOptimizer(optimizer)
model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              jit_compile=False)  # Horovod's ops have no XLA kernel
sampler = etf.ElasticSampler(len(labels), global_batch_size=args.global_batch, seed=args.seed + 1,
                             **(_hooks.one_process() if args.reference else {}))


class AverageLoss(keras.callbacks.Callback):
    """The epoch's loss averaged over the ranks, before the callbacks that read it."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and "loss" in logs and not args.reference:
            logs["loss"] = float(hvd.allreduce(tf.constant(logs["loss"], tf.float64), name="epoch_loss"))


class Hooked(keras.callbacks.Callback):
    """The test's hooks in ``fit``: a declared fault as a batch begins, the dump, the trace."""

    def on_train_batch_begin(self, batch, logs=None):
        hooks.step(state)

    def on_train_batch_end(self, batch, logs=None):
        hooks.trace(state, loss=logs.get("loss", float("nan")) if logs else float("nan"),
                    lr=float(model.optimizer.learning_rate))
        hooks.dump_if(state.step + 1, arrays)  # the elastic callback (last) counts the step and commits

    def on_epoch_end(self, epoch, logs=None):
        hooks.trace(state, epoch_loss=logs["loss"], lr=float(model.optimizer.learning_rate))


def callbacks():
    found = [AverageLoss(),
             keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.42),
             keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=0.3)]
    if rank == 0:
        found.append(keras.callbacks.ModelCheckpoint(os.path.join(args.out, "ckpt-{epoch}.weights.h5"),
                                                     save_weights_only=True))
    return found + [Hooked()]


def arrays():
    found = {f"model/{i:02d}": v.numpy() for i, v in enumerate(model.trainable_variables)}
    found.update({f"opt/{i:02d}": np.asarray(v.numpy()) for i, v in enumerate(model.optimizer.variables)})
    found["lr/0"] = np.asarray(float(model.optimizer.learning_rate))
    return found


def load(indices, pad):
    return tf.gather(X, indices), tf.gather(Y, indices), 1.0 - tf.cast(pad, tf.float32)


if args.reference:
    state = _hooks.LocalState(epoch=0, batch=0, step=0)

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state.step += 1

    def global_batches():
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for indices, _ in sampler.batches():
                yield tf.gather(X, indices), tf.gather(Y, indices)

    data = tf.data.Dataset.from_generator(global_batches, output_signature=(
        tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int64)))
    model.fit(data, epochs=args.epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks()[:-1] + [
        Hooked(), Count()], verbose=0)
elif args.plain:
    # Horovod's elastic Keras guide: its KerasState and its three callbacks; each rank reads its share
    # of every global batch (the elastic sampler's partition, its position from the state's counters).
    state = hvd_keras.elastic.KerasState(model, epoch=0, batch=0, step=0)

    def shares():
        while True:
            sampler.set_epoch(state.epoch)
            sampler.cursor = state.batch * args.global_batch
            for indices, _ in sampler.batches():
                yield tf.gather(X, indices), tf.gather(Y, indices)

    data = tf.data.Dataset.from_generator(shares, output_signature=(
        tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int64)))

    @hvd_keras.elastic.run
    def train(state):
        model.fit(data, steps_per_epoch=steps_per_epoch - state.batch, initial_epoch=state.epoch,
                  epochs=args.epochs, verbose=0, callbacks=[
                      hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every),
                      hvd_keras.elastic.UpdateBatchStateCallback(state),
                      hvd_keras.elastic.UpdateEpochStateCallback(state), *callbacks()])

    train(state)
else:
    state = elastic_ext.State(model=model, optimizer=model.optimizer, sampler=sampler, epoch=0, batch=0, step=0)
    elastic = etf.ElasticCallback(state, load, commit_every=args.commit_every,
                                  on_step=lambda s: hooks.record(state, s.epoch, s.cursor, s.indices[~s.pad]))

    @elastic_ext.run
    def train(state):
        hooks.started(state, sampler.epoch, sampler.cursor)
        return elastic.fit(model, epochs=args.epochs, callbacks=callbacks(), verbose=0)

    train(state)
hooks.finish(state, arrays)
