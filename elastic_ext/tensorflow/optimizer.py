"""The Keras ``DistributedOptimizer``: a Keras 2 or 3 optimizer that allreduces gradients.

Owns the choice of where each Keras's ``fit`` lets gradients be reduced (a
subclass of the user's optimizer class, one per class and Keras flavour) and
the wrapper function with Horovod's arguments; the reduction itself is
:mod:`elastic_ext.tensorflow.gradients`'s reducer, shared with the tape.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import horovod.tensorflow as hvd
from horovod.tensorflow.compression import Compression

from elastic_ext.errors import ConfigError
from elastic_ext.tensorflow.gradients import _GradientReducer, _groups_argument

logger = logging.getLogger(__name__)

__all__ = ["DistributedOptimizer"]


def _keras_module_of(optimizer: Any) -> str:
    """"keras3" or "keras2" (tf_keras, or the "keras" package of TF < 2.16)."""
    for base in type(optimizer).__mro__:
        module = base.__module__ or ""
        if module.startswith("tf_keras"):
            return "keras2"
        if module == "keras" or module.startswith("keras."):
            import keras
            return "keras3" if keras.__version__.split(".")[0] == "3" else "keras2"
    raise ConfigError(f"optimizer ({type(optimizer).__name__} from {type(optimizer).__module__}) must be a "
                      "Keras 3 or a tf_keras (Keras 2) optimizer")


_OPTIMIZER_CLASSES: Dict[tuple, type] = {}


def _optimizer_class(base: type, flavour: str) -> type:
    key = (base, flavour)
    cls = _OPTIMIZER_CLASSES.get(key)
    if cls is not None:
        return cls
    if flavour == "keras3":
        class _Keras3Distributed(base):  # type: ignore[valid-type, misc]
            # Keras 3's model.fit computes gradients with its own tape and
            # calls apply_gradients(), which goes through apply(): reducing
            # here is the one place every Keras 3 path passes, once.
            def scale_loss(self, loss):
                # fit's train_step hands the loss here before the gradients: the guard's signal
                # rides on their allreduce in apply() (elastic_ext.tensorflow.guard).
                self._elastic_reducer.loss = loss
                return super().scale_loss(loss)

            def apply(self, grads, trainable_variables=None):
                variables = self._trainable_variables if trainable_variables is None else trainable_variables
                grads = self._elastic_reducer(list(grads), list(variables), loss=self._elastic_reducer.take_loss())
                return super().apply(grads, trainable_variables)

            def register_local_var(self, var: Any) -> None:
                """Marks ``var`` as rank-local: its gradient is not allreduced."""
                self._elastic_reducer.register_local(var)
        cls = _Keras3Distributed
    elif hasattr(base, "compute_gradients"):
        class _Keras2Distributed(base):  # type: ignore[valid-type, misc]
            # As Horovod: tf_keras's model.fit calls minimize(), which calls
            # compute_gradients(); gradients are reduced there.
            def compute_gradients(self, loss, var_list, tape=None):
                pairs = list(super().compute_gradients(loss, var_list, tape))
                variables = [v for _, v in pairs]
                loss = None if callable(loss) else loss  # the guard's signal rides along with a loss tensor
                return list(zip(self._elastic_reducer([g for g, _ in pairs], variables, loss=loss), variables))

            def register_local_var(self, var: Any) -> None:
                """Marks ``var`` as rank-local: its gradient is not allreduced."""
                self._elastic_reducer.register_local(var)
        cls = _Keras2Distributed
    else:
        class _Keras2LegacyDistributed(base):  # type: ignore[valid-type, misc]
            def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
                pairs = list(super()._compute_gradients(loss, var_list, grad_loss, tape=tape))
                variables = [v for _, v in pairs]
                loss = None if callable(loss) else loss
                return list(zip(self._elastic_reducer([g for g, _ in pairs], variables, loss=loss), variables))

            def get_gradients(self, loss, params):
                return self._elastic_reducer(super().get_gradients(loss, params), params)

            def register_local_var(self, var: Any) -> None:
                """Marks ``var`` as rank-local: its gradient is not allreduced."""
                self._elastic_reducer.register_local(var)
        cls = _Keras2LegacyDistributed
    # The user's class name, so that a saved model loads without elastic_ext.
    cls.__name__ = cls.__qualname__ = base.__name__
    _OPTIMIZER_CLASSES[key] = cls
    return cls


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = hvd.Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: Any = hvd.global_process_set, scale_local_gradients: bool = True) -> Any:
    """A Keras optimizer that allreduces gradients, for ``model.compile``.

    Same arguments as ``horovod.tensorflow.keras.DistributedOptimizer``. Takes
    a Keras 3 or a tf_keras (Keras 2) optimizer and returns a new optimizer of
    the same class built from ``optimizer.get_config()``, as Horovod does.
    Where the reduction happens follows each Keras's ``fit``: in
    ``compute_gradients()`` (``minimize``) on Keras 2, exactly like Horovod,
    and in ``apply()`` (so ``apply_gradients``) on Keras 3, whose ``fit``
    never calls a gradient hook. In a hand-written loop use
    :func:`DistributedGradientTape` with a plain optimizer instead, on both.
    Keras 3 compiles ``fit`` with XLA on accelerators by default: pass
    ``jit_compile=False`` to ``compile`` there, Horovod's ops have no XLA kernel.

    Raises:
        ConfigError: not a Keras optimizer, already distributed,
            ``backward_passes_per_step`` > 1 (local gradient aggregation is
            not implemented: use ``ElasticSampler(micro_batch_size=...)``),
            ``op=Adasum``, or an option Horovod also rejects.
    """
    flavour = _keras_module_of(optimizer)
    base = type(optimizer)
    if base in _OPTIMIZER_CLASSES.values():
        raise ConfigError(f"optimizer ({base.__name__}) is already a DistributedOptimizer")
    if backward_passes_per_step != 1:
        raise ConfigError(f"backward_passes_per_step ({backward_passes_per_step}) must be 1: local gradient "
                          "aggregation is not implemented; use ElasticSampler(micro_batch_size=...) instead")
    if average_aggregated_gradients:
        logger.debug("average_aggregated_gradients has no effect with backward_passes_per_step=1")
    reducer = _GradientReducer(name or f"Distributed{base.__name__}", device_dense, device_sparse, compression,
                               sparse_as_dense, op, gradient_predivide_factor, _groups_argument(num_groups, groups),
                               process_set, scale_local_gradients)
    distributed = _optimizer_class(base, flavour).from_config(optimizer.get_config())
    distributed._elastic_reducer = reducer
    return distributed
