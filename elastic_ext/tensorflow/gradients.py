"""Horovod's TF2 gradient reduction for Keras 2 (tf_keras) and Keras 3 variables.

Owns the gradient reducer (options, grouping, allreduce) and
``DistributedGradientTape``; the Keras ``DistributedOptimizer`` built on the
same reducer is in :mod:`elastic_ext.tensorflow.optimizer`. Both take the
arguments of ``horovod.tensorflow.DistributedGradientTape`` and
``horovod.tensorflow.keras.DistributedOptimizer``, so a Horovod script moves
over by changing its imports. Horovod's own versions key variables with
``Variable.ref()``, which Keras 3 variables do not have
(``AttributeError: 'Variable' object has no attribute 'ref'``,
horovod/horovod#4290). Here a variable is only ever used as a dictionary key
through :func:`_variable_key`, and the reduction itself is Horovod's public
``allreduce`` / ``grouped_allreduce`` with the same op and scale factors as
Horovod's wrappers, so the numbers are Horovod's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

import horovod.tensorflow as hvd
from horovod.tensorflow.compression import Compression

from elastic_ext.errors import ConfigError

__all__ = ["DistributedGradientTape"]


def _variable_key(variable: Any) -> Any:
    """A hashable key for a variable that is stable while the variable lives.

    ``tf.Variable.ref()`` where it exists (tf.Variable, Keras 2 variables);
    Keras 3 variables are plain Python objects with identity semantics, so
    the object itself is the key (its ``__hash__`` is ``id``-based).
    """
    ref = getattr(variable, "ref", None)
    if callable(ref):
        return ref()
    return ("id", id(variable))


def _check_options(op: Any, gradient_predivide_factor: float, groups: Any) -> None:
    if op not in (hvd.Average, hvd.Sum):
        # Adasum needs Horovod's delta optimizer, which is not reproduced here.
        raise ConfigError(f"op ({op!r}) must be hvd.Average or hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ConfigError(f"gradient_predivide_factor ({gradient_predivide_factor}) other than 1.0 "
                          f"needs op=hvd.Average (got {op!r}), as in Horovod")
    if groups is None:
        return
    if isinstance(groups, bool) or not isinstance(groups, (int, list)):
        raise ConfigError(f"groups ({groups!r}) must be an integer > 0 or a list of lists of variables")
    if isinstance(groups, int) and groups <= 0:
        raise ConfigError(f"groups ({groups}) must be > 0 when it is a number")
    if isinstance(groups, list) and not all(isinstance(g, (list, tuple)) for g in groups):
        raise ConfigError("groups must be a list of lists of variables when it is a list")


def _groups_argument(num_groups: int, groups: Any) -> Any:
    """Horovod's deprecated ``num_groups`` is ``groups`` given as a number."""
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ConfigError(f"num_groups ({num_groups!r}) must be an integer >= 0")
    if num_groups:
        if groups is not None:
            raise ConfigError(f"give num_groups ({num_groups}) or groups ({groups!r}), not both")
        return num_groups
    return groups


def _split(items: List[Any], parts: int) -> List[List[Any]]:
    """``items`` in ``parts`` consecutive runs whose lengths differ by at most one."""
    parts = min(parts, len(items))
    base, extra = divmod(len(items), parts)
    runs, start = [], 0
    for part in range(parts):
        length = base + (1 if part < extra else 0)
        runs.append(items[start:start + length])
        start += length
    return runs


