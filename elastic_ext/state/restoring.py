"""The State's way back to a commit: ``restore()``, the background restore, the replay from the agreed commit.

A mixin of :class:`elastic_ext.State`, which provides ``_buffers``,
``_tracked``, ``_digests``, ``_restoring``, ``_guarded``, ``_straggler``,
``_replica``, ``_record`` and ``commit_id``.
"""

from __future__ import annotations

from typing import Optional

from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.errors import NotCommittedError, StateError
from elastic_ext.state.restore import BackgroundRestore, split
from elastic_ext.state.snapshot import copy_meta


class Restoring:
    """``restore`` and what ``run`` uses to restore beside Horovod's re-forming, or to replay."""

    def restore(self, background: bool = False) -> None:
        """Brings every object back to the last commit, bitwise.

        With ``background`` (the run loop's, after a failed collective), the large entries are
        restored, and the commit digested for the next sync, on a thread that the next use of the
        objects or the commit joins (:mod:`elastic_ext.state.restore`: beside Horovod's re-forming;
        :meth:`settle_restore` waits for it).

        Raises:
            NotCommittedError: nothing was committed yet.
            StateError: the last commit is torn (an interrupted copy).
        """
        self.settle_restore()
        if self._buffers.entries is None:
            raise NotCommittedError("restore() called before any commit(); call commit() first")
        if self._buffers.torn:
            raise StateError(f"commit {self.commit_id} is torn (a commit was interrupted while copying); "
                             "it cannot be restored. Use commit_buffers=2 to keep the previous commit intact")
        entries = self._buffers.entries
        now, later = split(entries, self._may_restore_later) if background else (entries, {})
        for name, entry in now.items():
            self._tracked.apply(name, entry)
        if later:
            synced = {name: entries[name] for name in self._tracked.synced(entries)}
            keys = {name: self._tracked.buffer_keys(name) for name in synced}
            object.__setattr__(self, "_restoring", BackgroundRestore(self._tracked.apply, later, synced, keys,
                                                                     self._digests))
        self._guarded.drop()  # the step in flight is undone
        self._straggler.reset()  # replayed steps are not measured against the others

    def _may_restore_later(self, name: str) -> bool:
        """True if object ``name`` may be restored on the background restore's thread (not a sampler,
        not TensorFlow's: see :mod:`elastic_ext.state.restore`)."""
        return not isinstance(self._tracked.objects[name], ElasticPartitioner) \
            and getattr(self._tracked.adapter(name), "framework", None) != "tensorflow"

    def settle_restore(self) -> Optional[float]:
        """Waits for a background restore under way, if any; raises what it raised.

        Returns:
            how long that restore's thread ran (None when none was under way).
        """
        restoring = self._restoring
        if restoring is None:
            return None
        object.__setattr__(self, "_restoring", None)
        restoring.join()
        return restoring.duration_s

    def replay_from_agreed(self) -> None:
        """Brings every object and the commit buffers back to the last commit on which every rank agreed
        (the replica check's, :mod:`elastic_ext.state.agreed`), after a replica mismatch: ``run`` then
        trains again to the commit that differed, with every rank together and no reset."""
        self.settle_restore()
        agreed = self._replica.agreed
        for name, entry in agreed.entries.items():
            # (load copies the kept arrays into the commit buffers: the kept ones stay as they are)
            self._tracked.apply(name, self._buffers.load(name, entry.arrays, copy_meta(entry.meta)))
        self._record.commit_id = int(agreed.commit_id)
        self._record.generation += 1  # the training function starts again, on every rank together
        self._guarded.drop()
        self._straggler.reset()
