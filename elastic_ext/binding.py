"""The framework operations the neutral core needs, injected per framework.

Like Horovod's own ``State``, which receives ``bcast_object`` and
``get_rank``, the core receives a :class:`Binding`: rank and size, three
collectives over numpy arrays, and the reset that re-initialises Horovod.
``elastic_ext.torch.binding`` and ``elastic_ext.tensorflow.binding`` each
register one (:func:`register_binding`) when imported; :func:`get_binding`
imports them by name, so the core has no import of a framework package.
This module also builds the few composite collectives the core uses
(JSON broadcast, fused array broadcast, striped array gather) on top of
those three.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, runtime_checkable

import numpy as np

from elastic_ext.errors import ConfigError

FRAMEWORKS = ("torch", "tensorflow")
# The module of each framework that registers its binding on import.
_BINDING_MODULES = {"torch": "elastic_ext.torch.binding", "tensorflow": "elastic_ext.tensorflow.binding"}
_factories: Dict[str, Callable[[], "Binding"]] = {}


@runtime_checkable
class Binding(Protocol):
    """Horovod operations for one framework, over host numpy arrays."""

    framework: str

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def broadcast(self, array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
        """Returns root's ``array`` on every rank (same shape and dtype everywhere)."""

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Concatenates every rank's ``array`` along axis 0, in rank order."""

    def allreduce_max(self, array: np.ndarray, name: str) -> np.ndarray:
        """Element-wise maximum over ranks."""

    def reset(self) -> None:
        """Shuts Horovod down and initialises it again (after a failure or resize)."""

    def as_internal_error(self, exc: BaseException) -> Optional[BaseException]:
        """Returns a ``HorovodInternalError`` if ``exc`` is a failed Horovod
        collective in framework clothing (TensorFlow op errors), else None."""


class HorovodBasics:
    """The calls that every framework's Horovod module makes alike, for a binding to inherit.

    A subclass names its framework's module (``horovod.torch``,
    ``horovod.tensorflow``) in the class attribute ``hvd``.
    """

    hvd: Any

    def rank(self) -> int:
        return self.hvd.rank()

    def size(self) -> int:
        return self.hvd.size()

    shutdown_s: Optional[float] = None  # the last reset's Horovod shutdown (the reset event's ``shutdown_s``)

    def reset(self) -> None:
        started = time.perf_counter()
        self.hvd.shutdown()
        self.shutdown_s = time.perf_counter() - started
        self.hvd.init()

    def local_rank(self) -> int:
        """This rank's slot on its host: Horovod's rank request after a reset names it (elastic_ext.worker.prestart)."""
        return self.hvd.local_rank()

    def local_size(self) -> int:
        """Ranks on this rank's host (a leave or eviction takes its whole host out)."""
        return self.hvd.local_size()

    def shutdown(self) -> None:
        """Shuts Horovod down with the other ranks (a leaver, before it exits)."""
        self.hvd.shutdown()


def get_binding(framework: str) -> Binding:
    """Returns the binding for ``framework`` ("torch" or "tensorflow").

    Raises:
        ConfigError: unknown framework name.
    """
    if framework not in FRAMEWORKS:
        raise ConfigError(f"framework ({framework!r}) must be one of {FRAMEWORKS}")
    if framework not in _factories:
        importlib.import_module(_BINDING_MODULES[framework])  # by name: it registers its binding
    return _factories[framework]()


def register_binding(framework: str, factory: Callable[[], Binding]) -> None:
    """Called by a framework's binding module on import: ``factory()`` makes its :class:`Binding`."""
    _factories[framework] = factory


def guess_framework(preferred: Optional[str] = None) -> str:
    """Picks the framework whose Horovod module is imported, when only one is.

    Raises:
        ConfigError: neither or both are imported and ``preferred`` is None.
    """
    if preferred is not None:
        return preferred
    loaded = [f for f, mod in (("torch", "horovod.torch"), ("tensorflow", "horovod.tensorflow"))
              if mod in sys.modules]
    if len(loaded) == 1:
        return loaded[0]
    raise ConfigError(
        f"cannot tell which framework to use (Horovod modules imported: {loaded or 'none'}); "
        "pass framework='torch' or framework='tensorflow' to State")


def rank_or_unknown(binding: Binding) -> int:
    """``binding.rank()``, or -1 while Horovod cannot say (shut down during a reset): for log
    prefixes, and for what only rank 0 does."""
    try:
        return binding.rank()
    except Exception:  # noqa: BLE001 - a rank that cannot be read is no rank 0, and a log line must not fail
        return -1


def allreduce_max_start(binding: Binding, array: np.ndarray, name: str) -> Callable[[], np.ndarray]:
    """Starts an element-wise max over ranks; the returned call waits for the result.

    A binding with ``allreduce_max_start`` (PyTorch) runs it in Horovod's
    background thread meanwhile; any other runs it now, blocking.
    """
    start = getattr(binding, "allreduce_max_start", None)
    if start is not None:
        return start(array, name)
    result = binding.allreduce_max(array, name)
    return lambda: result


