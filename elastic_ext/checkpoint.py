"""Durable asynchronous checkpoints of the committed state: atomic, checksummed, no pickle.

A checkpoint is one directory per commit id, ``<dir>/ckpt-<commit id>/``:

- ``arrays.bin``: the raw bytes of every committed array, one after the
  other (each starts on a 64-byte boundary);
- ``manifest.json``, written last: commit id, world size, generation, data
  cursor, versions and times, each object's JSON metadata (the ``Entry.meta``
  skeleton), the ``[name, key, dtype, shape, offset, bytes]`` table of the
  arrays, the size and CRC-32 of ``arrays.bin``, and the CRC-32 of the
  manifest itself.

Each file is written to ``<name>.tmp``, flushed, fsynced and renamed into
place, then the directory is fsynced; a directory without a manifest is a
*partial* checkpoint (the write was cut) and is never loaded. Loading reads
JSON and raw bytes into ``np.empty`` buffers of numeric dtypes only, so it
cannot execute code. A checkpoint that fails any check raises
:class:`CorruptCheckpointError`; :meth:`CheckpointStore.load_newest` logs it
(path and reason) and falls back to the previous one.

Paths with a scheme (``s3://``, ``memory://``...) go through fsspec; object
stores have no rename, so there the manifest written last is what makes a
checkpoint valid.

Who writes: rank 0 alone, the synced entries only. They are identical on
every rank (``sync`` checks it), so one copy is the whole state; sharding by
rank would need a second agreement round on which shards are complete, and
the write is off the training path anyway. Per-rank entries (RNG streams)
are not checkpointed: after a restart from storage each rank keeps the
streams its script seeded.

:class:`Checkpointer` is the glue :class:`~elastic_ext.State` uses: one
write in flight at a time on a background thread, over the buffers of the
commit it writes, which the next commits do not overwrite (they copy into a
parked spare set instead: one extra host copy of the synced state at most).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import platform
import re
import shutil
import sys
import threading
import time
import weakref
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from elastic_ext.adapters import Entry
from elastic_ext.errors import CheckpointError, CorruptCheckpointError

logger = logging.getLogger(__name__)

FORMAT = "elastic_ext.checkpoint"
FORMAT_VERSION = 1
DATA_FILE = "arrays.bin"
MANIFEST_FILE = "manifest.json"
ALIGN_BYTES = 64
CHUNK_BYTES = 64 << 20
_NAME = re.compile(r"^ckpt-(\d+)$")
_SAFE_KINDS = "biufc"  # bool, ints, floats, complex: dtypes that cannot hold objects


def checkpoint_name(commit_id: int) -> str:
    return f"ckpt-{commit_id:012d}"


@dataclasses.dataclass
class Loaded:
    """A verified checkpoint: its manifest and the committed entries by object name."""

    path: str
    commit_id: int
    manifest: dict
    entries: Dict[str, Entry]


# ----------------------------------------------------------------- storage

class _Storage:
    """The few file operations the format needs, on a local path or an fsspec URL."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"
        self.remote = "://" in root
        if self.remote:
            import fsspec  # only for URLs
            self.fs, self.base = fsspec.core.url_to_fs(root)
        else:
            self.fs, self.base = None, os.path.abspath(root)

    def join(self, *parts: str) -> str:
        return "/".join((self.base,) + parts) if self.remote else os.path.join(self.base, *parts)

    def address(self, *parts: str) -> str:
        """What a user passes back in: the URL for fsspec, the path otherwise."""
        return "/".join((self.root,) + parts) if self.remote else self.join(*parts)

    def makedirs(self, path: str) -> None:
        if self.remote:
            self.fs.makedirs(path, exist_ok=True)
        else:
            os.makedirs(path, exist_ok=True)

    def list_names(self) -> List[str]:
        if self.remote:
            if not self.fs.exists(self.base):
                return []
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.base, detail=False)]
        return os.listdir(self.base) if os.path.isdir(self.base) else []

    def exists(self, path: str) -> bool:
        return self.fs.exists(path) if self.remote else os.path.exists(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path)) if self.remote else os.path.getsize(path)

    def open_read(self, path: str):
        return self.fs.open(path, "rb") if self.remote else open(path, "rb")

    def write(self, path: str, chunks: Iterable[memoryview]) -> Tuple[int, str]:
        """Writes ``chunks`` durably at ``path``; returns (bytes, crc32 hex)."""
        digest, total = Crc32(), 0
        target = path if self.remote else path + ".tmp"
        with (self.fs.open(target, "wb") if self.remote else open(target, "wb")) as handle:
            for chunk in chunks:
                digest.update(chunk)  # zlib.crc32 and write both release the GIL on large buffers
                handle.write(chunk)
                total += chunk.nbytes
            if not self.remote:
                handle.flush()
                os.fsync(handle.fileno())
        if not self.remote:
            os.replace(target, path)
        return total, digest.hexdigest()

    def remove(self, path: str) -> None:
        if self.remote:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    def sync_dir(self, path: str) -> None:
        """Makes renames in ``path`` durable (no-op on object stores)."""
        if self.remote:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------ format

