"""The State's way back to a commit: ``restore()``, the background restore, the replay from the agreed commit.

:class:`Restorer` is a part of :class:`elastic_ext.state.state.CoreState`,
built with what it uses (its constructor's arguments) and nothing else of the
State, which exposes ``restore``, ``settle_restore`` and ``replay_from_agreed``.
"""

from __future__ import annotations

from typing import Callable, Optional

from elastic_ext.data.sampler import ElasticPartitioner
from elastic_ext.errors import NotCommittedError, StateError
from elastic_ext.state.agreed import AgreedCommit
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.digests import Digests
from elastic_ext.state.records import CommitRecord
from elastic_ext.state.restore import BackgroundRestore, split
from elastic_ext.state.snapshot import copy_meta
from elastic_ext.state.tracked import Tracked


class Restorer:
    """``restore`` and what ``run`` uses to restore beside Horovod's re-forming, or to replay.

    Args:
        tracked: the tracked objects, restored through their adapters.
        buffers: the commit buffers restored from (and, at a replay, loaded with the agreed commit).
        digests: where the background restore leaves the commit's digests for the next sync.
        record: where this rank stands (its commit id; a replay sets it back and starts a generation).
        rewind_policies: what going back to a commit does to the policies (the guard drops the step in
            flight, the straggler watch its measures of the steps that will be replayed).
        agreed: the last commit on which every rank agreed (the replica check's, asked for at a replay).
    """

    def __init__(self, *, tracked: Tracked, buffers: CommitBuffers, digests: Digests, record: CommitRecord,
                 rewind_policies: Callable[[], None], agreed: Callable[[], AgreedCommit]) -> None:
        self._tracked, self._buffers, self._digests, self._record = tracked, buffers, digests, record
        self._rewind_policies, self._agreed = rewind_policies, agreed
        self.background: Optional[BackgroundRestore] = None  # a background restore under way

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
            raise StateError(f"commit {self._record.commit_id} is torn (a commit was interrupted while copying); "
                             "it cannot be restored. Use commit_buffers=2 to keep the previous commit intact")
        entries = self._buffers.entries
        now, later = split(entries, self.may_restore_later) if background else (entries, {})
        for name, entry in now.items():
            self._tracked.apply(name, entry)
        if later:
            synced = {name: entries[name] for name in self._tracked.synced(entries)}
            keys = {name: self._tracked.buffer_keys(name) for name in synced}
            self.background = BackgroundRestore(self._tracked.apply, later, synced, keys, self._digests)
        self._rewind_policies()  # the step in flight is undone; replayed steps are not measured

    def may_restore_later(self, name: str) -> bool:
        """True if object ``name`` may be restored on the background restore's thread (not a sampler,
        not TensorFlow's: see :mod:`elastic_ext.state.restore`)."""
        return not isinstance(self._tracked.objects[name], ElasticPartitioner) \
            and getattr(self._tracked.adapter(name), "framework", None) != "tensorflow"

    def settle_restore(self) -> Optional[float]:
        """Waits for a background restore under way, if any; raises what it raised.

        Returns:
            how long that restore's thread ran (None when none was under way).
        """
        restoring = self.background
        if restoring is None:
            return None
        self.background = None
        restoring.join()
        return restoring.duration_s

    def replay_from_agreed(self) -> None:
        """Brings every object and the commit buffers back to the last commit on which every rank agreed
        (the replica check's, :mod:`elastic_ext.state.agreed`), after a replica mismatch: ``run`` then
        trains again to the commit that differed, with every rank together and no reset."""
        self.settle_restore()
        agreed = self._agreed()
        for name, entry in agreed.entries.items():
            # (load copies the kept arrays into the commit buffers: the kept ones stay as they are)
            self._tracked.apply(name, self._buffers.load(name, entry.arrays, copy_meta(entry.meta)))
        self._record.commit_id = int(agreed.commit_id)
        self._record.generation += 1  # the training function starts again, on every rank together
        self._rewind_policies()
