"""A TensorFlow 2 training step in ``tf.function`` with a Keras 3 optimizer on a ``LearningRateSchedule``,
traced again after every resize.

Horovod's TF2 example, moved to Keras 3 and elastic_ext: the step is a
``tf.function`` around a ``tf.GradientTape`` wrapped in
``elastic_ext.tensorflow.DistributedGradientTape``, the optimizer an Adam
whose learning rate is a ``keras.optimizers.schedules.CosineDecay`` with
warmup (evaluated on the optimizer's ``iterations``, a variable in the
State). Each rank's share of the global batch changes size with the world
(60 samples: 15 at 4 workers, 20 at 3), so the function is traced again
after a resize; nothing of the project may create a variable inside that
trace. As in Horovod's ``tensorflow2_mnist_elastic.py``, the step takes an
``allreduce`` flag and is first called once with ``allreduce=False`` on this
rank's first batch, to create the model's and the optimizer's variables
before the State is made: the first trace has no gradient tape of Horovod's
or elastic_ext's, so whatever they create is created in a later trace. The
State's first sync then gives every rank rank 0's weights after that step.
An MLP on the digits.

``--reference``: one process, no Horovod, the whole global batch per step
(a plain ``tf.GradientTape``), after the same warm-up step on the samples
that were rank 0's first share (``--warmup-ranks``: the elastic run's world
size at its start).
``--plain``: Horovod's ``hvd.elastic.TensorFlowKerasState``, ``hvd.elastic.run`` and
``hvd.DistributedGradientTape``.
"""

import os

import _hooks

parser = _hooks.arguments(__doc__.split("\n")[0])
parser.add_argument("--warmup-ranks", type=int, default=4, help="reference: the elastic run's first world size")
args = parser.parse_args()
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

features, labels = _hooks.digits(720, args.seed)
X, Y = tf.constant(features), tf.constant(labels)
steps_per_epoch = len(labels) // args.global_batch
total_steps = args.epochs * steps_per_epoch

keras.utils.set_random_seed(args.seed)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
schedule = keras.optimizers.schedules.CosineDecay(initial_learning_rate=1e-3, decay_steps=total_steps - 4,
                                                  warmup_target=5e-3, warmup_steps=4)
optimizer = keras.optimizers.Adam(learning_rate=schedule)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
sampler = etf.ElasticSampler(len(labels), global_batch_size=args.global_batch, seed=args.seed + 1,
                             **(_hooks.one_process() if args.reference else {}))



@tf.function
def train_step(x, y, allreduce=True):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    if allreduce and not args.reference:
        tape = hvd.DistributedGradientTape(tape) if args.plain else etf.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


# The variables exist before the State: one step on this rank's first batch, without a reduction.
first = etf.ElasticSampler(len(labels), global_batch_size=args.global_batch, seed=args.seed + 1,
                           **({"world": lambda: (0, args.warmup_ranks)} if args.reference else {}))
warmup_indices, _ = next(iter(first.batches()))
train_step(tf.gather(X, warmup_indices), tf.gather(Y, warmup_indices), allreduce=False)

if args.reference:
    state, run = _hooks.LocalState(epoch=0, step=0), (lambda fn: fn)
elif args.plain:
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, step=0, cursor=0)
    run = hvd.elastic.run
else:
    state = elastic_ext.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
    run = elastic_ext.run


def arrays():
    found = {f"model/{i:02d}": v.numpy() for i, v in enumerate(model.trainable_variables)}
    found.update({f"opt/{i:02d}": np.asarray(v.numpy()) for i, v in enumerate(optimizer.variables)})
    found["lr/0"] = np.asarray(float(schedule(optimizer.iterations)))
    return found


@run
def train(state):
    if args.plain:  # Horovod's state knows plain values only: the sampler follows them
        sampler.epoch, sampler.cursor = state.epoch, state.cursor
    hooks.started(state, sampler.epoch, sampler.cursor)
    while state.epoch < args.epochs:
        sampler.set_epoch(state.epoch)
        for indices, _ in sampler.batches():
            hooks.step(state, sampler.epoch, sampler.cursor, indices)
            loss = train_step(tf.gather(X, indices), tf.gather(Y, indices))
            sampler.record_step()
            state.step += 1
            hooks.trace(state, loss=float(loss), lr=float(schedule(optimizer.iterations)),
                        traces=train_step.experimental_get_tracing_count())
            if state.step % args.commit_every == 0:
                if args.plain:
                    state.cursor = sampler.cursor
                hooks.before_commit(state)
                state.commit()
                hooks.committed(state, arrays)
        state.epoch += 1
        if args.plain:
            state.cursor = 0
        state.commit()


train(state)
hooks.finish(state, arrays)
