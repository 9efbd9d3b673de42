"""The numeric guard's local signal for TensorFlow: loss, finiteness and gradient norm.

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
"""

from __future__ import annotations

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
