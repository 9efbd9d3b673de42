"""A commit's digests: one checksum per entry's metadata and array, kept while the entry is committed.

:func:`entry_items` digests one committed entry, :class:`Digests` keeps
them until the entry is replaced, :func:`digest_items` lists the synced
entries' in commit order and :func:`combine` folds them into the one number
per rank the sync (:mod:`elastic_ext.state.sync`) and the replica check
(:mod:`elastic_ext.policies.replica_check`) compare.
"""

from __future__ import annotations

import json
import zlib
from typing import Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import xxhash

from elastic_ext.state.snapshot import Entry
from elastic_ext.state.tree import describe_key

DigestItem = Tuple[str, int, bool]  # (label, checksum, must agree across ranks?)
INT63 = (1 << 63) - 1


def entry_items(name: str, entry: Entry, buffers: FrozenSet[str]) -> List[DigestItem]:
    """One item for the metadata and for every array of committed entry ``name``; arrays
    named in ``buffers`` (BatchNorm statistics...) need not agree."""
    items = [(f"{name} (metadata)", zlib.crc32(json.dumps(entry.meta, sort_keys=True).encode()), True)]
    for key, array in entry.arrays.items():
        # XXH3-64: at memory speed, 5x CRC-32's here; it is on the recovery's path (437 MB: 0.13 s with CRC-32).
        digest = xxhash.xxh3_64(f"{array.dtype.str}:{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).view(np.uint8).data)
        value = digest.intdigest() & INT63  # the diagnosis gathers these in an int64 table
        items.append((f"{name}{describe_key(key)}", value, key not in buffers))
    return items


class Digests:
    """The digest items of committed entries, kept until the entry is replaced.

    A commit, a sync that loads and a resume each put a new :class:`Entry`
    in the buffers, so an entry's items hold while that very object is the
    committed one. A restore after a failed collective digests the commit
    on its thread (:mod:`elastic_ext.state.restore`); the next sync finds
    the items here instead of reading the bytes again on its critical path,
    and clears them (kept longer, they would keep replaced buffers alive).
    """

    def __init__(self) -> None:
        self._kept: Dict[str, Tuple[Entry, FrozenSet[str], List[DigestItem]]] = {}

    def clear(self) -> None:
        self._kept.clear()

    def items(self, name: str, entry: Entry, buffers: FrozenSet[str]) -> List[DigestItem]:
        kept = self._kept.get(name)
        if kept is not None and kept[0] is entry and kept[1] == buffers:
            return kept[2]
        items = entry_items(name, entry, buffers)
        self._kept[name] = (entry, buffers, items)
        return items


def digest_items(entries: Dict[str, Entry], names: List[str], buffer_keys: Dict[str, FrozenSet[str]],
                 digests: Optional[Digests] = None) -> List[DigestItem]:
    """The items of the synced entries ``names``, in commit order (kept ones from ``digests``)."""
    items: List[DigestItem] = []
    for name in names:
        keys = buffer_keys.get(name, frozenset())
        items.extend(digests.items(name, entries[name], keys) if digests is not None
                     else entry_items(name, entries[name], keys))
    return items


def combine(items: List[DigestItem], strict_only: bool) -> int:
    """One CRC32 over the per-entry ones (labels included, so a renamed entry counts)."""
    crc = 0
    for label, value, strict in items:
        if strict or not strict_only:
            crc = zlib.crc32(f"{label}={value};".encode(), crc)
    return crc
