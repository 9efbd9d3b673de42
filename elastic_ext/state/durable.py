"""The State's durable side: rank 0 hands agreed commits to the background checkpoint writer.

A mixin of :class:`elastic_ext.State`, which provides ``_checkpointer`` (a
:class:`elastic_ext.checkpoint.Checkpointer`, or None without
``checkpoint_dir``), ``_buffers``, ``_tracked``, ``_binding``, ``_commit_time``,
``commit_id``, ``generation`` and ``_safe_rank``.
"""

from __future__ import annotations

from typing import Optional


class DurableCommits:
    """``wait_for_checkpoint``, ``checkpoint_now`` and the hand-off of each due commit to the writer."""

    def wait_for_checkpoint(self, timeout_s: Optional[float] = None) -> Optional[int]:
        """Waits (at most ``timeout_s``) for the running checkpoint write; returns the
        newest commit id this process wrote or resumed from, or None.

        Call it before the script exits to make the last checkpoint durable.
        A no-op without ``checkpoint_dir`` and on ranks that do not write.
        """
        if self._checkpointer is None:
            return None
        self._checkpointer.wait(timeout_s)
        return self._checkpointer.last_written

    def checkpoint_now(self) -> None:
        """Rank 0 starts writing the agreed commit even if it is not due (a leave, a resize).

        A no-op without ``checkpoint_dir``, on other ranks, and if this commit
        is written already. Pair with :meth:`wait_for_checkpoint` before exiting.
        """
        if self._buffers.entries is not None:
            self._checkpoint_commit(force=True)

    def _checkpoint_commit(self, force: bool = False) -> None:
        """Rank 0 hands the agreed commit's synced buffers to the background writer."""
        writer = self._checkpointer
        if writer is None or self._safe_rank() != 0:
            return
        if not force:
            writer.observe_commit()  # checkpoint_every="auto" measures the commits' intervals
        if not (force or writer.due(self.commit_id)):
            return
        names = self._tracked.synced(self._buffers.entries)
        info = {"world_size": self._binding.size(), "written_by_rank": 0, "generation": self.generation,
                "commit_time": self._commit_time, "data_cursor": self._tracked.cursors(self._buffers.entries),
                "adapters": {name: self._tracked.adapter(name).name for name in names}}
        writer.on_commit(self.commit_id, names, info, force=force)

    def note_failure(self) -> None:
        """A rollback: the cadence of ``checkpoint_every="auto"`` counts the failures the job has seen."""
        if self._checkpointer is not None:
            self._checkpointer.note_failure()

    def _checkpoints_failing(self) -> Optional[str]:
        """On rank 0, what failed once its writes failed ``checkpoint_failure_limit`` times in a row; else None."""
        writer = self._checkpointer
        if writer is None or self._safe_rank() != 0:
            return None
        return writer.failing()
