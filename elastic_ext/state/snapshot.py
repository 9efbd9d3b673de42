"""Snapshots: what a commit holds for one object, and the plain-value codec.

An adapter *captures* an object as a :class:`Capture` (live array sources,
nothing copied yet, plus JSON-compatible metadata); a commit fills host
buffers from it and keeps an :class:`Entry` (numpy buffers plus metadata).
Host memory only, so sync (a broadcast of arrays) and durable checkpoints
(safetensors-like files plus JSON) need no pickle.

This module is the leaf every other snapshot module stands on: it imports
nothing of elastic_ext but the errors and :mod:`elastic_ext.state.written`
(copies of large arrays move only the pages written since), and knows no
framework.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Dict, Protocol

import numpy as np

from elastic_ext.errors import StateError
from elastic_ext.state import written


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
        if self.array.flags.c_contiguous and self.array.nbytes >= written.MIN_BYTES:
            written.copy(self.array.ctypes.data, self.array.nbytes, buffer, to_buffer=True)
        else:
            np.copyto(buffer, self.array, casting="no")


@dataclasses.dataclass
class Capture:
    """What an adapter reports for one object at commit time.

    ``arrays`` maps a key (unique within the object) to a source; ``meta`` is
    JSON-compatible and is copied into the commit (:func:`copy_meta`).
    """

    arrays: Dict[str, ArraySource]
    meta: Any


@dataclasses.dataclass
class Entry:
    """The committed snapshot of one object: host buffers plus metadata."""

    arrays: Dict[str, np.ndarray]
    meta: Any


# ---------------------------------------------------------------- plain values

PLAIN_SCALARS = (type(None), bool, int, float, str)


def check_plain(value: Any, where: str) -> None:
    """Raises StateError unless ``value`` is a plain value that round-trips exactly.

    Plain values are None, bool, int, float, str, and lists, tuples and
    str-keyed dicts of them. Floats must be finite or be NaN/inf (kept as is).
    """
    if isinstance(value, PLAIN_SCALARS):
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


_IMMUTABLE = (type(None), bool, int, float, str)


def copy_meta(value: Any) -> Any:
    """A copy of a capture's metadata that shares no container with it.

    The JSON-compatible form (dicts, lists, scalars) is copied directly,
    about three times faster than ``copy.deepcopy`` (a commit copies its
    metadata every time); anything else an adapter put there is
    deep-copied.
    """
    kind = type(value)
    if kind is dict:
        return {key: copy_meta(item) for key, item in value.items()}
    if kind is list:
        return [copy_meta(item) for item in value]
    if kind in _IMMUTABLE:
        return value
    return copy.deepcopy(value)


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


def assign_in_place(live: Any, value: Any) -> Any:
    """``value``, with ``live`` (a list or dict) and its nested lists and dicts kept as the objects
    that hold it when their types match; any other value is returned as it is."""
    if type(live) is list and type(value) is list:
        kept = [assign_in_place(old, new) for old, new in zip(live, value)] + value[len(live):]
        live[:] = kept
        return live
    if type(live) is dict and type(value) is dict:
        kept = {key: assign_in_place(live[key], new) if key in live else new for key, new in value.items()}
        live.clear()
        live.update(kept)
        return live
    return value


# ------------------------------------------------------- composite snapshots

def join_captures(parts: Dict[str, Capture]) -> Capture:
    """One capture made of several named parts: part ``p``'s array ``k`` is
    keyed ``p/k`` and its metadata is ``meta[p]``. :func:`split_entry` undoes it."""
    arrays: Dict[str, ArraySource] = {}
    meta: Dict[str, Any] = {}
    for part, capture in parts.items():
        arrays.update({f"{part}/{key}": source for key, source in capture.arrays.items()})
        meta[part] = capture.meta
    return Capture(arrays=arrays, meta=meta)


def split_entry(entry: Entry, part: str) -> Entry:
    """The entry of one part of a commit made from :func:`join_captures`."""
    prefix = part + "/"
    arrays = {key[len(prefix):]: array for key, array in entry.arrays.items() if key.startswith(prefix)}
    return Entry(arrays=arrays, meta=entry.meta[part])
