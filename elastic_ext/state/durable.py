"""The State's durable part: rank 0 hands agreed commits to the background checkpoint writer.

:class:`DurableCommits` is a part of :class:`elastic_ext.state.state.CoreState`,
built with what it uses (its constructor's arguments) and nothing else of the
State; the State exposes ``wait_for_checkpoint``, ``checkpoint_now`` and
``note_failure``, and its commit calls :meth:`DurableCommits.checkpoint_commit`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Protocol

from elastic_ext.binding import Binding, rank_or_unknown
from elastic_ext.state.buffers import CommitBuffers
from elastic_ext.state.records import CommitRecord
from elastic_ext.state.tracked import Tracked


class CommitWriter(Protocol):
    """What the durable part asks of the writer (:class:`elastic_ext.checkpoint.Checkpointer`).

    A Protocol rather than the class: the checkpoint package writes the commit
    buffers and so sits on top of this one, which must not import it back.
    """

    last_written: Optional[int]  # the newest commit id this process wrote or resumed from

    def wait(self, timeout_s: Optional[float] = None) -> Any:
        """Waits (at most ``timeout_s``) for the running write."""

    def observe_commit(self) -> None:
        """Counts a commit's interval (``checkpoint_every="auto"``)."""

    def due(self, commit_id: int) -> bool:
        """True if commit ``commit_id`` is due to be written."""

    def on_commit(self, commit_id: int, names: Iterable[str], info: Dict[str, Any], force: bool = False) -> None:
        """Starts writing the commit's entries ``names`` in the background."""

    def note_failure(self) -> None:
        """Counts a failure the job has seen (``checkpoint_every="auto"``)."""

    def failing(self) -> Optional[str]:
        """What failed once the writes failed ``checkpoint_failure_limit`` times in a row; else None."""


class DurableCommits:
    """``wait_for_checkpoint``, ``checkpoint_now`` and the hand-off of each due commit to the writer.

    Args:
        writer: the background checkpoint writer, or None without ``checkpoint_dir``.
        buffers: the commit buffers the writer reads.
        tracked: the tracked objects (which entries are synced, their adapters, the samplers' cursors).
        record: where this rank stands (its commit id, generation and commit time, read when a commit is handed over).
        binding: this rank (only rank 0 writes) and the world's size, written in the checkpoint's manifest;
            asked for when a commit is handed over (the State's, which a test may replace).
    """

    def __init__(self, *, writer: Optional[CommitWriter], buffers: CommitBuffers, tracked: Tracked,
                 record: CommitRecord, binding: Callable[[], Binding]) -> None:
        self._writer, self._buffers, self._tracked, self._record = writer, buffers, tracked, record
        self._binding = binding

    def wait_for_checkpoint(self, timeout_s: Optional[float] = None) -> Optional[int]:
        """Waits (at most ``timeout_s``) for the running checkpoint write; returns the
        newest commit id this process wrote or resumed from, or None.

        Call it before the script exits to make the last checkpoint durable.
        A no-op without ``checkpoint_dir`` and on ranks that do not write.
        """
        if self._writer is None:
            return None
        self._writer.wait(timeout_s)
        return self._writer.last_written

    def checkpoint_now(self) -> None:
        """Rank 0 starts writing the agreed commit even if it is not due (a leave, a resize).

        A no-op without ``checkpoint_dir``, on other ranks, and if this commit
        is written already. Pair with :meth:`wait_for_checkpoint` before exiting.
        """
        if self._buffers.entries is not None:
            self.checkpoint_commit(force=True)

    def checkpoint_commit(self, force: bool = False) -> None:
        """Rank 0 hands the agreed commit's synced buffers to the background writer, when it is due
        (or ``force``)."""
        writer = self._writer
        if writer is None or rank_or_unknown(self._binding()) != 0:
            return
        if not force:
            writer.observe_commit()  # checkpoint_every="auto" measures the commits' intervals
        record = self._record
        if not (force or writer.due(record.commit_id)):
            return
        names = self._tracked.synced(self._buffers.entries)
        info = {"world_size": self._binding().size(), "written_by_rank": 0, "generation": record.generation,
                "commit_time": record.commit_time, "data_cursor": self._tracked.cursors(self._buffers.entries),
                "adapters": {name: self._tracked.adapter(name).name for name in names}}
        writer.on_commit(record.commit_id, names, info, force=force)

    def note_failure(self) -> None:
        """A rollback: the cadence of ``checkpoint_every="auto"`` counts the failures the job has seen."""
        if self._writer is not None:
            self._writer.note_failure()

    def checkpoints_failing(self) -> Optional[str]:
        """On rank 0, what failed once its writes failed ``checkpoint_failure_limit`` times in a row; else None."""
        writer = self._writer
        if writer is None or rank_or_unknown(self._binding()) != 0:
            return None
        return writer.failing()
