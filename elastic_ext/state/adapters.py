"""Adapters: how each kind of object is snapshotted to host memory and restored.

The committed state (:mod:`elastic_ext.state.state`) knows nothing about PyTorch or
TensorFlow. It asks an adapter, picked by the object's type, to *capture* the
object (name its arrays and metadata without copying anything) and later to
*apply* a snapshot (:mod:`elastic_ext.state.snapshot`) back onto it. This module
holds the protocol, the framework-free adapters (plain Python values, numpy
arrays, ``state_dict`` objects, random number generators of ``random`` and
``numpy``) and the adapter table.

Framework adapters live in ``elastic_ext.torch`` and
``elastic_ext.tensorflow``, which *register* them here when they are
imported (:func:`register_adapters`, :func:`register_global_rng`). The core
has no import of those packages: :func:`load_frameworks` imports one by name
once its framework is in the process, so a user who never imports
``elastic_ext.torch`` still gets the torch adapters.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from elastic_ext.state import tree, written
from elastic_ext.errors import StateError
from elastic_ext.state.snapshot import (PLAIN_SCALARS, Capture, Entry, NumpySource, assign_in_place, check_plain,
                                        decode_plain, encode_plain, join_captures, split_entry)


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


class PlainAdapter:
    """Plain Python values (epoch, step counters, small dicts): kept as metadata."""

    name = "plain"
    synced = True

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, PLAIN_SCALARS + (list, tuple, dict))

    def capture(self, obj: Any) -> Capture:
        check_plain(obj, "value")
        return Capture(arrays={}, meta=encode_plain(obj))

    def apply(self, obj: Any, entry: Entry) -> Any:
        # New values (the commit's are never handed out), written into the live list or dict
        # where there is one: a restore changes values, never the identity of what the user holds.
        return assign_in_place(obj, decode_plain(entry.meta))



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
        if obj.flags.c_contiguous and saved.flags.c_contiguous and obj.nbytes >= written.MIN_BYTES:
            written.copy(obj.ctypes.data, obj.nbytes, saved, to_buffer=False)
        else:
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
        arrays, meta = tree.split(self._bitgen(obj).state)
        return Capture(arrays=arrays, meta=meta)

    def apply(self, obj: Any, entry: Entry) -> Any:
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
    """Adapter for :class:`GlobalRNG`: Python's and numpy's streams, plus every
    framework part registered with :func:`register_global_rng` (torch's)."""

    name = "global_rng"
    synced = False

    def __init__(self) -> None:
        self._python = PythonRandomAdapter()
        self._numpy = NumpyGeneratorAdapter()

    def handles(self, obj: Any) -> bool:
        return isinstance(obj, GlobalRNG)

    def capture(self, obj: GlobalRNG) -> Capture:
        parts = {"python": self._python.capture(random._inst),  # the random module's own instance
                 "numpy": self._numpy.capture(np.random.mtrand._rand)}
        for name, part in global_rng_parts().items():
            parts[name] = part.capture()
        return join_captures(parts)

    def apply(self, obj: GlobalRNG, entry: Entry) -> GlobalRNG:
        self._python.apply(random._inst, split_entry(entry, "python"))
        self._numpy.apply(np.random.mtrand._rand, split_entry(entry, "numpy"))
        framework_parts = global_rng_parts()
        for name in entry.meta:
            if name in ("python", "numpy"):
                continue
            if name not in framework_parts:
                raise StateError(f"the commit holds {name} RNG state but {name} is not imported in this process")
            framework_parts[name].apply(split_entry(entry, name))
        return obj


class StatefulAdapter:
    """Any object with ``state_dict()`` / ``load_state_dict()`` over plain values and numpy arrays.

    Serves elastic_ext's own samplers and users' small stateful helpers.
    Framework packages subclass it with a tensor ``leaf`` and ``make``
    (see :mod:`elastic_ext.state.tree`).
    """

    name = "stateful"
    synced = True
    leaf: Optional[tree.Leaf] = None
    make: Optional[tree.Make] = None

    def handles(self, obj: Any) -> bool:
        return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))

    def capture(self, obj: Any) -> Capture:
        arrays, skeleton = tree.split(obj.state_dict(), type(self).leaf)
        return Capture(arrays=arrays, meta=skeleton)

    def apply(self, obj: Any, entry: Entry) -> Any:
        obj.load_state_dict(tree.join(entry.meta, entry.arrays, type(self).make))
        return obj


def core_adapters() -> List[Adapter]:
    """The framework-free adapters, in lookup order."""
    return [PlainAdapter(), NumpyArrayAdapter(), PythonRandomAdapter(), NumpyGeneratorAdapter(),
            GlobalRNGAdapter(), StatefulAdapter()]


# ------------------------------------------------------------ the adapter table

@dataclasses.dataclass(frozen=True)
class RNGPart:
    """A framework's process-wide random streams, committed as one part of :class:`GlobalRNG`."""

    capture: Callable[[], Capture]
    apply: Callable[[Entry], None]


# Framework -> (modules whose presence in the process means it is in use, the
# elastic_ext package that registers its adapters on import). The order is
# the lookup order of their adapters. Loaded by name: a static import would
# make the framework-free core depend on the framework packages.
_FRAMEWORK_PACKAGES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "torch": (("torch",), "elastic_ext.torch"),
    "tensorflow": (("tensorflow", "keras", "tf_keras"), "elastic_ext.tensorflow"),
}
_adapter_factories: Dict[str, Callable[[], List[Adapter]]] = {}
_rng_parts: Dict[str, RNGPart] = {}


def register_adapters(framework: str, factory: Callable[[], List[Adapter]]) -> None:
    """Called by a framework package on import: ``factory()`` returns fresh
    instances of its adapters in lookup order (tried before the core ones)."""
    _adapter_factories[framework] = factory


def register_global_rng(framework: str, capture: Callable[[], Capture], apply: Callable[[Entry], None]) -> None:
    """Called by a framework package on import: its global random streams become
    part ``framework`` of every :class:`GlobalRNG` commit."""
    _rng_parts[framework] = RNGPart(capture=capture, apply=apply)


def load_frameworks() -> None:
    """Imports the elastic_ext package of every framework this process has
    imported, so that it registers its adapters and RNG part."""
    for modules, package in _FRAMEWORK_PACKAGES.values():
        if any(module in sys.modules for module in modules):
            importlib.import_module(package)


def _lookup_order(registered: Iterable[str]) -> List[str]:
    known = list(_FRAMEWORK_PACKAGES)
    return [f for f in known if f in registered] + [f for f in registered if f not in known]


def framework_adapters() -> List[Adapter]:
    """Fresh adapters of the frameworks in use, in lookup order (torch, then TensorFlow)."""
    load_frameworks()
    return [adapter for framework in _lookup_order(_adapter_factories)
            for adapter in _adapter_factories[framework]()]


def global_rng_parts() -> Dict[str, RNGPart]:
    """The registered framework parts of :class:`GlobalRNG`, by framework."""
    load_frameworks()
    return {framework: _rng_parts[framework] for framework in _lookup_order(_rng_parts)}


def adapter_table(extra: Iterable[Adapter] = ()) -> List[Adapter]:
    """The lookup table of a State: ``extra`` first, then the frameworks' adapters, then the core ones."""
    return list(extra) + framework_adapters() + core_adapters()
