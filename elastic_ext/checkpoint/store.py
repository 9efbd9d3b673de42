"""The checkpoints under one directory: listing, the newest valid one, retention, read retries.

:meth:`CheckpointStore.load_newest` skips a corrupt or partial checkpoint
with a warning (path and reason) and falls back to the previous one; when
none is left but some were corrupt, or one is of a newer format, it stops
the job unless told to start fresh. A storage error (permission denied, EIO, a 503) is retried a few times, then
raised as :class:`CheckpointReadError`: it says nothing about the checkpoint,
so the job must stop rather than silently train from an older state.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Set

from elastic_ext.checkpoint.files import read_checkpoint, verify_checkpoint
from elastic_ext.checkpoint.format import FRESH_START_HINT, MANIFEST_FILE, NAME_PATTERN, Loaded, checkpoint_name
from elastic_ext.checkpoint.storage import open_storage
from elastic_ext.errors import (CheckpointError, CheckpointReadError, ConfigError, CorruptCheckpointError,
                                PartialCheckpointError, UnsupportedCheckpointError)

logger = logging.getLogger(__name__)

# Reads of a checkpoint that fail with a storage error are tried this many
# times in all, waiting READ_RETRY_DELAY_S, then twice that, between tries.
READ_ATTEMPTS = 3
READ_RETRY_DELAY_S = 0.5


class CheckpointStore:
    """The checkpoints under one directory: list, load the newest valid one, apply retention.

    Args:
        directory: a local path or an fsspec URL.
        read_attempts: how many times a read that fails with a storage error
            (not corruption) is tried before :meth:`load_newest` gives up
            (default :data:`READ_ATTEMPTS`).
        retry_delay_s: the wait before the second try; it doubles after each
            (default :data:`READ_RETRY_DELAY_S`).
    """

    def __init__(self, directory: str, read_attempts: Optional[int] = None,
                 retry_delay_s: Optional[float] = None) -> None:
        read_attempts = READ_ATTEMPTS if read_attempts is None else read_attempts
        retry_delay_s = READ_RETRY_DELAY_S if retry_delay_s is None else retry_delay_s
        if type(read_attempts) is not int or read_attempts < 1:
            raise ConfigError(f"read_attempts ({read_attempts!r}) must be an integer >= 1")
        if not retry_delay_s >= 0:
            raise ConfigError(f"retry_delay_s ({retry_delay_s!r}) must be a number >= 0")
        self.directory = directory
        self.read_attempts = read_attempts
        self.retry_delay_s = float(retry_delay_s)
        self._storage = open_storage(directory)
        self._retention_warned: set = set()  # what retention could not delete, warned about once
        self.not_deleted: List[int] = []      # ids the last apply_retention failed to delete
        self.held: Optional[int] = None       # see hold()
        self._verified: Set[int] = set()      # ids retention verified

    def commit_ids(self) -> List[int]:
        """Ids of every ``ckpt-*`` directory, complete or not, newest first.

        Raises:
            CheckpointReadError: the directory cannot be listed.
        """
        try:
            names = self._storage.list_names()
        except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own types
            raise CheckpointReadError(f"cannot list checkpoints in {self.directory}: "
                                      f"{type(exc).__name__}: {exc}") from exc
        return sorted((int(m.group(1)) for m in map(NAME_PATTERN.match, names) if m), reverse=True)

    def path(self, commit_id: int) -> str:
        return self._storage.address(checkpoint_name(commit_id))

    def _retried(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, tried again on CheckpointReadError up to ``read_attempts`` times in all."""
        delay = self.retry_delay_s
        for attempt in range(1, self.read_attempts + 1):
            try:
                return fn()
            except CheckpointReadError as exc:
                if attempt == self.read_attempts:
                    raise CheckpointReadError(
                        f"{exc} (tried {attempt} time(s); a storage error is not corruption, so the job does not "
                        f"fall back to an older checkpoint or its initial state: make {self.directory} "
                        "readable, or move the unreadable checkpoint away)") from exc
                logger.warning("%s failed (try %d of %d), retrying in %.1f s: %s", what, attempt,
                               self.read_attempts, delay, exc)
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # the loop returns or raises

    def load_newest(self, fresh_start: bool = False) -> Optional[Loaded]:
        """The newest checkpoint that verifies, or None if there is none to resume from.

        Each corrupt or partial one is skipped with a warning that names it
        and the reason, and the previous one is tried. A storage error is
        retried (``read_attempts``), then raised: it never makes the job fall
        back. Without ``fresh_start``, checkpoints that exist but cannot be
        used stop the job rather than let it train again from its initial
        state and overwrite them: one of a newer format version, or a
        directory whose every checkpoint with a manifest fails verification.
        Partial checkpoints (no manifest: a write that was cut) never do.

        Raises:
            CheckpointReadError: listing or reading failed with a storage
                error on every try; the message names the path and the error.
            UnsupportedCheckpointError: a checkpoint of a newer format
                version (unless ``fresh_start``).
            CheckpointError: every checkpoint with a manifest is corrupt
                (unless ``fresh_start``), or one does not fit in memory.
        """
        skipped, corrupt = [], []
        for commit_id in self._retried(f"listing {self.directory}", self.commit_ids):
            path = self.path(commit_id)
            try:
                loaded = self._retried(f"reading {path}", lambda: read_checkpoint(path))
            except (CorruptCheckpointError, UnsupportedCheckpointError) as exc:
                if isinstance(exc, UnsupportedCheckpointError) and not fresh_start:
                    raise
                logger.warning("skipping checkpoint: %s", exc)  # the message starts with its path
                skipped.append(commit_id)
                if not isinstance(exc, PartialCheckpointError):
                    corrupt.append(str(exc))
                continue
            if skipped:
                logger.warning("resuming from checkpoint %s (commit %d), older than the skipped %s",
                               loaded.path, commit_id, skipped)
            return loaded
        if corrupt and not fresh_start:
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be used: {len(corrupt)} failed verification (the newest: "
                f"{corrupt[0]}); starting from the initial state would train again and later overwrite them. "
                f"Move them away, or allow a fresh start with {FRESH_START_HINT}")
        if skipped:
            logger.warning("no valid checkpoint in %s (skipped %s); starting from the initial state",
                           self.directory, skipped)
        return None

    def hold(self, commit_id: int) -> None:
        """Keeps the newest checkpoint at or before ``commit_id`` through every retention until :meth:`release`.

        For the replica check: when ranks disagree and nothing explains it,
        the checkpoints written since the last agreed commit may hold the
        corrupt copy, and the one before must outlive ``keep_last``.
        """
        if type(commit_id) is not int or commit_id < 0:
            raise ConfigError(f"hold({commit_id!r}): a commit id is an integer >= 0")
        self.held = commit_id

    def release(self) -> None:
        """Ends :meth:`hold`: retention applies ``keep_last`` alone again."""
        self.held = None

    def _verifies(self, commit_id: int) -> bool:
        """True if checkpoint ``commit_id`` verifies now or did before (a checkpoint is never changed in place)."""
        if commit_id in self._verified:
            return True
        try:
            verify_checkpoint(self.path(commit_id))
        except Exception as exc:  # noqa: BLE001 - not verified is all retention needs to know
            self._retention_failed(("verify", commit_id), f"retention: {type(exc).__name__}: {exc}; not counted "
                                                          "as a checkpoint to keep")
            return False
        self._verified.add(commit_id)
        return True

    def apply_retention(self, newest: int, keep_last: int) -> List[int]:
        """Deletes checkpoints older than ``newest`` beyond the policy; returns the deleted ids.

        Kept: the newest ``keep_last`` checkpoints up to ``newest`` that
        verify (each is verified once, streamed through its checksum: one
        read of the new checkpoint per write), ``newest`` itself, the one
        :meth:`hold` names, and whatever lies between them (a corrupt one is
        not counted). Older ones go, and so do partial ones (leftovers of cut
        writes) older than ``newest``. When nothing verifies, no checkpoint
        with a manifest is deleted. Ids above ``newest`` are left alone: they
        are what a previous run wrote past the checkpoint this run resumed
        from, and are overwritten as the job reaches those ids again.

        Never raises: an entry that cannot be deleted (a symbolic link, a
        permission error) is logged once, listed in :attr:`not_deleted`, and
        tried again at the next call. It never affects the checkpoint that
        was just written.
        """
        self.not_deleted = []
        self._verified.discard(newest)  # written again just now
        try:
            ids = self.commit_ids()
            complete = [i for i in ids if i <= newest
                        and self._storage.exists(self._storage.join(checkpoint_name(i), MANIFEST_FILE))]
        except Exception as exc:  # noqa: BLE001 - retention is housekeeping: report, never fail the write
            self._retention_failed("list", f"retention cannot list {self.directory}: {type(exc).__name__}: {exc}")
            return []
        verified: List[int] = []
        for commit_id in complete:
            if len(verified) == keep_last:
                break
            if self._verifies(commit_id):
                verified.append(commit_id)
        keep = set(verified) | {newest}
        held = self.held
        if held is not None:
            before = [i for i in complete if i <= held]
            keep.add(next((i for i in before if self._verifies(i)), before[0]) if before else newest)
        floor = min(verified) if verified else -1  # below the oldest kept one that verifies: all goes
        deleted = []
        for commit_id in (i for i in ids if i < newest and i not in keep and (i < floor or i not in complete)):
            try:
                self._storage.remove(self._storage.join(checkpoint_name(commit_id)))
            except Exception as exc:  # noqa: BLE001 - as above
                self.not_deleted.append(commit_id)
                self._retention_failed(commit_id, f"retention cannot delete {self.path(commit_id)}: "
                                                  f"{type(exc).__name__}: {exc}")
                continue
            self._retention_warned.discard(commit_id)
            self._verified.discard(commit_id)
            deleted.append(commit_id)
        return deleted

    def _retention_failed(self, key: Any, message: str) -> None:
        # Once per entry: the same undeletable entry would otherwise be reported at every checkpoint.
        if key in self._retention_warned:
            logger.debug("%s (reported before)", message)
            return
        self._retention_warned.add(key)
        logger.warning("%s; it is left in place and tried again after later checkpoints (this warning is "
                       "not repeated)", message)
