"""Splitting nested state (dicts, lists, tensors) into host arrays plus JSON metadata.

``state_dict()`` trees of PyTorch optimizers and schedulers, numpy bit
generator states and the like mix tensors with plain values and int dict
keys. :func:`split` turns such a tree into ``{key: ArraySource}`` plus a
JSON-compatible skeleton; :func:`join` rebuilds it from the committed
buffers. Framework tensors are handled by a ``Leaf`` hook so this module
stays framework-free.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from elastic_ext.adapters import ArraySource, NumpySource, check_plain, decode_plain, encode_plain
from elastic_ext.errors import StateError

# leaf(value) -> (source, tag) for framework tensors it recognises, else None
Leaf = Callable[[Any], Optional[Tuple[ArraySource, dict]]]
# make(array, tag) -> the framework object to put back in the tree
Make = Callable[[np.ndarray, dict], Any]


def split(value: Any, leaf: Optional[Leaf] = None, prefix: str = "") -> Tuple[Dict[str, ArraySource], Any]:
    """Returns (arrays, skeleton) for a nested value.

    Raises:
        StateError: a leaf is neither a plain value, a numpy array nor a
            tensor that ``leaf`` recognises; the message names its path.
    """
    arrays: Dict[str, ArraySource] = {}
    skeleton = _split(value, leaf, prefix or "", arrays)
    return arrays, skeleton


def _split(value: Any, leaf: Optional[Leaf], path: str, arrays: Dict[str, ArraySource]) -> Any:
    if leaf is not None:
        found = leaf(value)
        if found is not None:
            source, tag = found
            arrays[path] = source
            return {"__leaf__": path, "tag": tag}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise StateError(f"{path or 'value'} is a numpy array of dtype object; expected a numeric dtype")
        arrays[path] = NumpySource(value)
        return {"__ndarray__": path}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise StateError(f"{path or 'value'} has key {key!r} of type {type(key).__name__}; "
                                 "keys must be str or int")
            items.append([key, _split(item, leaf, f"{path}.{key}" if path else str(key), arrays)])
        return {"__map__": items}
    if isinstance(value, (list, tuple)):
        parts = [_split(item, leaf, f"{path}[{i}]", arrays) for i, item in enumerate(value)]
        return {"__tuple__": parts} if isinstance(value, tuple) else {"__list__": parts}
    check_plain(value, path or "value")
    return {"__plain__": encode_plain(value)}


def join(skeleton: Any, arrays: Dict[str, np.ndarray], make: Optional[Make] = None) -> Any:
    """Rebuilds the tree; numpy leaves come back as copies, never as the buffers."""
    if "__leaf__" in skeleton:
        if make is None:
            raise StateError(f"snapshot holds a framework tensor at {skeleton['__leaf__']!r} "
                             "but no framework adapter is restoring it")
        return make(arrays[skeleton["__leaf__"]], skeleton["tag"])
    if "__ndarray__" in skeleton:
        return arrays[skeleton["__ndarray__"]].copy()
    if "__map__" in skeleton:
        return {key: join(item, arrays, make) for key, item in skeleton["__map__"]}
    if "__list__" in skeleton:
        return [join(item, arrays, make) for item in skeleton["__list__"]]
    if "__tuple__" in skeleton:
        return tuple(join(item, arrays, make) for item in skeleton["__tuple__"])
    return decode_plain(skeleton["__plain__"])


class StatefulAdapter:
    """Any object with ``state_dict()`` / ``load_state_dict()`` over plain values and numpy arrays.

    Serves elastic_ext's own samplers and users' small stateful helpers.
    Framework packages subclass it with a tensor ``leaf``.
    """

    name = "stateful"
    synced = True
    leaf: Optional[Leaf] = None
    make: Optional[Make] = None

    def handles(self, obj: Any) -> bool:
        return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))

    def capture(self, obj: Any):
        from elastic_ext.adapters import Capture
        arrays, skeleton = split(obj.state_dict(), type(self).leaf)
        return Capture(arrays=arrays, meta=skeleton)

    def apply(self, obj: Any, entry) -> Any:
        obj.load_state_dict(join(entry.meta, entry.arrays, type(self).make))
        return obj
