"""Splitting nested state (dicts, lists, tensors) into host arrays plus JSON metadata.

``state_dict()`` trees of PyTorch optimizers and schedulers, numpy bit
generator states and the like mix tensors with plain values and int dict
keys. :func:`split` turns such a tree into ``{key: ArraySource}`` plus a
JSON-compatible skeleton; :func:`join` rebuilds it from the committed
buffers. Framework tensors are handled by a ``Leaf`` hook so this module
stays framework-free.

Array keys are paths written by :func:`path_key`, an injective encoding:
str keys are joined with ``.`` (``\\``, ``.`` and ``[`` inside them are
escaped with a backslash), int keys and list positions are written ``[i]``.
So ``{"a.b": x}`` gives ``a\\.b`` and ``{"a": {"b": y}}`` gives ``a.b``;
``{1: x}`` gives ``[1]`` and ``{"1": y}`` gives ``1``. Two different paths
never share a key, whatever the tree holds (:func:`parse_key` inverts it).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from elastic_ext.errors import StateError
from elastic_ext.state.snapshot import ArraySource, NumpySource, check_plain, decode_plain, encode_plain

# leaf(value) -> (source, tag) for framework tensors it recognises, else None
Leaf = Callable[[Any], Optional[Tuple[ArraySource, dict]]]
# make(array, tag, key) -> the framework object to put back in the tree; ``key`` is the
# array's key, so an adapter can put it where the live object keeps that tensor
Make = Callable[[np.ndarray, dict, str], Any]
# a path component: a dict key or a list position
Component = Union[str, int]


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def path_key(path: Sequence[Component]) -> str:
    """The array key of a path of dict keys and list positions (injective, see the module docstring).

    Raises:
        StateError: a component is neither str nor int.
    """
    out: List[str] = []
    for index, part in enumerate(path):
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise StateError(f"path component {part!r} of type {type(part).__name__} must be str or int")
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif index == 0 and part:
            out.append(_escape(part))  # a first non-empty str key needs no leading dot
        else:
            out.append("." + _escape(part))
    return "".join(out)


def parse_key(key: str) -> List[Component]:
    """Inverse of :func:`path_key`.

    Raises:
        StateError: ``key`` is not a key that :func:`path_key` writes.
    """
    parts: List[Component] = []
    i = 0
    if key and key[0] not in ".[":
        key = "." + key
    while i < len(key):
        if key[i] == "[":
            end = key.find("]", i)
            try:
                if end < 0:
                    raise ValueError
                parts.append(int(key[i + 1:end]))
            except ValueError:
                raise StateError(f"array key {key!r}: bad list position at offset {i}") from None
            i = end + 1
        elif key[i] == ".":
            i += 1
            chars = []
            while i < len(key) and key[i] not in ".[":
                if key[i] == "\\":
                    if i + 1 >= len(key):
                        raise StateError(f"array key {key!r} ends with a lone backslash")
                    i += 1
                chars.append(key[i])
                i += 1
            parts.append("".join(chars))
        else:
            raise StateError(f"array key {key!r}: unexpected {key[i]!r} at offset {i}")
    return parts


def describe_key(key: str) -> str:
    """A key as Python subscripts for messages: ``['state'][0]['exp_avg']``
    (keys that :func:`path_key` did not write are shown as one subscript)."""
    try:
        parts = parse_key(key)
    except StateError:
        parts = [key]
    return "".join(f"[{part!r}]" for part in parts)


def split(value: Any, leaf: Optional[Leaf] = None) -> Tuple[Dict[str, ArraySource], Any]:
    """Returns (arrays, skeleton) for a nested value; array keys come from :func:`path_key`.

    Raises:
        StateError: a leaf is neither a plain value, a numpy array nor a
            tensor that ``leaf`` recognises; the message names its path.
    """
    arrays: Dict[str, ArraySource] = {}
    skeleton = _split(value, leaf, [], arrays)
    return arrays, skeleton


def _add(arrays: Dict[str, ArraySource], path: List[Component], source: ArraySource) -> str:
    key = path_key(path)
    if key in arrays:  # cannot happen with an injective key; kept as a guard against silent overwrites
        raise StateError(f"two arrays of one object map to the key {key!r}")
    arrays[key] = source
    return key


def _split(value: Any, leaf: Optional[Leaf], path: List[Component], arrays: Dict[str, ArraySource]) -> Any:
    if leaf is not None:
        found = leaf(value)
        if found is not None:
            source, tag = found
            return {"__leaf__": _add(arrays, path, source), "tag": tag}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise StateError(f"{path_key(path) or 'value'} is a numpy array of dtype object; "
                             "expected a numeric dtype")
        return {"__ndarray__": _add(arrays, path, NumpySource(value))}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise StateError(f"{path_key(path) or 'value'} has key {key!r} of type {type(key).__name__}; "
                                 "keys must be str or int")
            items.append([key, _split(item, leaf, path + [key], arrays)])
        return {"__map__": items}
    if isinstance(value, (list, tuple)):
        parts = [_split(item, leaf, path + [i], arrays) for i, item in enumerate(value)]
        return {"__tuple__": parts} if isinstance(value, tuple) else {"__list__": parts}
    check_plain(value, path_key(path) or "value")
    return {"__plain__": encode_plain(value)}


def join(skeleton: Any, arrays: Dict[str, np.ndarray], make: Optional[Make] = None) -> Any:
    """Rebuilds the tree; numpy leaves come back as copies, never as the buffers."""
    if "__leaf__" in skeleton:
        if make is None:
            raise StateError(f"snapshot holds a framework tensor at {skeleton['__leaf__']!r} "
                             "but no framework adapter is restoring it")
        return make(arrays[skeleton["__leaf__"]], skeleton["tag"], skeleton["__leaf__"])
    if "__ndarray__" in skeleton:
        return arrays[skeleton["__ndarray__"]].copy()
    if "__map__" in skeleton:
        return {key: join(item, arrays, make) for key, item in skeleton["__map__"]}
    if "__list__" in skeleton:
        return [join(item, arrays, make) for item in skeleton["__list__"]]
    if "__tuple__" in skeleton:
        return tuple(join(item, arrays, make) for item in skeleton["__tuple__"])
    return decode_plain(skeleton["__plain__"])
