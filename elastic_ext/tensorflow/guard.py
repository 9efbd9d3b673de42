"""The numeric guard's signal for TensorFlow: the local row, and the signal carried on the gradient allreduce.

:func:`local_row` builds the 5 numbers of
:class:`elastic_ext.policies.numeric_signal.LocalSignal` as one ``(1, 5)`` float64 tensor; it
works inside ``tf.function`` (return the row from the compiled step) and
eagerly. :func:`agree_step` then runs the guard's one collective, a Horovod
allgather of that row, through
:class:`elastic_ext.tensorflow.binding.TensorFlowBinding` (a failed
allgather becomes ``HorovodInternalError``).

Use the gradients after the allreduce (``DistributedGradientTape``) to see
the averaged gradients, or this rank's own to tell which rank's batch went
bad; compute the row before applying them to keep a bad step out of the
weights.

With elastic_ext's own gradient reduction (:mod:`elastic_ext.tensorflow.gradients`)
the guard needs neither: the signal rides on the gradient allreduce
(:func:`carry_vector`, :func:`record`) and ``state.guard_step`` reads it
(:func:`carried_signal`), as does ``ElasticCallback`` under ``model.fit``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Union

import numpy as np
import tensorflow as tf

from elastic_ext.policies.numeric_signal import GlobalSignal, agree


def _squared_norm(grads: Iterable[Any]) -> tf.Tensor:
    """Sum of squares of every gradient in float32 (``IndexedSlices`` by their values; None skipped)."""
    total = tf.constant(0.0, dtype=tf.float32)
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = grad.values
        total += tf.reduce_sum(tf.square(tf.cast(grad, tf.float32)))
    return total


def _bad(value: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.logical_not(tf.math.is_finite(value)), tf.float64)


def local_row(loss: Union[tf.Tensor, float], grads: Iterable[Any] = (),
              samples: Union[int, tf.Tensor] = 1) -> tf.Tensor:
    """This rank's ``(1, 5)`` float64 row: loss, samples, loss bad, gradient bad, squared gradient norm.

    The squared norm is summed in float32, so a sum that overflows counts as
    a non-finite gradient. Graph-safe.
    """
    loss_value = tf.cast(tf.reshape(loss, [-1])[0], tf.float64)
    grad_sq = tf.cast(_squared_norm(grads), tf.float64)
    row = tf.stack([loss_value, tf.cast(samples, tf.float64), _bad(loss_value), _bad(grad_sq), grad_sq])
    return tf.reshape(row, [1, 5])


def agree_step(loss: Union[tf.Tensor, float], grads: Iterable[Any] = (), samples: Union[int, tf.Tensor] = 1,
               binding: Optional[Any] = None) -> GlobalSignal:
    """The step's :class:`~elastic_ext.policies.numeric_signal.GlobalSignal`, identical on every rank (one allgather). Eager.

    Raises:
        HorovodInternalError: the allgather failed (a peer is gone).
    """
    if binding is None:
        from elastic_ext.tensorflow.binding import TensorFlowBinding
        binding = TensorFlowBinding()
    return agree(binding, np.asarray(local_row(loss, grads, samples).numpy(), dtype=np.float64))


# ------------------------------------------------------------ carried on the gradient allreduce
#
# With elastic_ext's gradient reduction (DistributedGradientTape, the Keras DistributedOptimizer)
# the guard needs no collective of its own: the reducer appends a small float32 vector to the
# step's gradients (the same op and scale factors, so Horovod fuses it with them) and records the
# reduced vector, with the squared norm of the reduced gradients, in the variables below. The
# reduced vector and gradients are the same bits on every rank, so every rank reads the same signal.
# Vector: [loss (0 if not finite), 1, one-hot of this rank if its loss is not finite (size values)].

_CARRY = {"on": False, "read": 0}
_VARIABLES: dict = {}


def enable_carry() -> None:
    """Makes elastic_ext's gradient reduction carry the guard's signal from now on (a State with a
    guard calls it, before the training step is traced)."""
    _CARRY["on"] = True


def carrying() -> bool:
    return _CARRY["on"]


def ensure_variables() -> None:
    """Creates the variables the gradient reduction writes (the guard's signal, the straggler timing),
    once per process. Call it eagerly, before any ``tf.function`` that reduces gradients is traced
    (a State's TensorFlow adapters do, when it is made): a ``tf.function`` may create variables only on its
    first call, and a step traced again (another argument, a new world size) is not a first call."""
    _variables()


def _variables() -> dict:
    if not _VARIABLES:
        # Lifted out of a trace all the same: a reduction used with no State, on its first trace.
        with tf.init_scope():
            _VARIABLES["signal"] = tf.Variable(tf.zeros([0], tf.float32), shape=tf.TensorShape([None]),
                                               trainable=False, name="elastic_ext_guard_signal")
            _VARIABLES["count"] = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="elastic_ext_guard_count")
            _VARIABLES["ready_at"] = tf.Variable(tf.constant(0.0, tf.float64), trainable=False,
                                                 name="elastic_ext_grads_ready_at")
    return _VARIABLES


def carry_vector(loss: Any) -> tf.Tensor:
    """This rank's vector to reduce with the gradients (graph-safe; the world size is read at run time)."""
    import horovod.tensorflow as hvd

    value = tf.cast(tf.reshape(loss, [-1])[0], tf.float32)
    finite = tf.math.is_finite(value)
    bad = tf.one_hot(hvd.rank_op(), tf.cast(hvd.size_op(), tf.int32), dtype=tf.float32) * tf.cast(
        tf.logical_not(finite), tf.float32)
    return tf.concat([tf.stack([tf.where(finite, value, 0.0), tf.constant(1.0)]), bad], 0)


def grads_ready_at(grads: Iterable[Any]) -> tf.Tensor:
    """The time (``time.time()`` seconds) at which this rank's local gradients are computed."""
    dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
    with tf.control_dependencies(dense):
        return tf.timestamp()


def record_ready(ready_at: tf.Tensor) -> None:
    """Stores when this step's local gradients were ready (``ElasticCallback`` times the compute with it)."""
    _variables()["ready_at"].assign(ready_at, read_value=False)


def record(reduced_vector: tf.Tensor, reduced_grads: Iterable[Any]) -> None:
    """Stores a step's reduced vector, the reduced gradients' squared norm and whether every element
    of them is finite (exact, whatever the summation order: the decision rests on it), for
    :func:`carried_signal`."""
    variables = _variables()
    dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in reduced_grads if g is not None]
    finite = tf.reduce_all(tf.stack([tf.constant(True)] + [tf.reduce_all(tf.math.is_finite(g)) for g in dense]))
    tail = tf.stack([_squared_norm(dense), tf.cast(finite, tf.float32)])
    variables["signal"].assign(tf.concat([tf.cast(reduced_vector, tf.float32), tail], 0), read_value=False)
    variables["count"].assign_add(1, read_value=False)


def carried_signal() -> Optional[GlobalSignal]:
    """The signal carried on the newest gradient allreduce, if none was read since; else None."""
    if not _VARIABLES:
        return None
    count = int(_VARIABLES["count"].numpy())
    if count == _CARRY["read"]:
        return None
    _CARRY["read"] = count
    return decode(_VARIABLES["signal"].numpy())


def grads_ready_time() -> Optional[float]:
    """When the newest carried step's local gradients were ready (``time.time()``), None before one."""
    return float(_VARIABLES["ready_at"].numpy()) if _VARIABLES else None


def decode(stored: np.ndarray) -> GlobalSignal:
    """The :class:`GlobalSignal` of a stored vector: reduced ``[loss sum, count, bad one-hot...]``, then
    the reduced gradients' squared norm and finite flag (an average divides the loss sum and the count
    alike: the mean is unchanged)."""
    stored = np.asarray(stored, dtype=np.float64)
    loss_sum, count, bad, grad_sq = stored[0], stored[1], stored[2:-2], stored[-2]
    bad_loss = tuple(int(r) for r in np.flatnonzero(bad != 0))
    grad_finite = bool(stored[-1] == 1.0)
    loss = float(loss_sum / count) if count > 0 and not bad_loss else float("nan")
    bad_ranks = bad_loss or (() if grad_finite else tuple(range(bad.size)))
    return GlobalSignal(loss=loss, loss_finite=not bad_loss and math.isfinite(loss), grad_finite=grad_finite,
                        grad_norm=math.sqrt(grad_sq) if grad_finite and np.isfinite(grad_sq) else None,
                        bad_ranks=bad_ranks)
