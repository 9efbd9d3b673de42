"""Commit buffers: the host copies of the last commit, their reuse, the torn flag, the lease.

:class:`CommitBuffers` owns every host buffer a :class:`~elastic_ext.State`
commits into; :class:`~elastic_ext.checkpoint.Checkpointer` leases some of
them while it writes them out. Both talk to this object directly.

- *Reuse*: a commit copies into the previous commit's buffers when shape
  and dtype match (:func:`reuse`), so steady training allocates nothing.
- *Torn*: with one buffer set, an exception while copying (from a framework
  copy) leaves the previous commit half overwritten. :attr:`torn` then says
  so: it is never restored from, and ``sync()`` treats the rank as a
  newcomer.
- *Double buffer*: with two sets (``commit_buffers=2``) a commit copies into
  the spare set, swapped in only at the end, so the previous commit survives
  even an interrupted copy.
- *Alignment*: buffers of 1 MiB or more start on a page, so the checkpoint
  writer can hand them to ``O_DIRECT`` writes without a copy.
- *Lease*: a background checkpoint write reads the buffers of the commit it
  writes. Until the writer releases its :class:`Lease`, later commits and
  syncs copy into other buffers (a parked set from an earlier write, or new
  ones): one extra host copy of the synced state at most.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, Iterable, List, Optional, Set, Tuple

import numpy as np

from elastic_ext.state import written
from elastic_ext.state.snapshot import ArraySource, Capture, Entry, copy_meta

Entries = Dict[str, Entry]


PAGE_BYTES = 4096            # the alignment O_DIRECT needs
ALIGNED_MIN_BYTES = 1 << 20  # smaller buffers are not written with O_DIRECT: no need to align them


def aligned_empty(shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``, starting on a page if it holds at least 1 MiB (4 KiB more allocated)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < ALIGNED_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    raw = np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_BYTES
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def reuse(old: Optional[Entry], key: str, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``old``'s buffer for ``key`` if it has this shape and dtype, else a new empty one."""
    buffer = old.arrays.get(key) if old is not None else None
    if buffer is None or buffer.shape != tuple(shape) or buffer.dtype != dtype:
        buffer = aligned_empty(tuple(shape), np.dtype(dtype))
    return buffer


@dataclasses.dataclass
class Lease:
    """Entries a checkpoint write reads; the writer calls :meth:`release` when it is done."""

    entries: Entries
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def release(self) -> None:
        """Says the write no longer reads the buffers (safe from the writer's thread)."""
        self.done.set()


class CommitBuffers:
    """The committed entries of one State, with one or two buffer sets.

    Args:
        count: 1 (one set; an interrupted copy tears the commit) or 2 (a
            spare set; the previous commit survives an interrupted copy).
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.entries: Optional[Entries] = None   # name -> Entry, the last commit
        self.spare: Optional[Entries] = None     # the other set (count=2)
        self.torn = False                        # the last commit was overwritten halfway
        self._lease: Optional[Lease] = None
        self._parked: Entries = {}               # a finished write's buffers, for reuse

    # ------------------------------------------------------------- commit

    def copy(self, captures: Dict[str, Capture]) -> None:
        """Copies the captured arrays into buffers and makes them the last commit.

        Raises:
            whatever a source's ``copy_into`` raises; :attr:`torn` then says
            whether the previous commit was damaged (one buffer set only).
        """
        base = self._writable(self.entries if self.count == 1 else self.spare)
        plan: List[Tuple[ArraySource, np.ndarray]] = []
        entries: Entries = {}
        for name, capture in captures.items():
            old = base.get(name) if base else None
            arrays = {}
            for key, source in capture.arrays.items():
                buffer = reuse(old, key, tuple(source.shape), np.dtype(source.dtype))
                plan.append((source, buffer))
                arrays[key] = buffer
            entries[name] = Entry(arrays=arrays, meta=copy_meta(capture.meta))
        if self.count == 1:
            # From here on the buffers of the previous commit are being overwritten.
            self.torn = self.entries is not None
        try:
            for source, buffer in plan:
                source.copy_into(buffer)
        except BaseException:
            if not (self.count == 1 and self.entries is not None):
                self.torn = False
            raise
        if self.count == 2:
            self.spare = self.entries
        self.entries = entries
        self.torn = False

    def load(self, name: str, arrays: Dict[str, np.ndarray], meta: dict) -> Entry:
        """Copies received arrays into ``name``'s buffers (reused unless leased); returns the new entry."""
        old = self.entries.get(name)
        if self.is_leased(old):
            old = None  # a checkpoint write is reading those buffers
        loaded = {}
        for key, value in arrays.items():
            buffer = reuse(old, key, value.shape, value.dtype)
            written.forget(buffer)  # no longer equal to the memory it was paired with
            np.copyto(buffer, value)
            loaded[key] = buffer
        self.entries[name] = Entry(arrays=loaded, meta=meta)
        return self.entries[name]

    # -------------------------------------------------------------- lease

    def lease(self, names: Iterable[str]) -> Lease:
        """Lends the last commit's entries ``names`` to a checkpoint write (one at a time)."""
        self._collect()
        if self._lease is not None:
            raise RuntimeError("a checkpoint write still holds its lease; wait for it before leasing again")
        self._lease = Lease({name: self.entries[name] for name in names})
        return self._lease

    def is_leased(self, entry: Optional[Entry]) -> bool:
        """True if a running write reads this entry's buffers (they must not be overwritten)."""
        self._collect()
        leased = self._leased_ids()
        return entry is not None and any(id(a) in leased for a in entry.arrays.values())

    def _leased_ids(self) -> Set[int]:
        lease = self._lease.entries if self._lease is not None else {}
        return {id(a) for entry in lease.values() for a in entry.arrays.values()}

    def _collect(self) -> None:
        """Parks a released lease's buffers that no commit uses any more."""
        if self._lease is None or not self._lease.done.is_set():
            return
        in_use = {id(a) for entries in (self.entries, self.spare) if entries
                  for e in entries.values() for a in e.arrays.values()}
        self._parked = {name: entry for name, entry in self._lease.entries.items()
                        if not any(id(a) in in_use for a in entry.arrays.values())}
        self._lease = None

    def _writable(self, base: Optional[Entries]) -> Optional[Entries]:
        """``base`` with every leased entry swapped for a parked one (or dropped: fresh buffers)."""
        self._collect()
        if base is None or self._lease is None:
            return base
        leased = self._leased_ids()
        out = {}
        for name, entry in base.items():
            if any(id(a) in leased for a in entry.arrays.values()):
                spare = self._parked.pop(name, None)
                if spare is not None:
                    out[name] = spare
            else:
                out[name] = entry
        return out