class _GradientReducer:
    """Allreduces a list of gradients the way Horovod's wrappers do.

    For ``op=Average`` the average is split over a prescale of
    ``1/gradient_predivide_factor`` and a postscale of
    ``gradient_predivide_factor`` (Horovod's backend divides by the size).
    Gradients of registered local variables are not reduced; with
    ``scale_local_gradients`` they are divided by the size. Whether to reduce
    at all (more than one rank) is decided by a graph op, never at trace
    time: a traced training step outlives resizes.
    """

    def __init__(self, name: str, device_dense: str, device_sparse: str, compression: Any,
                 sparse_as_dense: bool, op: Any, gradient_predivide_factor: float, groups: Any,
                 process_set: Any, scale_local_gradients: bool) -> None:
        _check_options(op, gradient_predivide_factor, groups)
        self.name = name
        self.device_dense = device_dense
        self.device_sparse = device_sparse
        self.compression = compression
        self.sparse_as_dense = bool(sparse_as_dense)
        self.op = op
        if op == hvd.Average:
            self.prescale, self.postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        else:
            self.prescale, self.postscale = 1.0, 1.0
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        # key -> variable: holding the variable keeps an id()-based key unique.
        self.local: Dict[Any, Any] = {}
        self._graph_fns: Dict[bool, Callable] = {}

    def register_local(self, variable: Any) -> None:
        self.local[_variable_key(variable)] = variable

    def __call__(self, grads: Sequence[Any], variables: Sequence[Any], use_generic_names: bool = False) -> List[Any]:
        grads = list(grads)
        variables = list(variables)
        if len(variables) != len(grads):
            raise ConfigError(f"{len(grads)} gradients for {len(variables)} variables: they must pair up")
        shared = [i for i, v in enumerate(variables) if _variable_key(v) not in self.local]
        out = list(grads)
        reduced = self._reduce([grads[i] for i in shared], [variables[i] for i in shared], use_generic_names)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local_gradients and self.local:
            size = self._size_op()
            for i, v in enumerate(variables):
                if _variable_key(v) in self.local and grads[i] is not None:
                    out[i] = _divide(grads[i], size)
        return out

    def _size_op(self) -> tf.Tensor:
        return hvd.size_op(process_set_id=self.process_set.process_set_id)

    def _reduce(self, grads: List[Any], variables: List[Any], generic: bool) -> List[Any]:
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        runs = self._runs(present, variables)
        tensors = [grads[i] for i in present]
        positions = {i: k for k, i in enumerate(present)}
        local_runs = tuple(tuple(positions[i] for i in run) for run in runs) if runs is not None else None
        if tf.executing_eagerly():
            # One graph for all tensors, as Horovod does: their collectives are
            # enqueued together instead of one eager op at a time.
            fn = self._graph_fns.get(generic)
            if fn is None:
                fn = tf.function(lambda ts, rs: self._reduce_graph(ts, rs, generic), reduce_retracing=True)
                self._graph_fns[generic] = fn
            reduced = list(fn(tensors, local_runs))
        else:
            reduced = self._reduce_graph(tensors, local_runs, generic)
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        return out

    def _runs(self, present: List[int], variables: List[Any]) -> Optional[List[List[int]]]:
        """Indices grouped for grouped_allreduce, or None for one allreduce per tensor."""
        if self.groups is None:
            return None
        if isinstance(self.groups, int):
            return _split(present, self.groups)
        position = {_variable_key(variables[i]): i for i in present}
        runs: List[List[int]] = []
        taken = set()
        for group in self.groups:
            run = [position[_variable_key(v)] for v in group if _variable_key(v) in position]
            taken.update(run)
            if run:
                runs.append(run)
        runs.extend([i] for i in present if i not in taken)
        return runs

    def _more_than_one_rank(self) -> tf.Tensor:
        with tf.device("cpu"):
            return tf.logical_and(
                tf.equal(hvd.process_set_included_op(self.process_set.process_set_id), 1),
                tf.greater(self._size_op(), 1))

    def _reduce_graph(self, tensors: List[Any], runs: Optional[tuple], generic: bool) -> List[Any]:
        with tf.name_scope(self.name + "_Allreduce"):
            if runs is None:
                return [self._cond(lambda t=t, i=i: self._allreduce(t, i, generic), t)
                        for i, t in enumerate(tensors)]
            out: List[Any] = [None] * len(tensors)
            for number, run in enumerate(runs):
                members = [tensors[i] for i in run]
                reduced = self._cond(lambda m=members, n=number: self._grouped(m, n, generic), members)
                for i, value in zip(run, tf.nest.flatten(reduced, expand_composites=False)):
                    out[i] = value
            return out

    def _cond(self, reduce_fn: Callable[[], Any], identity: Any) -> Any:
        return tf.cond(self._more_than_one_rank(), reduce_fn, lambda: identity)

    def _allreduce(self, tensor: Any, index: int, generic: bool) -> Any:
        return hvd.allreduce(tensor, device_dense=self.device_dense, device_sparse=self.device_sparse,
                             compression=self.compression, op=self.op, prescale_factor=self.prescale,
                             postscale_factor=self.postscale, process_set=self.process_set,
                             name=f"grad_{index}" if generic else None, ignore_name_scope=generic)

    def _grouped(self, tensors: List[Any], index: int, generic: bool) -> List[Any]:
        return hvd.grouped_allreduce(tensors, device_dense=self.device_dense, device_sparse=self.device_sparse,
                                     compression=self.compression, op=self.op, prescale_factor=self.prescale,
                                     postscale_factor=self.postscale, process_set=self.process_set,
                                     name=f"grad_{index}" if generic else None, ignore_name_scope=generic)


def _divide(grad: Any, size: tf.Tensor) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(size, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad / tf.cast(size, grad.dtype)


# ---------------------------------------------------------------------------- tape


class _DistributedGradientTapeMixin:
    """Methods added to the user's tape class: gradients come back allreduced."""

    _elastic_reducer: _GradientReducer

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False, **kwargs: Any) -> Any:
        gradients = super().gradient(target, sources, output_gradients, **kwargs)  # type: ignore[misc]
        reduced = self._elastic_reducer(tf.nest.flatten(gradients), tf.nest.flatten(sources), use_generic_names)
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
