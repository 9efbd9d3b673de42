"""Durable asynchronous checkpoints of the committed state: atomic, checksummed, no pickle.

- :mod:`~elastic_ext.checkpoint.format`: the on-disk format (names,
  manifest rules, dtype guard, checksums);
- :mod:`~elastic_ext.checkpoint.direct`: local writes with ``O_DIRECT``;
- :mod:`~elastic_ext.checkpoint.files`: writing and reading one checkpoint;
- :mod:`~elastic_ext.checkpoint.storage`: the file operations, local or
  through fsspec (``s3://``, ``memory://``...), behind one protocol;
- :mod:`~elastic_ext.checkpoint.store`: the checkpoints of a directory
  (listing, newest valid one, retention, read retries);
- :mod:`~elastic_ext.checkpoint.lock`: which job owns a local directory;
- :mod:`~elastic_ext.checkpoint.writer`: the background writer
  :class:`~elastic_ext.State` uses on rank 0.
"""

from elastic_ext.checkpoint.files import read_checkpoint, verify_checkpoint, write_checkpoint
from elastic_ext.checkpoint.format import (ALIGN_BYTES, DATA_FILE, FORMAT, FORMAT_VERSION, MANIFEST_FILE,
                                           MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, Crc32, Loaded, Xxh3, checkpoint_name)
from elastic_ext.checkpoint.lock import LOCK_FILE, OWNER_FILE, DirectoryLock
from elastic_ext.checkpoint.storage import FsspecStorage, LocalStorage, Storage, open_storage
from elastic_ext.checkpoint.store import READ_ATTEMPTS, READ_RETRY_DELAY_S, CheckpointStore
from elastic_ext.checkpoint.writer import Checkpointer

__all__ = [
    "ALIGN_BYTES", "DATA_FILE", "FORMAT", "FORMAT_VERSION", "LOCK_FILE", "MANIFEST_FILE", "MAX_JSON_DEPTH",
    "MAX_MANIFEST_BYTES", "OWNER_FILE", "READ_ATTEMPTS", "READ_RETRY_DELAY_S", "CheckpointStore", "Checkpointer",
    "Crc32", "DirectoryLock", "FsspecStorage", "Loaded", "LocalStorage", "Storage", "Xxh3", "checkpoint_name",
    "open_storage", "read_checkpoint", "verify_checkpoint", "write_checkpoint",
]
