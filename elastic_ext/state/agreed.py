"""The last commit on which every rank agreed, kept in host memory so that a replica mismatch can be replayed.

With the replica check on (``replica_check_every`` > 0), a mismatch at
commit c is explained before anything is healed: every rank goes back to
the last commit a on which all ranks agreed and trains again to c
(:mod:`elastic_ext.policies.replica_check`). The commit buffers hold only the newest
commit, so a is kept here, as a copy of every entry (synced and per-rank:
RNG streams too, so the replay draws what the first pass drew):

- at a checked commit whose digests all agree (:meth:`AgreedCommit.keep`);
- after a sync, which leaves every rank with the same bytes of what must
  agree: the copy is taken at the next commit, before that commit can
  overwrite the synced one (:meth:`AgreedCommit.note_synced`,
  :meth:`AgreedCommit.keep_pending`), so it is not on the recovery's path.

Its price: one more host copy of the committed state (reused from one keep
to the next: nothing is allocated in steady training), and a ``memcpy`` of
it at every agreed check and after every sync.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from elastic_ext.state.buffers import reuse
from elastic_ext.state.snapshot import Entry, copy_meta

Entries = Dict[str, Entry]


class AgreedCommit:
    """A copy of the last commit on which every rank agreed, and its id (see the module docstring)."""

    def __init__(self) -> None:
        self.commit_id: Optional[int] = None
        self.entries: Optional[Entries] = None
        self._pending: Optional[int] = None  # a synced commit to keep before the next one overwrites it

    def keep(self, entries: Entries, commit_id: int) -> None:
        """Copies ``entries`` (commit ``commit_id``, agreed by every rank) into the kept buffers."""
        kept: Entries = {}
        for name, entry in entries.items():
            old = self.entries.get(name) if self.entries else None
            arrays = {}
            for key, array in entry.arrays.items():
                buffer = reuse(old, key, array.shape, array.dtype)
                np.copyto(buffer, array)
                arrays[key] = buffer
            kept[name] = Entry(arrays=arrays, meta=copy_meta(entry.meta))
        self.entries, self.commit_id, self._pending = kept, commit_id, None

    def note_synced(self, commit_id: int) -> None:
        """Every rank now holds the same commit ``commit_id``: keep it at the next :meth:`keep_pending`."""
        self._pending = commit_id

    def keep_pending(self, entries: Optional[Entries], commit_id: int) -> None:
        """Before a commit overwrites the buffers: keeps the synced commit they still hold, if one is due."""
        if self._pending is not None and entries is not None and self._pending == commit_id:
            self.keep(entries, commit_id)
        self._pending = None

    def drop(self) -> None:
        """Forgets the kept commit (the check was turned off)."""
        self.entries = self.commit_id = self._pending = None