class Crc32:
    """zlib's CRC-32 with hashlib's update/hexdigest shape.

    CRC-32 rather than SHA-256: it catches the corruption checkpoints meet
    (bit flips, torn or truncated writes; sizes are checked too) at ~5 GB/s
    against ~1.8, which halves the background writer's CPU time, and a
    digest in an unsigned manifest resists no deliberate edit either way.
    """

    def __init__(self, data: bytes = b"") -> None:
        self.value = zlib.crc32(data)

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _array_chunks(arrays: List[np.ndarray]) -> Iterable[memoryview]:
    offset = 0
    for array in arrays:
        pad = -offset % ALIGN_BYTES
        if pad:
            yield memoryview(bytes(pad))
            offset += pad
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        for start in range(0, flat.size, CHUNK_BYTES):
            yield memoryview(flat[start:start + CHUNK_BYTES])
        offset += flat.size


def _versions() -> Dict[str, str]:
    found = {"python": platform.python_version(), "numpy": np.__version__}
    from elastic_ext import __version__
    found["elastic_ext"] = __version__
    for module in ("torch", "tensorflow", "keras", "horovod"):
        loaded = sys.modules.get(module)  # record what the job runs, import nothing
        if loaded is not None and hasattr(loaded, "__version__"):
            found[module] = str(loaded.__version__)
    return found


def write_checkpoint(directory: str, commit_id: int, entries: Dict[str, Entry], info: Dict[str, Any]) -> str:
    """Writes the entries as checkpoint ``commit_id`` under ``directory``; returns its path.

    ``info`` adds fields to the manifest (world size, generation, data
    cursor...). An existing checkpoint with the same id is invalidated first
    (its manifest removed), then replaced.

    Raises:
        CheckpointError: the write failed (the checkpoint stays partial).
    """
    store = _Storage(directory)
    path = store.address(checkpoint_name(commit_id))
    try:
        store.makedirs(store.join(checkpoint_name(commit_id)))
        manifest_path = store.join(checkpoint_name(commit_id), MANIFEST_FILE)
        if store.exists(manifest_path):
            store.remove(manifest_path)
            store.sync_dir(store.join(checkpoint_name(commit_id)))
        table, ordered, offset = [], [], 0
        for name in sorted(entries):
            for key in sorted(entries[name].arrays):
                array = entries[name].arrays[key]
                offset += -offset % ALIGN_BYTES
                table.append([name, key, array.dtype.str, list(array.shape), offset, int(array.nbytes)])
                ordered.append(array)
                offset += int(array.nbytes)
        size, crc = store.write(store.join(checkpoint_name(commit_id), DATA_FILE), _array_chunks(ordered))
        body = dict(info)
        body.update({"format": FORMAT, "format_version": FORMAT_VERSION, "commit_id": int(commit_id),
                     "written_time": time.time(), "versions": _versions(), "arrays": table,
                     "objects": {name: {"meta": entries[name].meta} for name in sorted(entries)},
                     "files": {DATA_FILE: {"bytes": size, "crc32": crc}}})
        body["manifest_crc32"] = Crc32(_canonical(body)).hexdigest()
        store.write(manifest_path, [memoryview(json.dumps(body, sort_keys=True).encode("utf-8"))])
        store.sync_dir(store.join(checkpoint_name(commit_id)))
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from exc
    return path


