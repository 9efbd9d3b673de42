"""The checkpoints under one directory: listing, the newest valid one, retention, read retries.

:meth:`CheckpointStore.load_newest` skips a corrupt or partial checkpoint
with a warning (path and reason) and falls back to the previous one. A
storage error (permission denied, EIO, a 503) is retried a few times, then
raised as :class:`CheckpointReadError`: it says nothing about the checkpoint,
so the job must stop rather than silently train from an older state.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional

from elastic_ext.checkpoint.files import read_checkpoint
from elastic_ext.checkpoint.format import MANIFEST_FILE, NAME_PATTERN, Loaded, checkpoint_name
from elastic_ext.checkpoint.storage import open_storage
from elastic_ext.errors import CheckpointReadError, ConfigError, CorruptCheckpointError

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

    def load_newest(self) -> Optional[Loaded]:
        """The newest checkpoint that verifies, or None if there is none.

        Each corrupt or partial one is skipped with a warning that names it
        and the reason. A storage error is retried (``read_attempts``), then
        raised: it never makes the job fall back.

        Raises:
            CheckpointReadError: listing or reading failed with a storage
                error on every try; the message names the path and the error.
            CheckpointError: a checkpoint cannot be loaded for another reason
                than corruption (it does not fit in memory).
        """
        skipped = []
        for commit_id in self._retried(f"listing {self.directory}", self.commit_ids):
            path = self.path(commit_id)
            try:
                loaded = self._retried(f"reading {path}", lambda: read_checkpoint(path))
            except CorruptCheckpointError as exc:
                logger.warning("skipping checkpoint: %s", exc)  # the message starts with its path
                skipped.append(commit_id)
                continue
            if skipped:
                logger.warning("resuming from checkpoint %s (commit %d), older than the skipped %s",
                               loaded.path, commit_id, skipped)
            return loaded
        if skipped:
            logger.warning("no valid checkpoint in %s (skipped %s); starting from the initial state",
                           self.directory, skipped)
        return None

    def apply_retention(self, newest: int, keep_last: int) -> List[int]:
        """Deletes checkpoints older than ``newest`` beyond the policy; returns the deleted ids.

        Kept: the newest ``keep_last`` complete checkpoints up to ``newest``.
        Partial ones older
        than ``newest`` are leftovers of cut writes and go. Ids above
        ``newest`` are left alone: they are what a previous run wrote past
        the checkpoint this run resumed from, and are overwritten as the job
        reaches those ids again.

        Never raises: an entry that cannot be deleted (a symbolic link, a
        permission error) is logged once, listed in :attr:`not_deleted`, and
        tried again at the next call. It never affects the checkpoint that
        was just written.
        """
        self.not_deleted = []
        try:
            ids = self.commit_ids()
            complete = [i for i in ids if i <= newest
                        and self._storage.exists(self._storage.join(checkpoint_name(i), MANIFEST_FILE))]
        except Exception as exc:  # noqa: BLE001 - retention is housekeeping: report, never fail the write
            self._retention_failed("list", f"retention cannot list {self.directory}: {type(exc).__name__}: {exc}")
            return []
        keep = set(complete[:keep_last]) | {newest}
        deleted = []
        for commit_id in (i for i in ids if i < newest and i not in keep):
            try:
                self._storage.remove(self._storage.join(checkpoint_name(commit_id)))
            except Exception as exc:  # noqa: BLE001 - as above
                self.not_deleted.append(commit_id)
                self._retention_failed(commit_id, f"retention cannot delete {self.path(commit_id)}: "
                                                  f"{type(exc).__name__}: {exc}")
                continue
            self._retention_warned.discard(commit_id)
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
