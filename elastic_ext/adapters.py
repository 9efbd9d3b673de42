"""Adapters: how each kind of object is snapshotted to host memory and restored.

The committed state (:mod:`elastic_ext.state`) knows nothing about PyTorch or
TensorFlow. It asks an adapter, picked by the object's type, to *capture* the
object (name its arrays and metadata without copying anything) and later to
*apply* a snapshot back onto it. Framework adapters live in
``elastic_ext.torch`` and ``elastic_ext.tensorflow``; this module holds the
protocol and the framework-free adapters: plain Python values, numpy arrays,
and random number generators of ``random`` and ``numpy``.

A snapshot is host memory only: numpy arrays (the buffers that commit fills
in place) plus JSON-compatible metadata. That keeps sync (a broadcast of
arrays) and durable checkpoints (safetensors-like files plus JSON) free of
pickle.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from typing import Any, Dict, Protocol, runtime_checkable

import numpy as np

from elastic_ext.errors import StateError


class ArraySource(Protocol):
    """One array of live data, not yet copied: its shape, dtype and a copier."""

    shape: tuple
    dtype: np.dtype

    def copy_into(self, buffer: np.ndarray) -> None:
        """Copies the live data into ``buffer`` (same shape and dtype)."""


@dataclasses.dataclass
class NumpySource:
    """An :class:`ArraySource` over a numpy array (copied at commit time)."""

    array: np.ndarray

    @property
    def shape(self) -> tuple:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def copy_into(self, buffer: np.ndarray) -> None:
        np.copyto(buffer, self.array, casting="no")


@dataclasses.dataclass
class Capture:
    """What an adapter reports for one object at commit time.

    ``arrays`` maps a key (unique within the object) to a source; ``meta`` is
    JSON-compatible and is deep-copied into the commit.
    """

    arrays: Dict[str, ArraySource]
    meta: Any


@dataclasses.dataclass
class Entry:
    """The committed snapshot of one object: host buffers plus metadata."""

    arrays: Dict[str, np.ndarray]
    meta: Any


@runtime_checkable
class Adapter(Protocol):
    """Snapshots and restores one kind of object.

    ``synced`` adapters are broadcast from the root at ``sync()`` and checked
    for agreement across ranks; unsynced ones (per-rank RNG streams) are only
    committed and restored locally, so each rank keeps its own stream.

    An adapter may also define ``buffer_keys(obj) -> frozenset`` of array
    keys that ranks may legitimately hold different values for (buffers a
    rank updates from its own batch, such as BatchNorm running statistics):
    ``sync()`` takes them from the root without calling a difference
    divergence. Every other array and the metadata must agree.
    """

    name: str
    synced: bool

    def handles(self, obj: Any) -> bool:
        """True if this adapter knows how to snapshot ``obj``."""

    def capture(self, obj: Any) -> Capture:
        """Names the arrays and metadata of ``obj`` without copying array data.

        Raises:
            StateError: the object cannot be snapshotted in its current form.
        """

    def apply(self, obj: Any, entry: Entry) -> Any:
        """Restores ``obj`` from ``entry`` and returns the object to keep.

        Mutable objects are restored in place and returned; immutable values
        are returned anew.
        """


# ---------------------------------------------------------------- plain values

_PLAIN_SCALARS = (type(None), bool, int, float, str)


def check_plain(value: Any, where: str) -> None:
    """Raises StateError unless ``value`` is a plain value that round-trips exactly.

    Plain values are None, bool, int, float, str, and lists, tuples and
    str-keyed dicts of them. Floats must be finite or be NaN/inf (kept as is).
    """
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise StateError(f"{where} has key {key!r} of type {type(key).__name__}; dict keys must be str")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise StateError(
        f"{where} is {type(value).__name__} ({value!r:.80}); expected a plain value "
        "(None, bool, int, float, str, list, tuple, dict) or an object with a registered adapter")


def encode_plain(value: Any) -> Any:
    """Encodes a plain value as JSON-compatible data, keeping tuples and non-finite floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_plain(v) for v in value]}
    if isinstance(value, list):
        return [encode_plain(v) for v in value]
    if isinstance(value, dict):
        return {"__dict__": [[k, encode_plain(v)] for k, v in value.items()]}
    return value


def decode_plain(data: Any) -> Any:
    """Inverse of :func:`encode_plain`."""
    if isinstance(data, list):
        return [decode_plain(v) for v in data]
    if isinstance(data, dict):
        if "__float__" in data:
            return float(data["__float__"])
        if "__tuple__" in data:
            return tuple(decode_plain(v) for v in data["__tuple__"])
        return {k: decode_plain(v) for k, v in data["__dict__"]}
    return data


class PlainAdapter:
    """Plain Python values (epoch, step counters, small dicts): kept as metadata."""

    name = "plain"
    synced = True

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, _PLAIN_SCALARS + (list, tuple, dict))

    def capture(self, obj: Any) -> Capture:
        check_plain(obj, "value")
        return Capture(arrays={}, meta=encode_plain(obj))

    def apply(self, obj: Any, entry: Entry) -> Any:
        return decode_plain(copy.deepcopy(entry.meta))