def allgather_start(binding: Binding, array: np.ndarray, name: str) -> Optional[Callable[[], np.ndarray]]:
    """Starts an allgather in Horovod's background thread; the returned call waits for the result.

    None when the binding cannot run one in the background (only PyTorch's
    can): the caller then runs :meth:`Binding.allgather` itself, blocking.
    """
    start = getattr(binding, "allgather_start", None)
    return start(array, name) if start is not None else None


def broadcast_json(binding: Binding, value: Any, root_rank: int, name: str) -> Any:
    """Broadcasts a JSON-compatible value from ``root_rank`` (no pickle)."""
    payload = np.frombuffer(json.dumps(value).encode("utf-8"), dtype=np.uint8)
    length = binding.broadcast(np.array([payload.size], dtype=np.int64), root_rank, name + ".len")
    buffer = payload if binding.rank() == root_rank else np.zeros(int(length[0]), dtype=np.uint8)
    received = binding.broadcast(buffer, root_rank, name + ".data")
    return json.loads(received.tobytes().decode("utf-8"))


def layout_sizes(layout: list) -> list:
    """Bytes of each ``[key, dtype, shape]`` entry of a broadcast layout."""
    return [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for _, dtype, shape in layout]


def broadcast_arrays(binding: Binding, arrays: Dict[str, np.ndarray], layout: list, root_rank: int,
                     name: str) -> Dict[str, np.ndarray]:
    """Broadcasts many arrays as one flat byte buffer.

    ``layout`` is the root's ``[key, dtype, shape]`` list, already known to
    every rank; ``arrays`` is only read on the root. A broadcast is a bitwise
    copy, so moving raw bytes serves every dtype (Horovod has no unsigned
    16/32/64-bit collectives) in a single collective. Returns fresh arrays on
    non-root ranks and ``arrays`` itself on the root.
    """
    if binding.rank() == root_rank:
        if layout:
            flat = np.concatenate([np.ascontiguousarray(arrays[key]).reshape(-1).view(np.uint8)
                                   for key, _, _ in layout])
        else:
            flat = np.zeros(0, dtype=np.uint8)
        binding.broadcast(flat, root_rank, name)
        return arrays
    sizes = layout_sizes(layout)
    return _split(binding.broadcast(np.empty(sum(sizes), dtype=np.uint8), root_rank, name), layout, sizes)


def gather_striped(binding: Binding, arrays: Dict[str, np.ndarray], layout: list, holders: List[int],
                   name: str) -> Dict[str, np.ndarray]:
    """Like :func:`broadcast_arrays`, with every rank of ``holders`` sending a share.

    ``holders`` are the ranks that hold the very same bytes for ``layout``
    (the sync checked their digests). The layout's bytes, laid end to end,
    are cut into one contiguous stripe per holder, in rank order; one
    allgather, to which every other rank gives nothing, then hands every rank
    the whole: the send load is spread over all holders instead of one root.
    Returns ``arrays`` itself on a holder, fresh arrays elsewhere.
    """
    holders = sorted(holders)
    if len(holders) == 1:
        return broadcast_arrays(binding, arrays, layout, holders[0], name)
    sizes = layout_sizes(layout)
    bounds = stripe_bounds(sum(sizes), len(holders))
    rank = binding.rank()
    if rank in holders:
        index = holders.index(rank)
        stripe = byte_range(arrays, layout, sizes, bounds[index], bounds[index + 1])
    else:
        stripe = np.zeros(0, dtype=np.uint8)
    flat = binding.allgather(stripe, name)  # rank order = holder order = stripe order
    return arrays if rank in holders else _split(flat, layout, sizes)


def stripe_bounds(total: int, count: int) -> List[int]:
    """``count + 1`` offsets cutting ``total`` bytes into ``count`` near-equal contiguous stripes."""
    return [total * i // count for i in range(count + 1)]


def byte_range(arrays: Dict[str, np.ndarray], layout: list, sizes: List[int], start: int, end: int) -> np.ndarray:
    """Bytes ``start:end`` of the layout's arrays laid end to end, copying only those."""
    pieces, offset = [], 0
    for (key, _, _), size in zip(layout, sizes):
        low, high = max(start, offset), min(end, offset + size)
        if low < high:
            flat = np.ascontiguousarray(arrays[key]).reshape(-1).view(np.uint8)
            pieces.append(flat[low - offset:high - offset])
        offset += size
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)


def _split(flat: np.ndarray, layout: list, sizes: List[int]) -> Dict[str, np.ndarray]:
    result: Dict[str, np.ndarray] = {}
    offset = 0
    for (key, dtype, shape), size in zip(layout, sizes):
        result[key] = flat[offset:offset + size].view(np.dtype(dtype)).reshape(tuple(shape))
        offset += size
    return result