def read_checkpoint(path: str) -> Loaded:
    """Reads and verifies one checkpoint directory (local path or fsspec URL).

    Raises:
        CorruptCheckpointError: the manifest is missing (a partial write),
            unreadable, or fails its checksum; a data file has the wrong
            size or checksum; the array table is inconsistent or names a
            dtype that could hold objects.
        CheckpointError: the files cannot be read.
    """
    trimmed = path.rstrip("/")
    parent, name = trimmed.rpartition("/")[::2] if "://" in trimmed else os.path.split(trimmed)
    store = _Storage(parent)
    manifest_path = store.join(name, MANIFEST_FILE)
    try:
        if not store.exists(manifest_path):
            raise CorruptCheckpointError(f"{path} is partial: it has no {MANIFEST_FILE} (its write was cut "
                                         "before it finished)")
        with store.open_read(manifest_path) as handle:
            raw = handle.read()
        manifest = _parse_manifest(path, raw)
        entries = _read_arrays(store, store.join(name, DATA_FILE), path, manifest)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # Only a manifest written by something else can get here: ours checksum what they hold.
        raise CorruptCheckpointError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from None
    return Loaded(path=path, commit_id=int(manifest["commit_id"]), manifest=manifest, entries=entries)


def _parse_manifest(path: str, raw: bytes) -> dict:
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} ({len(raw)} bytes) is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} is not an {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path}: format_version ({manifest.get('format_version')!r}) must be "
                                     f"{FORMAT_VERSION}")
    recorded = manifest.pop("manifest_crc32", None)
    actual = Crc32(_canonical(manifest)).hexdigest()
    if recorded != actual:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} checksum ({actual}) does not match the "
                                     f"recorded one ({recorded!r})")
    return manifest


def _safe_dtype(path: str, text: Any) -> np.dtype:
    try:
        dtype = np.dtype(text) if isinstance(text, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _SAFE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise CorruptCheckpointError(f"{path}: array dtype ({text!r}) is not a plain numeric dtype; refused "
                                     "(a checkpoint never holds objects)")
    return dtype


def _read_arrays(store: _Storage, data_path: str, path: str, manifest: dict) -> Dict[str, Entry]:
    record = manifest["files"][DATA_FILE]
    if not store.exists(data_path):
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} is missing")
    actual_size = store.size(data_path)
    if actual_size != record["bytes"]:
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} has {actual_size} bytes, the manifest records "
                                     f"{record['bytes']} (truncated or replaced)")
    entries = {name: Entry(arrays={}, meta=obj["meta"]) for name, obj in manifest["objects"].items()}
    digest, position = Crc32(), 0
    with store.open_read(data_path) as handle:
        for name, key, dtype_text, shape, offset, nbytes in manifest["arrays"]:
            dtype = _safe_dtype(path, dtype_text)
            if (name not in entries or offset < position or not all(isinstance(d, int) and d >= 0 for d in shape)
                    or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != nbytes
                    or offset + nbytes > record["bytes"]):
                raise CorruptCheckpointError(f"{path}: array table row {[name, key, dtype_text, shape, offset]} "
                                             "is inconsistent")
            gap = handle.read(offset - position)
            digest.update(gap)
            array = np.empty(shape, dtype=dtype)
            view = array.reshape(-1).view(np.uint8)
            for start in range(0, nbytes, CHUNK_BYTES):
                part = view[start:start + CHUNK_BYTES]
                if handle.readinto(memoryview(part)) != part.size:
                    raise CorruptCheckpointError(f"{path}: {DATA_FILE} ended early inside {name}/{key}")
                digest.update(memoryview(part))
            entries[name].arrays[key] = array
            position = offset + nbytes
        digest.update(handle.read())
    if digest.hexdigest() != record["crc32"]:
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} checksum ({digest.hexdigest()}) does not match the "
                                     f"manifest ({record['crc32']})")
    return entries


