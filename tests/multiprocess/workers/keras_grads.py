"""Gradient API checks: elastic_ext's DistributedGradientTape / DistributedOptimizer against Horovod's.

Run by keras_fit.py --grad-checks on every rank at the end of its job (a
world of 2 or more: each rank trains on rows of its own, so an unreduced
gradient would differ between ranks). Writes ``<out>/grads-<rank>.json``:
per comparison, whether the two results are bitwise equal and their largest
absolute difference.

Keras 2 (tf_keras): against Horovod's own wrappers, which work there.
Keras 3: Horovod's wrappers fail on Keras 3 variables (#4290); the
reference is the per-tensor ``hvd.allreduce`` a Horovod user writes by hand.
"""

import hashlib
import json
import os

import numpy as np
import tensorflow as tf
from examples.digits import load_digits

import horovod.tensorflow as hvd

import elastic_ext.tensorflow as etf


def check(out, keras):
    """Runs every comparison with ``keras`` (tf_keras or Keras 3, the module) and writes this rank's results."""
    version = keras.__version__[0]
    rank = hvd.rank()
    digits = load_digits()
    rows = np.arange(rank * 96, rank * 96 + 96)  # different data on every rank
    X = tf.constant(digits.data[rows] / 16.0, dtype=tf.float32)
    Y = tf.constant(digits.target[rows], dtype=tf.int64)
    TOKENS = tf.constant((digits.data[rows, :8]).astype(np.int64))  # embedding input: sparse gradients
    results = {}

    def model_fn():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((8,), dtype="int64")
        pixels = keras.Input((64,))
        embedded = keras.layers.Flatten()(keras.layers.Embedding(17, 3)(tokens))
        hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([pixels, embedded]))
        return keras.Model([tokens, pixels], keras.layers.Dense(10)(hidden))

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compare(name, ours, reference):
        ours = [np.asarray(tf.convert_to_tensor(g)) for g in ours]
        reference = [np.asarray(tf.convert_to_tensor(g)) for g in reference]
        assert len(ours) == len(reference), name
        bitwise = all(a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(ours, reference))
        diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) for a, b in zip(ours, reference))
        results[name] = {"bitwise": bitwise, "max_abs_diff": diff,
                         "checksum": float(sum(np.abs(a).sum() for a in ours))}

    def tape_gradients(model, wrap, **kwargs):
        with tf.GradientTape() as tape:
            loss = loss_fn(Y, model([TOKENS, X], training=True))
        tape = wrap(tape, **kwargs)
        return tape.gradient(loss, model.trainable_variables)

    def local_gradients(model):
        with tf.GradientTape() as tape:
            loss = loss_fn(Y, model([TOKENS, X], training=True))
        return tape.gradient(loss, model.trainable_variables)

    def by_hand(grads, op=hvd.Average):
        return [hvd.allreduce(g, op=op) for g in grads]

    model = model_fn()
    variants = {
        "tape_average": {},
        "tape_sum": {"op": hvd.Sum},
        # Horovod refuses scale factors on sparse gradients: densify them here.
        "tape_predivide": {"gradient_predivide_factor": 2.0, "sparse_as_dense": True},
        "tape_groups": {"groups": 2},
        "tape_sparse_as_dense": {"sparse_as_dense": True},
    }
    for name, kwargs in variants.items():
        ours = tape_gradients(model, etf.DistributedGradientTape, **kwargs)
        if version == "2":
            reference = tape_gradients(model, hvd.DistributedGradientTape, **kwargs)
        else:
            local = local_gradients(model)
            if kwargs.get("sparse_as_dense"):
                local = [tf.convert_to_tensor(g) for g in local]
            if "gradient_predivide_factor" in kwargs:
                factor = kwargs["gradient_predivide_factor"]
                reference = [hvd.allreduce(g, op=hvd.Average, prescale_factor=1.0 / factor, postscale_factor=factor)
                             for g in local]
            else:
                reference = by_hand(local, kwargs.get("op", hvd.Average))
        compare(name, ours, reference)

    # A local source: its gradient stays local, divided by the size (Horovod's rule).
    with tf.GradientTape() as tape:
        loss = loss_fn(Y, model([TOKENS, X], training=True))
    tape = etf.DistributedGradientTape(tape)
    local_var = model.trainable_variables[-1]
    tape.register_local_source(local_var)
    ours = tape.gradient(loss, model.trainable_variables)
    local = local_gradients(model)
    expected = by_hand(local[:-1]) + [local[-1] / hvd.size()]
    compare("tape_local_source", ours, expected)
    # (Not against Horovod's own tape here: in an elastic job, HOROVOD_ELASTIC=1, Horovod 0.28.1
    # divides a local source's float gradient by an int32 size tensor and raises a TypeError.)

    def fit_weights(wrap_optimizer):
        fitted = model_fn()
        fitted.compile(optimizer=wrap_optimizer(keras.optimizers.Adam(0.01)), loss=loss_fn, jit_compile=False)
        data = tf.data.Dataset.from_tensor_slices(((TOKENS, X), Y)).batch(32)
        fitted.fit(data, epochs=2, verbose=0, shuffle=False)
        return fitted.get_weights()

    ours = fit_weights(etf.DistributedOptimizer)
    if version == "2":
        import horovod.tensorflow.keras as hvd_keras
        compare("fit_optimizer_vs_horovod", ours, fit_weights(hvd_keras.DistributedOptimizer))
    else:
        # The same steps by hand: the tape's loss, allreduce each gradient, apply.
        manual = model_fn()
        optimizer = keras.optimizers.Adam(0.01)
        data = tf.data.Dataset.from_tensor_slices(((TOKENS, X), Y)).batch(32)
        for _ in range(2):
            for (tokens, pixels), labels in data:
                with tf.GradientTape() as tape:
                    loss = loss_fn(labels, manual([tokens, pixels], training=True))
                grads = by_hand(tape.gradient(loss, manual.trainable_variables))
                optimizer.apply_gradients(zip(grads, manual.trainable_variables))
        compare("fit_optimizer_vs_by_hand", ours, manual.get_weights())
    # Unreduced training must differ: proves the comparisons above see the reduction.
    compare("fit_without_reduction", fit_weights(lambda opt: opt), ours)
    # Ranks agree with each other: written out, compared by the test.
    results["fit_weights_sha256"] = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in ours)).hexdigest()
    with open(os.path.join(out, f"grads-{rank}.json"), "w") as handle:
        json.dump(results, handle)

