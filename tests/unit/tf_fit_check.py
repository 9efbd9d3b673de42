"""Checks of ElasticCallback and the gradient API in one process (a world of one).

Run as ``python tf_fit_check.py 2|3`` (Keras 2 via tf_keras, or Keras 3) with
the checkout on PYTHONPATH (the data comes from examples/digits.py); the Keras
version is chosen before TensorFlow is imported, hence a process per version.
Prints "ok" when every check passed; an assertion names the check that failed.
"""

import os
import sys
import tempfile

KERAS = sys.argv[1]
if KERAS == "2":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from examples.digits import load_digits  # noqa: E402

if KERAS == "2":
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
from horovod.common.exceptions import HorovodInternalError  # noqa: E402

import elastic_ext  # noqa: E402
import elastic_ext.tensorflow as etf  # noqa: E402
from devkit import ledger  # noqa: E402
from elastic_ext.errors import ConfigError, StateError  # noqa: E402
from elastic_ext.testing import SoloBinding, state_on  # noqa: E402

assert keras.__version__.startswith(KERAS), keras.__version__
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
digits = load_digits()
X = tf.constant(digits.data[:600] / 16.0, dtype=tf.float32)
Y = tf.constant(digits.target[:600], dtype=tf.int64)
SIZE = 600
EPOCHS = 3
GLOBAL_BATCH = 64  # 10 steps per epoch, the last padded (600 = 9 * 64 + 24)
COMMIT_EVERY = 3


def load(indices, pad):
    return tf.gather(X, indices), tf.gather(Y, indices), 1.0 - tf.cast(pad, tf.float32)


POISON = tf.Variable(0.0, trainable=False)  # NaN during one batch: that batch's loss is NaN (section 6)
CROSS_ENTROPY = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def poisoned_loss(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True) + POISON


def build(guard=None, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=etf.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=poisoned_loss if guard else CROSS_ENTROPY, **{"jit_compile": False, **compile_kwargs})
    sampler = etf.ElasticSampler(SIZE, global_batch_size=GLOBAL_BATCH, seed=3, policy="pad")
    # A world of one outside horovodrun is an MPI world to Horovod, where
    # elastic_ext ends the job on a failure; the solo binding keeps in-job
    # recovery (Horovod's own ops still run, in a world of one).
    state = state_on(SoloBinding(), model=model, optimizer=model.optimizer, sampler=sampler, epoch=0, batch=0,
                     step=0, guard=guard)
    return model, sampler, state


def weights(model):
    opt = model.optimizer.variables() if callable(model.optimizer.variables) else model.optimizer.variables
    return [np.asarray(v.numpy()).copy() for v in list(model.variables) + list(opt)]


class FailAt(keras.callbacks.Callback):
    """Raises the error a failed collective gives, once, at the start of the given global steps."""

    def __init__(self, state, steps):
        super().__init__()
        self.state, self.steps = state, set(steps)

    def on_train_batch_begin(self, batch, logs=None):
        if self.state.step in self.steps:
            self.steps.discard(self.state.step)
            raise HorovodInternalError(f"injected at step {self.state.step}")


class PoisonAt(keras.callbacks.Callback):
    """Makes the loss of the given global steps NaN, once each (the batch of a bad record)."""

    def __init__(self, state, steps):
        super().__init__()
        self.state, self.steps = state, set(steps)

    def on_train_batch_begin(self, batch, logs=None):
        bad = self.state.step in self.steps
        self.steps.discard(self.state.step)
        POISON.assign(float("nan") if bad else 0.0)


def run_fit(fail_steps=(), out=None, calls=None, guard=None, nan_steps=()):
    model, sampler, state = build(guard)
    book = ledger.Ledger(out) if out else None

    def record(step):
        if book:
            book.step(state.generation, step.epoch, step.cursor, state.step, 0, 1, step.indices[~step.pad],
                      int(step.pad.sum()))

    elastic = etf.ElasticCallback(state, load, commit_every=COMMIT_EVERY, on_step=record)
    fail = FailAt(state, fail_steps)
    poison = PoisonAt(state, nan_steps)
    original_fit = model.fit

    def counting_fit(**kwargs):
        if calls is not None:
            calls.append((kwargs["initial_epoch"], kwargs["epochs"], kwargs["steps_per_epoch"]))
        return original_fit(**kwargs)

    model.fit = counting_fit

    @elastic_ext.run
    def train(state):
        if book:
            book.start(state.generation, sampler.epoch, sampler.cursor, state.step, 0, 1)
        if book:
            book.skipped_by_rollbacks(state.events.history, sampler, 0)
        return elastic.fit(model, epochs=EPOCHS, callbacks=[fail, poison], verbose=0)

    train(state)
    return model, state