class NumpyArrayAdapter:
    """A numpy array: restored in place, so references held elsewhere see the rollback."""

    name = "numpy"
    synced = True

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, np.ndarray)

    def capture(self, obj: np.ndarray) -> Capture:
        if obj.dtype == object:
            raise StateError("numpy array of dtype object cannot be committed; expected a numeric dtype")
        return Capture(arrays={"array": NumpySource(obj)}, meta=None)

    def apply(self, obj: np.ndarray, entry: Entry) -> np.ndarray:
        saved = entry.arrays["array"]
        if obj.shape != saved.shape or obj.dtype != saved.dtype:
            return saved.copy()
        np.copyto(obj, saved)
        return obj


# ------------------------------------------------------------------------ RNGs

class PythonRandomAdapter:
    """A ``random.Random`` instance (or the ``random`` module's hidden one via GlobalRNG)."""

    name = "python_random"
    synced = False

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, random.Random)

    def capture(self, obj: random.Random) -> Capture:
        version, internal, gauss = obj.getstate()
        return Capture(arrays={"mt": NumpySource(np.asarray(internal, dtype=np.uint64))},
                       meta={"version": version, "gauss": encode_plain(gauss)})

    def apply(self, obj: random.Random, entry: Entry) -> random.Random:
        internal = tuple(int(x) for x in entry.arrays["mt"])
        obj.setstate((entry.meta["version"], internal, decode_plain(entry.meta["gauss"])))
        return obj


class NumpyGeneratorAdapter:
    """A ``numpy.random.Generator`` or ``RandomState``: its bit generator state."""

    name = "numpy_generator"
    synced = False

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, (np.random.Generator, np.random.RandomState))

    @staticmethod
    def _bitgen(obj: Any) -> Any:
        return obj.bit_generator if isinstance(obj, np.random.Generator) else obj._bit_generator

    def capture(self, obj: Any) -> Capture:
        from elastic_ext import tree
        arrays, meta = tree.split(self._bitgen(obj).state)
        return Capture(arrays=arrays, meta=meta)

    def apply(self, obj: Any, entry: Entry) -> Any:
        from elastic_ext import tree
        self._bitgen(obj).state = tree.join(entry.meta, entry.arrays)
        return obj


class GlobalRNG:
    """Marker for the process-wide random streams: ``random``, ``numpy.random``
    and, when PyTorch is imported, ``torch`` (CPU and every CUDA device).

    Put one in the state (``State(rng=GlobalRNG(), ...)``) to roll the global
    streams back with the weights. Per-rank: each rank commits and restores
    its own streams and never receives another rank's, as without elastic.
    """


class GlobalRNGAdapter:
    """Adapter for :class:`GlobalRNG`; the torch part is supplied by ``elastic_ext.torch``."""

    name = "global_rng"
    synced = False

    def __init__(self) -> None:
        self._python = PythonRandomAdapter()
        self._numpy = NumpyGeneratorAdapter()

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, GlobalRNG)

    @staticmethod
    def _torch_parts():
        import sys
        if "torch" not in sys.modules:
            return None
        from elastic_ext.torch import rng  # noqa: WPS433 - only when torch is already imported
        return rng

    def capture(self, obj: GlobalRNG) -> Capture:
        arrays: dict = {}
        meta: dict = {}
        python_cap = self._python.capture(random._inst)  # the random module's own instance
        numpy_cap = self._numpy.capture(np.random.mtrand._rand)
        for prefix, cap in (("python", python_cap), ("numpy", numpy_cap)):
            arrays.update({f"{prefix}/{k}": v for k, v in cap.arrays.items()})
            meta[prefix] = cap.meta
        torch_rng = self._torch_parts()
        if torch_rng is not None:
            torch_arrays, torch_meta = torch_rng.capture_global()
            arrays.update({f"torch/{k}": v for k, v in torch_arrays.items()})
            meta["torch"] = torch_meta
        return Capture(arrays=arrays, meta=meta)

    def apply(self, obj: GlobalRNG, entry: Entry) -> GlobalRNG:
        def part(prefix: str) -> Entry:
            arrays = {k[len(prefix) + 1:]: v for k, v in entry.arrays.items() if k.startswith(prefix + "/")}
            return Entry(arrays=arrays, meta=entry.meta[prefix])
        self._python.apply(random._inst, part("python"))
        self._numpy.apply(np.random.mtrand._rand, part("numpy"))
        if "torch" in entry.meta:
            torch_rng = self._torch_parts()
            if torch_rng is None:
                raise StateError("the commit holds torch RNG state but torch is not imported in this process")
            torch_rng.apply_global(part("torch"))
        return obj


def core_adapters() -> list:
    """The framework-free adapters, in lookup order."""
    from elastic_ext.tree import StatefulAdapter
    return [PlainAdapter(), NumpyArrayAdapter(), PythonRandomAdapter(), NumpyGeneratorAdapter(),
            GlobalRNGAdapter(), StatefulAdapter()]
