"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns allreduced gradients.

Takes the arguments of ``horovod.tensorflow.DistributedGradientTape`` and
works with ``tf.Variable``, Keras 2 and Keras 3 variables as sources; the
reduction is :mod:`elastic_ext.tensorflow.gradients`'s reducer, which also
carries the numeric guard's signal when the target is a single loss.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import tensorflow as tf

import horovod.tensorflow as hvd
from horovod.tensorflow.compression import Compression

from elastic_ext.errors import ConfigError
from elastic_ext.tensorflow.gradients import _GradientReducer, _groups_argument, _variable_key

__all__ = ["DistributedGradientTape"]


class _DistributedGradientTapeMixin:
    """Methods added to the user's tape class: gradients come back allreduced."""

    _elastic_reducer: _GradientReducer

    @tf.autograph.experimental.do_not_convert  # as the reducer's call (gradients.py)
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False, **kwargs: Any) -> Any:
        gradients = super().gradient(target, sources, output_gradients, **kwargs)  # type: ignore[misc]
        targets = tf.nest.flatten(target)
        loss = targets[0] if len(targets) == 1 else None  # a single loss: the guard's signal rides along
        reduced = self._elastic_reducer(tf.nest.flatten(gradients), tf.nest.flatten(sources), use_generic_names,
                                        loss=loss)
        return tf.nest.pack_sequence_as(gradients, reduced)

    def register_local_source(self, source: Any) -> None:
        """Marks ``source`` (a variable) as rank-local: its gradient is not allreduced."""
        self._elastic_reducer.register_local(source)

    def get_local_and_global_gradients(self, target: Any, sources: Sequence[Any], output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple:
        """``([(local source, grad)], [(global source, grad)])``, as Horovod's tape returns them."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for source, grad in zip(sources, grads):
            (local if _variable_key(source) in self._elastic_reducer.local else shared).append((source, grad))
        return local, shared


_TAPE_CLASSES: Dict[type, type] = {}


def _tape_class(base: type) -> type:
    cls = _TAPE_CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedGradientTapeMixin, base), {"__module__": __name__})
        _TAPE_CLASSES[base] = cls
    return cls


@tf.autograph.experimental.do_not_convert  # called inside users' traced steps: nothing to convert
def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Any = Compression.none, sparse_as_dense: bool = False,
                            op: Any = hvd.Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Any = None,
                            process_set: Any = hvd.global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wraps a recorded ``tf.GradientTape`` so that ``gradient()`` returns allreduced gradients.

    Same arguments as ``horovod.tensorflow.DistributedGradientTape``; works
    with ``tf.Variable``, Keras 2 and Keras 3 variables as sources::

        with tf.GradientTape() as tape:
            loss = ...
        tape = elastic_ext.tensorflow.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    The tape passed in is the one returned (its class gains the allreducing
    ``gradient()``), so it keeps its recording and persistence.

    Raises:
        ConfigError: not a tape, or an option that Horovod also rejects
            (e.g. a predivide factor without ``op=Average``); ``op=Adasum``.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigError(f"gradtape ({type(gradtape).__name__}) must be a tf.GradientTape")
    if isinstance(gradtape, _DistributedGradientTapeMixin):
        raise ConfigError("gradtape is already a DistributedGradientTape")
    reducer = _GradientReducer("DistributedGradientTape", device_dense, device_sparse, compression,
                               sparse_as_dense, op, gradient_predivide_factor, _groups_argument(num_groups, groups),
                               process_set, scale_local_gradients)
    gradtape.__class__ = _tape_class(type(gradtape))
    gradtape._elastic_reducer = reducer  # type: ignore[attr-defined]
    return gradtape