# 1. Uninterrupted: one fit call for all epochs, 10 steps each; counters committed.
calls = []
reference, ref_state = run_fit(calls=calls)
assert calls == [(0, EPOCHS, 10)], f"uninterrupted fit calls: {calls}"
assert (ref_state.epoch, ref_state.batch, ref_state.step) == (EPOCHS, 0, 30), \
    (ref_state.epoch, ref_state.batch, ref_state.step)
assert ref_state.commit_id > 0

# 2. Failures mid-epoch (step 14: epoch 1 batch 4, commit at batch 3 = step 13)
#    and at an epoch's first batch (step 20): resume at the committed batch with
#    a partial-epoch fit call, exactly once, same bits as uninterrupted.
with tempfile.TemporaryDirectory() as out:
    calls = []
    failed, state = run_fit(fail_steps=(14, 20), out=out, calls=calls)
    assert calls == [(0, EPOCHS, 10), (1, 2, 7), (2, EPOCHS, 10), (2, EPOCHS, 10)], f"fit calls: {calls}"
    records = ledger.read(out)
    assert [v[2] for _, v in sorted(ledger.starts(records).items())] == [0, 13, 20], ledger.starts(records)
    report = ledger.audit(records, SIZE, EPOCHS)
    assert report["exactly_once"], report
    events = [e["event"] for e in state.events.history]
    assert events.count("rollback") == 2, events
for a, b in zip(weights(failed), weights(reference)):
    assert a.tobytes() == b.tobytes(), "rolled-back fit differs from the uninterrupted one"

# 3. Misuse is reported with the value and the rule.
model, sampler, state = build()
elastic = etf.ElasticCallback(state, load)
try:
    model.fit(elastic.dataset(2), initial_epoch=1, epochs=2, steps_per_epoch=10, callbacks=[elastic], verbose=0)
    raise AssertionError("a fit that starts at another epoch than the committed one must fail")
except StateError as exc:
    assert "epoch 1" in str(exc) and "epoch 0" in str(exc), exc
for bad in (0, -1, 1.5):
    try:
        etf.ElasticCallback(state, load, commit_every=bad)
        raise AssertionError(f"commit_every={bad} accepted")
    except ConfigError as exc:
        assert repr(bad) in str(exc), exc
try:
    elastic.fit(model, epochs=2, steps_per_epoch=3)
    raise AssertionError("steps_per_epoch accepted")
except ConfigError as exc:
    assert "steps_per_epoch" in str(exc), exc
try:
    etf.ElasticCallback(elastic_ext.State(model=model, epoch=0), load)
    raise AssertionError("a State without batch accepted")
except StateError as exc:
    assert "'batch'" in str(exc), exc
model, sampler, state = build(steps_per_execution=2)
try:
    etf.ElasticCallback(state, load).fit(model, epochs=1, verbose=0)
    raise AssertionError("steps_per_execution=2 accepted")
except ConfigError as exc:
    assert "steps_per_execution (2)" in str(exc), exc

# 4. lr_for_size sets the learning rate at the start of every fit call.
model, sampler, state = build()
etf.ElasticCallback(state, load, lr_for_size=lambda size: 0.125 * size).fit(model, epochs=1, verbose=0)
assert float(np.asarray(model.optimizer.learning_rate)) == 0.125, model.optimizer.learning_rate

# 5. The gradient API in a world of one: gradients unchanged, Keras 3 variables accepted.
keras.utils.set_random_seed(1)
net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(net(X[:32])))
plain = tape.gradient(loss, net.trainable_variables)
with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(net(X[:32])))
tape = etf.DistributedGradientTape(tape)
reduced = tape.gradient(loss, net.trainable_variables)
for a, b in zip(plain, reduced):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), "a world of one must not change gradients"
# A tape wrapped anew every step, as users write it, reuses one traced reduction: no retracing per step.
from elastic_ext.tensorflow import gradients as _gradients  # noqa: E402

for _ in range(4):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(net(X[:32])))
    etf.DistributedGradientTape(tape).gradient(loss, net.trainable_variables)
traces = {key: fn.experimental_get_tracing_count() for key, fn in _gradients._EAGER_REDUCTIONS.items()}
assert len(traces) == 1 and list(traces.values()) == [1], f"traced reductions per option set: {traces}"
for kwargs, words in (({"op": hvd.Adasum}, "op"), ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "2.0"),
                      ({"groups": -1}, "groups (-1)"), ({"num_groups": 2, "groups": 2}, "not both")):
    try:
        etf.DistributedGradientTape(tf.GradientTape(), **kwargs)
        raise AssertionError(f"{kwargs} accepted")
    except ConfigError as exc:
        assert words in str(exc), (kwargs, exc)
try:
    etf.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    raise AssertionError("backward_passes_per_step=2 accepted")
except ConfigError as exc:
    assert "backward_passes_per_step (2)" in str(exc), exc
