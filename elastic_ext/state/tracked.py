"""The tracked objects of a State by name, and the adapter that handles each one.

:class:`Tracked` answers, for every name: which object is tracked now, which
adapter captures and applies it (looked up once per name in
:func:`elastic_ext.state.adapters.adapter_table`: the State's own adapters first,
then those the frameworks in use registered, then the core ones), and
whether it is synced across ranks or kept per rank.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterable, List

from elastic_ext.state import adapters as _adapters
from elastic_ext.state.adapters import Adapter
from elastic_ext.errors import StateError
from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.state.snapshot import Capture, Entry
from elastic_ext.state.tree import join


def reserved_names(cls: type) -> FrozenSet[str]:
    """Names no tracked object may take in a State class ``cls``: every public member (methods,
    properties, attributes) and its ``_RESERVED_EXTRA`` (its constructor's own keywords, its policies'
    names); :func:`elastic_ext.runtime.assembly.reserved_names` gives the public State's."""
    found = cls.__dict__.get("_reserved_found")
    if found is None:
        found = frozenset({name for name in dir(cls) if not name.startswith("_")} | cls._RESERVED_EXTRA)
        setattr(cls, "_reserved_found", found)
    return found


class Tracked:
    """Named objects, their adapters, and which of them are per rank.

    Args:
        objects: the objects by name.
        adapters: extra adapters tried before the built-in ones.
        per_rank: names of objects that are never compared nor broadcast.
        reserved: names no object may take (the State's own members).

    Raises:
        StateError: no objects, a name is reserved, starts with ``_`` or is
            not an identifier, or ``per_rank`` names an object not tracked.
    """

    def __init__(self, objects: Dict[str, Any], adapters: Iterable[Adapter], per_rank: Iterable[str],
                 reserved: FrozenSet[str] = frozenset()) -> None:
        if not objects:
            raise StateError("State() needs at least one object to track, e.g. State(model=model, epoch=0)")
        for name in objects:
            if name in reserved or name.startswith("_"):
                raise StateError(f"object name {name!r} is reserved (State has a member of that name, or it "
                                 "starts with '_'); choose another keyword")
            if not name.isidentifier():
                raise StateError(f"object name {name!r} must be a Python identifier")
        if isinstance(per_rank, str):
            per_rank = (per_rank,)
        unknown = sorted(set(per_rank) - set(objects))
        if unknown:
            raise StateError(f"per_rank names {unknown} that are not tracked objects (tracked: {sorted(objects)})")
        self.objects: Dict[str, Any] = dict(objects)
        self.per_rank = frozenset(per_rank)
        self._table: List[Adapter] = _adapters.adapter_table(adapters)
        self._adapter_of: Dict[str, Adapter] = {}

    def add(self, name: str, obj: Any, per_rank: bool = False) -> None:
        """Tracks one more object (an integration's own: every rank adds it alike); ``per_rank``: never
        compared nor broadcast.

        Raises:
            StateError: ``name`` is tracked already.
        """
        if name in self.objects:
            raise StateError(f"object name {name!r} is tracked already")
        self.objects[name] = obj
        if per_rank:
            self.per_rank = self.per_rank | {name}

    def register(self, adapter: Adapter) -> None:
        """Adds ``adapter`` in front of the lookup table."""
        self._table.insert(0, adapter)
        self._adapter_of.clear()

    def adapter(self, name: str) -> Adapter:
        """The adapter for the object tracked as ``name`` now.

        Raises:
            StateError: no adapter handles its type.
        """
        obj = self.objects[name]
        cached = self._adapter_of.get(name)
        if cached is not None and cached.handles(obj):
            return cached
        for adapter in self._table:
            if adapter.handles(obj):
                self._adapter_of[name] = adapter
                return adapter
        raise StateError(f"no adapter for {name!r} of type {type(obj).__module__}.{type(obj).__qualname__}; "
                         "register one with State(adapters=[...]) or state.register_adapter()")

    def prepare(self) -> None:
        """Lets every adapter in use prepare its objects (Keras optimizers build their slots)."""
        used: List[Adapter] = []
        for name in self.objects:
            adapter = self.adapter(name)
            if adapter not in used:
                used.append(adapter)
        for adapter in used:
            prepare = getattr(adapter, "prepare", None)
            if callable(prepare):
                prepare(self.objects)

    def frameworks(self) -> List[str]:
        """The frameworks of the adapters in use, sorted."""
        return sorted({a.framework for a in map(self.adapter, self.objects) if getattr(a, "framework", None)})

    def capture(self) -> Dict[str, Capture]:
        """Every object's capture; nothing is copied yet.

        Raises:
            StateError: an object cannot be captured (the message names it).
        """
        captures = {}
        for name, obj in self.objects.items():
            try:
                captures[name] = self.adapter(name).capture(obj)
            except StateError as exc:
                raise StateError(f"cannot commit {name!r}: {exc}") from exc
        return captures

    def apply(self, name: str, entry: Entry) -> None:
        """Brings object ``name`` to ``entry`` (an adapter may return a new object)."""
        self.objects[name] = self.adapter(name).apply(self.objects[name], entry)

    def synced(self, names: Iterable[str]) -> List[str]:
        """Those of ``names`` whose objects are compared and broadcast across ranks."""
        return [name for name in names if name not in self.per_rank and self.adapter(name).synced]

    def cursors(self, entries: Dict[str, Entry]) -> Dict[str, Dict[str, Any]]:
        """The committed epoch and cursor of every synced elastic sampler (a checkpoint's ``data_cursor``)."""
        return {name: {k: v for k, v in join(entries[name].meta, {}).items() if k in ("epoch", "cursor")}
                for name in self.synced(entries) if isinstance(self.objects[name], ElasticPartitioner)}

    def buffer_keys(self, name: str) -> FrozenSet[str]:
        """Array keys of ``name`` that may differ across ranks (BatchNorm statistics...)."""
        keys = getattr(self.adapter(name), "buffer_keys", None)
        return frozenset(keys(self.objects[name])) if callable(keys) else frozenset()