# ------------------------------------------------------- listing, retention

class CheckpointStore:
    """The checkpoints under one directory: list, load the newest valid one, apply retention."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._storage = _Storage(directory)

    def commit_ids(self) -> List[int]:
        """Ids of every ``ckpt-*`` directory, complete or not, newest first."""
        try:
            names = self._storage.list_names()
        except OSError as exc:
            raise CheckpointError(f"cannot list checkpoints in {self.directory}: {exc}") from exc
        return sorted((int(m.group(1)) for m in map(_NAME.match, names) if m), reverse=True)

    def path(self, commit_id: int) -> str:
        return self._storage.address(checkpoint_name(commit_id))

    def load_newest(self) -> Optional[Loaded]:
        """The newest checkpoint that verifies; each one skipped is logged with its reason."""
        skipped = []
        for commit_id in self.commit_ids():
            try:
                loaded = read_checkpoint(self.path(commit_id))
            except CheckpointError as exc:
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

    def apply_retention(self, newest: int, keep_last: int, keep_every: int = 0) -> List[int]:
        """Deletes checkpoints older than ``newest`` beyond the policy; returns the deleted ids.

        Kept: the newest ``keep_last`` complete checkpoints up to ``newest``,
        and those whose id is a multiple of ``keep_every``. Partial ones older
        than ``newest`` are leftovers of cut writes and go. Ids above
        ``newest`` are left alone: they are what a previous run wrote past
        the checkpoint this run resumed from, and are overwritten as the job
        reaches those ids again.
        """
        complete = [i for i in self.commit_ids() if i <= newest
                    and self._storage.exists(self._storage.join(checkpoint_name(i), MANIFEST_FILE))]
        keep = set(complete[:keep_last]) | {newest}
        if keep_every:
            keep |= {i for i in complete if i % keep_every == 0}
        doomed = [i for i in self.commit_ids() if i < newest and i not in keep]
        for commit_id in doomed:
            self._storage.remove(self._storage.join(checkpoint_name(commit_id)))
        return doomed


# -------------------------------------------------- the background writer

class Checkpointer:
    """Background checkpoint writes for :class:`~elastic_ext.State` (rank 0), with the buffer lease.

    Bound policy: at most one write is in flight. When a checkpoint is due
    while the previous write still runs, the commit waits for it at most
    ``wait_s``; if it is still running then, this commit's checkpoint is
    skipped (warning and a ``checkpoint_skipped`` event) and the next commit
    is checkpointed instead. A commit therefore never waits more than
    ``wait_s`` on storage.

    Args:
        config: the State's :class:`~elastic_ext.ElasticConfig`.
        emit: event sink, ``emit(event, **fields)``.
        in_use: returns the State's current buffer sets (never parked).
    """

    def __init__(self, config: Any, emit: Callable[..., Any],
                 in_use: Callable[[], Iterable[Optional[Dict[str, Entry]]]]) -> None:
        self.store = CheckpointStore(config.checkpoint_dir)
        self._config = config
        self._emit = emit
        self._in_use = in_use
        self._thread: Optional[threading.Thread] = None
        self._lease: Optional[Dict[str, Entry]] = None   # buffers the running write reads
        self._parked: Dict[str, Entry] = {}              # a finished write's buffers, for reuse
        self._result: Optional[Tuple[int, Optional[BaseException]]] = None
        self._owed = False                               # a due checkpoint was skipped
        self._result_id = -1                             # commit id of the running (or last) write
        self.last_written: Optional[int] = None
        atexit.register(_wait_at_exit, weakref.ref(self))

    # buffer lease ---------------------------------------------------------

    def _leased_ids(self) -> set:
        lease = self._lease or {}
        return {id(a) for entry in lease.values() for a in entry.arrays.values()}

    def is_leased(self, entry: Optional[Entry]) -> bool:
        """True if a running write reads this entry's buffers (they must not be overwritten)."""
        self._collect()
        leased = self._leased_ids()
        return entry is not None and any(id(a) in leased for a in entry.arrays.values())

    def writable(self, base: Optional[Dict[str, Entry]]) -> Optional[Dict[str, Entry]]:
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

    def _collect(self) -> None:
        """On the training thread: takes a finished write's result and parks its buffers."""
        if self._thread is None or self._thread.is_alive():
            return
        self._thread.join()
        self._thread = None
        commit_id, error = self._result
        if error is None:
            self.last_written = max(commit_id, self.last_written or 0)
        else:
            self._owed = True  # the next commit tries again rather than waiting a whole interval
        in_use = {id(a) for entries in self._in_use() if entries for e in entries.values() for a in e.arrays.values()}
        self._parked = {name: entry for name, entry in (self._lease or {}).items()
                        if not any(id(a) in in_use for a in entry.arrays.values())}
        self._lease = None

    # writing --------------------------------------------------------------

    def due(self, commit_id: int) -> bool:
        """True if commit ``commit_id`` should be checkpointed (every N-th, or one was skipped)."""
        return ((commit_id % self._config.checkpoint_every == 0 or self._owed)
                and commit_id != self.last_written)

    def on_commit(self, commit_id: int, entries: Dict[str, Entry], info: Dict[str, Any]) -> None:
        """Starts the background write of ``commit_id`` if one is due (called after the commit is agreed)."""
        self._collect()
        if not self.due(commit_id):
            return
        if self._thread is not None:
            self.wait(self._config.checkpoint_wait_s)
            if self._thread is not None:
                self._owed = True
                logger.warning("checkpoint of commit %d skipped: the write of commit %d is still running after "
                               "checkpoint_wait_s (%ss); the next commit is checkpointed instead",
                               commit_id, self._result_id, self._config.checkpoint_wait_s)
                self._emit("checkpoint_skipped", commit_id=commit_id, running=self._result_id,
                           wait_s=self._config.checkpoint_wait_s)
                return
        self._owed = False
        self._lease = dict(entries)
        self._result_id = commit_id
        self._thread = threading.Thread(target=self._write, args=(commit_id, self._lease, dict(info)),
                                        name=f"elastic_ext-checkpoint-{commit_id}", daemon=True)
        self._thread.start()

    def _write(self, commit_id: int, entries: Dict[str, Entry], info: Dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            path = write_checkpoint(self.store.directory, commit_id, entries, info)
            deleted = self.store.apply_retention(commit_id, self._config.checkpoint_keep_last,
                                                 self._config.checkpoint_keep_every)
        except Exception as exc:  # noqa: BLE001 - reported here and in the event; training goes on
            logger.error("checkpoint of commit %d failed: %s", commit_id, exc)
            self._emit("checkpoint_failed", commit_id=commit_id, error=str(exc)[:500])
            self._result = (commit_id, exc)
            return
        nbytes = sum(int(a.nbytes) for e in entries.values() for a in e.arrays.values())
        self._emit("checkpoint", commit_id=commit_id, path=path, bytes=nbytes, deleted=deleted,
                   duration_s=time.perf_counter() - started)
        self._result = (commit_id, None)

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Waits for the running write (at most ``timeout_s``); True if none is left running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        self._collect()
        return self._thread is None

    def resumed(self, commit_id: int) -> None:
        """Records that the job resumed from checkpoint ``commit_id`` (it is not written again)."""
        self.last_written = commit_id


def _wait_at_exit(ref: "weakref.ref[Checkpointer]") -> None:
    # Daemon threads die at interpreter exit; let the last write finish first.
    checkpointer = ref()
    if checkpointer is not None and checkpointer._thread is not None:
        logger.info("waiting for the checkpoint of commit %d before exiting", checkpointer._result_id)
        checkpointer.wait()