wrapped = etf.DistributedOptimizer(keras.optimizers.SGD(0.1))
assert type(wrapped).__name__ == "SGD" and isinstance(wrapped, keras.optimizers.SGD)

# 6. The numeric guard under fit: a NaN loss at step 14 (epoch 1 batch 4; commit at step 13) rolls back
#    once, skips that batch's samples and finishes with a partial-epoch call that leaves the batch out.
#    The signal rides on the gradient allreduce: the guard runs no collective of its own. The callback
#    times every batch's compute for straggler eviction.
with tempfile.TemporaryDirectory() as out:
    calls = []
    gathered = []
    SoloBinding.allgather = lambda self, array, name: gathered.append(name) or np.array(array, copy=True)
    guarded, state = run_fit(out=out, calls=calls, guard=elastic_ext.NumericGuard(), nan_steps=(14,))
    assert "elastic_ext.policies.guard" not in gathered, f"the guard ran a collective of its own: {gathered}"
    assert calls == [(0, EPOCHS, 10), (1, 2, 6), (2, EPOCHS, 10)], f"fit calls with the guard: {calls}"
    numeric = [e for e in state.events.history if e["event"] == "numeric_rollback"]
    assert len(numeric) == 1, numeric
    assert (numeric[0]["step"], numeric[0]["reason"], numeric[0]["bad_ranks"]) == (14, "nonfinite_loss", [0])
    assert numeric[0]["commit_id"] == 5 and numeric[0]["steps_rolled_back"] == 1, numeric[0]
    assert numeric[0]["skipped"] == [["sampler", 1, 4 * GLOBAL_BATCH, 5 * GLOBAL_BATCH]], numeric[0]
    assert not [e for e in state.events.history if e["event"] in ("rollback", "reset")], "no Horovod reset"
    report = ledger.audit(ledger.read(out), SIZE, EPOCHS)
    assert report["exactly_once"] and [e["skipped"] for e in report["epochs"]] == [0, GLOBAL_BATCH, 0], report
    assert (state.epoch, state.step) == (EPOCHS, 29), (state.epoch, state.step)
    assert all(np.isfinite(w).all() for w in weights(guarded)), "non-finite weights after the rollback"
    median, steps = state.step_timer.report()
    # Every batch since the rollback (a restore discards what was measured before it): steps 13 to 28.
    assert steps == 16 and median is not None and median > 0, (median, steps)
try:
    etf.ElasticCallback(state_on(SoloBinding(), model=model, epoch=0, batch=0, guard=elastic_ext.NumericGuard()),
                        load)
    raise AssertionError("a guard without a step counter accepted")
except StateError as exc:
    assert "'step'" in str(exc), exc
# 7. The signal elastic_ext's tape carries on its gradient allreduce (carrying is on: a State with a guard
#    exists), read once per step, in a custom loop: eagerly and inside tf.function.
from elastic_ext.tensorflow.guard import carried_signal  # noqa: E402

carried_signal()  # drop what fit left
keras.utils.set_random_seed(2)
net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])


def tape_step(scale):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(net(X[:32]))) * scale
    return etf.DistributedGradientTape(tape).gradient(loss, net.trainable_variables), loss


grads, loss = tape_step(tf.constant(1.0))
signal = carried_signal()
expected = float(np.sqrt(sum(float(tf.reduce_sum(tf.square(g))) for g in grads)))
assert signal.loss_finite and signal.grad_finite and signal.bad_ranks == (), signal
assert signal.loss == float(loss) and abs(signal.grad_norm - expected) < 1e-4 * expected, (signal, expected)
assert carried_signal() is None, "a signal is read once"
compiled = tf.function(tape_step)
compiled(tf.constant(float("inf")))
bad = carried_signal()
assert not bad.loss_finite and bad.bad_ranks == (0,) and not bad.grad_finite, bad
compiled(tf.constant(2.0))
again = carried_signal()
assert again.loss_finite and again.grad_finite and again.loss > 0, again
# 8. AutoGraph converts the user's step but none of elastic_ext's or Horovod's code inside it: the
#    gradient reduction is graph code as written, and converting it and Horovod's allreduce cost each
#    worker one to three seconds of CPU at its first trace. The transpiler's cache holds the code
#    objects it converted (TensorFlow's internals: a TF that moves it fails here, not silently).
import horovod  # noqa: E402
from tensorflow.python.autograph.impl import api as autograph_api  # noqa: E402

converted = {code.co_filename for code in autograph_api._TRANSPILER._cache._cache}
assert os.path.abspath(__file__) in converted, f"the user's step was not converted: {converted}"
library = [os.path.dirname(m.__file__) for m in (elastic_ext, horovod)]
assert not [f for f in converted if any(f.startswith(d + os.sep) for d in library)], converted
print("ok")
