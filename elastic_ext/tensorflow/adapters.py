"""Adapters for TensorFlow objects: tf.Variable (and lists of them), tf.Module,
Keras models and optimizers of Keras 2 (tf_keras) and Keras 3.

Keras 3 variables are not ``tf.Variable`` (they wrap one), so everything is
done through the methods both share: ``numpy()`` to read, ``assign()`` to
write. Keras optimizers create their slot variables lazily; a newcomer's
optimizer is built (``optimizer.build(model.trainable_variables)``, zero
slots, weights untouched) when the State is created, instead of the
zero-gradient step Horovod takes, which moves weights under weight decay.

Every kind is one :class:`VariablesAdapter` told which objects it takes and
how to list their variables; :func:`adapters` is the table that
``elastic_ext.tensorflow`` registers with the core.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, FrozenSet, List

import numpy as np
import tensorflow as tf

from elastic_ext.errors import StateError
from elastic_ext.tensorflow.guard import ensure_variables
from elastic_ext.state.snapshot import Capture, Entry


class VariableSource:
    """A variable read at commit time (TF copies it to host in ``numpy()``)."""

    def __init__(self, variable: Any, where: str) -> None:
        self.variable = variable
        self.shape = tuple(int(d) for d in variable.shape)
        try:
            self.dtype = np.dtype(variable.dtype.as_numpy_dtype if hasattr(variable.dtype, "as_numpy_dtype")
                                  else variable.dtype)
        except TypeError:
            raise StateError(f"{where} has dtype {variable.dtype}, which cannot be committed") from None

    def copy_into(self, buffer: np.ndarray) -> None:
        np.copyto(buffer, np.asarray(self.variable.numpy()), casting="no")


def _is_keras_variable(obj: Any) -> bool:
    keras = sys.modules.get("keras")
    cls = getattr(keras, "Variable", None) if keras is not None else None
    return isinstance(obj, tf.Variable) or (cls is not None and isinstance(obj, cls))


def _keras_classes(name: str) -> tuple:
    found = []
    for module_name in ("keras", "tf_keras"):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        if name == "Model":
            cls = getattr(module, "Model", None)
        else:
            cls = getattr(getattr(module, "optimizers", None), "Optimizer", None)
        if cls is not None:
            found.append(cls)
        if name == "Optimizer" and module_name == "tf_keras":
            legacy = getattr(getattr(module, "optimizers", None), "legacy", None)
            if legacy is not None:
                found.append(legacy.Optimizer)
    return tuple(found)


def variables_of(obj: Any) -> List[Any]:
    """The variables of a Keras model or optimizer, or a tf.Module, in a stable order."""
    variables = obj.variables
    return list(variables() if callable(variables) else variables)


def variable_key(index: int) -> str:
    """The array key of the ``index``-th variable. Zero-padded for readability
    only: the restore order comes from :func:`ordered_keys`, never from a text
    sort (``"100000"`` sorts before ``"10001"``)."""
    return f"{index:05d}"


def ordered_keys(arrays: Dict[str, Any], what: str) -> List[str]:
    """The committed variable keys in variable order (by their integer value).

    Raises:
        StateError: a key is not a non-negative integer, or two keys name one index.
    """
    indexed = {}
    for key in arrays:
        if not key.isdigit():
            raise StateError(f"{what}: committed key {key!r} is not a variable index (digits only)")
        if int(key) in indexed:
            raise StateError(f"{what}: committed keys {indexed[int(key)]!r} and {key!r} name one variable index")
        indexed[int(key)] = key
    return [indexed[i] for i in sorted(indexed)]


def _capture_variables(variables: List[Any], meta: Any) -> Capture:
    return Capture(arrays={variable_key(i): VariableSource(v, f"variable {i} ({getattr(v, 'name', '?')})")
                           for i, v in enumerate(variables)}, meta=meta)


def _apply_variables(variables: List[Any], entry: Entry, what: str) -> None:
    keys = ordered_keys(entry.arrays, what)
    if len(keys) != len(variables):
        raise StateError(f"{what} has {len(variables)} variables but the commit holds {len(keys)}; "
                         "build the model (and the optimizer) the same way on every worker")
    for key, variable in zip(keys, variables):
        value = entry.arrays[key]
        if tuple(int(d) for d in variable.shape) != value.shape:
            raise StateError(f"{what} variable {getattr(variable, 'name', key)} has shape "
                             f"{tuple(variable.shape)} but the commit holds {value.shape}")
        variable.assign(value)


def _is_variable_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(_is_keras_variable(v) for v in obj)


def _is_model(obj: Any) -> bool:
    # A Keras model (Keras 2 or 3) or any tf.Module, but not an optimizer (a tf.Module too).
    return isinstance(obj, _keras_classes("Model") + (tf.Module,)) and not isinstance(obj, _keras_classes("Optimizer"))


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, _keras_classes("Optimizer"))


class VariablesAdapter:
    """Any object whose state is a list of variables: a variable, a list of
    them, a Keras model or ``tf.Module``, a Keras optimizer. The kinds differ
    only in which objects they take and how their variables are listed.

    Args:
        name: the adapter's name (recorded in checkpoint manifests).
        handles: True for the objects of this kind.
        variables: the object's variables in a stable order.
        describe: the object as the subject of an error message.
        non_trainable_are_buffers: non-trainable variables may differ between
            ranks (:meth:`buffer_keys`); otherwise every variable must agree.
        builds_optimizers: :meth:`prepare` builds unbuilt Keras optimizers.
    """

    framework = "tensorflow"
    synced = True

    def __init__(self, name: str, handles: Callable[[Any], bool], variables: Callable[[Any], List[Any]],
                 describe: Callable[[Any], str], non_trainable_are_buffers: bool = False,
                 builds_optimizers: bool = False) -> None:
        self.name = name
        self._handles = handles
        self._variables = variables
        self._describe = describe
        self._non_trainable_are_buffers = non_trainable_are_buffers
        self._builds_optimizers = builds_optimizers

    def __repr__(self) -> str:
        return f"VariablesAdapter({self.name!r})"

    def handles(self, obj: Any) -> bool:
        return self._handles(obj)

    def prepare(self, objects: dict) -> None:
        # A State is made eagerly, before the user's step is traced: the gradient reduction's
        # variables must exist by then, or a later trace of a tf.function would create them
        # ("tf.function only supports singleton tf.Variables created on the first call").
        ensure_variables()
        if self._builds_optimizers:
            build_optimizers(objects)

    def capture(self, obj: Any) -> Capture:
        return _capture_variables(self._variables(obj), None)

    def buffer_keys(self, obj: Any) -> FrozenSet[str]:
        """Non-trainable variables of a model (BatchNormalization moving mean and
        variance, Keras 3 seed generator states) may differ between ranks."""
        if not self._non_trainable_are_buffers:
            return frozenset()
        return frozenset(variable_key(i) for i, v in enumerate(self._variables(obj))
                         if not getattr(v, "trainable", True))

    def apply(self, obj: Any, entry: Entry) -> Any:
        _apply_variables(self._variables(obj), entry, self._describe(obj))
        return obj


def _optimizer_built(optimizer: Any) -> bool:
    built = getattr(optimizer, "built", None)          # Keras 3
    if built is None:
        # tf_keras's optimizer has no flag; build() creates its index of variables.
        built = bool(getattr(optimizer, "_index_dict", None))
    return bool(built)


def build_optimizers(objects: dict) -> None:
    """Builds unbuilt Keras optimizers over the trainable variables of the
    State's one Keras model, so every worker's optimizer has its slots before
    the first sync (no gradient step involved)."""
    optimizers = [o for o in objects.values() if isinstance(o, _keras_classes("Optimizer"))]
    models = [m for m in objects.values() if isinstance(m, _keras_classes("Model"))]
    for optimizer in optimizers:
        if _optimizer_built(optimizer) or not hasattr(optimizer, "build"):
            continue
        if len(models) != 1:
            raise StateError(f"cannot build optimizer {type(optimizer).__name__}: the State holds "
                             f"{len(models)} Keras models; call optimizer.build(variables) yourself")
        optimizer.build(models[0].trainable_variables)


def adapters() -> List[VariablesAdapter]:
    """TensorFlow adapters in lookup order (tried before the framework-free ones)."""
    return [
        VariablesAdapter("tf.variable", _is_keras_variable, lambda variable: [variable],
                         lambda variable: "variable"),
        VariablesAdapter("tf.variables", _is_variable_list, list, lambda variables: "variable list"),
        VariablesAdapter("tf.optimizer", _is_optimizer, variables_of, lambda optimizer: "optimizer",
                         builds_optimizers=True),
        VariablesAdapter("tf.model", _is_model, variables_of,
                         lambda model: f"model {getattr(model, 'name', '')}", non_trainable_are_buffers=True),
    ]
