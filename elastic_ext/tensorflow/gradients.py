"""Horovod's TF2 gradient reduction for Keras 2 (tf_keras) and Keras 3 variables.

Owns the gradient reducer (options, grouping, allreduce, the numeric
guard's signal riding along); ``DistributedGradientTape``
(:mod:`elastic_ext.tensorflow.tape`) and the Keras ``DistributedOptimizer``
(:mod:`elastic_ext.tensorflow.optimizer`) are built on it. Both take the
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

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

import horovod.tensorflow as hvd

from elastic_ext.errors import ConfigError
from elastic_ext.tensorflow import guard as _guard

__all__ = ["_GradientReducer", "_groups_argument", "_variable_key"]


# Eager reductions, traced once per set of options and shared by the reducers
# that have them: a DistributedGradientTape is wrapped anew every step, and a
# tf.function of its own would be traced anew every step (a quarter of a
# second a step in the TF numeric-guard test's job, and TensorFlow's retracing
# warnings).
_EAGER_REDUCTIONS: Dict[tuple, Callable] = {}


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
        self.loss: Any = None  # a Keras 3 optimizer's step loss, between scale_loss() and apply()

    def take_loss(self) -> Any:
        """The loss ``scale_loss`` handed over for this step, if it belongs to the context running now."""
        loss, self.loss = self.loss, None
        if loss is None or tf.executing_eagerly() != (not tf.is_symbolic_tensor(loss)):
            return None
        return loss if tf.executing_eagerly() or loss.graph is tf.compat.v1.get_default_graph() else None

    def register_local(self, variable: Any) -> None:
        self.local[_variable_key(variable)] = variable

    # Graph-safe as written (explicit tf.cond, Python conditions on Python values only): AutoGraph
    # would only spend a second or two converting this module and Horovod's allreduce inside the
    # first trace of a user's step (docs/keras.md).
    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads: Sequence[Any], variables: Sequence[Any], use_generic_names: bool = False,
                 loss: Any = None) -> List[Any]:
        """The reduced gradients. With ``loss`` (the step's, this rank's) while a State with a numeric
        guard exists, the guard's signal rides on the same allreduce (:mod:`elastic_ext.tensorflow.guard`)."""
        grads = list(grads)
        variables = list(variables)
        if len(variables) != len(grads):
            raise ConfigError(f"{len(grads)} gradients for {len(variables)} variables: they must pair up")
        shared = [i for i, v in enumerate(variables) if _variable_key(v) not in self.local]
        out = list(grads)
        _guard.record_ready(_guard.grads_ready_at(grads))  # this rank's compute ends here (straggler timing)
        carry = loss is not None and _guard.carrying()
        reduced = self._reduce([grads[i] for i in shared], [variables[i] for i in shared], use_generic_names,
                               _guard.carry_vector(loss) if carry else None)
        if carry:
            *reduced, vector = reduced
            _guard.record(vector, reduced)
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

    def _reduce(self, grads: List[Any], variables: List[Any], generic: bool, extra: Any = None) -> List[Any]:
        """The reduced ``grads``, then the reduced ``extra`` if given (reduced with them: the same
        op and scale factors, in the last group when there are groups, so Horovod fuses them)."""
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present and extra is None:
            return grads
        runs = self._runs(present, variables)
        tensors = [grads[i] for i in present]
        positions = {i: k for k, i in enumerate(present)}
        local_runs = tuple(tuple(positions[i] for i in run) for run in runs) if runs is not None else None
        if extra is not None:
            tensors.append(extra)
            if local_runs:
                local_runs = local_runs[:-1] + (local_runs[-1] + (len(tensors) - 1,),)
            elif local_runs is not None:
                local_runs = ((len(tensors) - 1,),)
        if tf.executing_eagerly():
            # One graph for all tensors, as Horovod does: their collectives are
            # enqueued together instead of one eager op at a time.
            reduced = list(self._eager_reduction(generic)(tensors, local_runs))
        else:
            reduced = self._reduce_graph(tensors, local_runs, generic)
        out = list(grads)
        for i, g in zip(present, reduced):
            out[i] = g
        return out + ([reduced[-1]] if extra is not None else [])

    def _eager_reduction(self, generic: bool) -> Callable:
        """The traced reduction for this reducer's options (:data:`_EAGER_REDUCTIONS`)."""
        key = (self.name, self.device_dense, self.device_sparse, self.compression, self.op, self.prescale,
               self.postscale, self.process_set.process_set_id, generic)
        fn = _EAGER_REDUCTIONS.get(key)
        if fn is None:
            options = copy.copy(self)  # what the graph reads; not this tape's local variables
            options.local = {}
            options.loss = None
            fn = tf.function(lambda ts, rs: options._reduce_graph(ts, rs, generic), reduce_retracing=True,
                             autograph=False)  # graph-safe as written (see __call__)
            _EAGER_REDUCTIONS[key] = fn
        return fn

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
