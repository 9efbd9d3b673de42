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
cannot execute code, and it validates every manifest field it uses before
using it, so it never allocates more than the data file holds. A checkpoint
that fails any check raises :class:`CorruptCheckpointError`;
:meth:`CheckpointStore.load_newest` logs it (path and reason) and falls back
to the previous one. Storage that cannot be read (permission denied, EIO, a
503) raises :class:`CheckpointReadError` instead, after a few bounded retries:
that says nothing about the checkpoint, so the job must stop rather than
silently train from an older state.

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
import errno
import json
import logging
import math
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
from elastic_ext.errors import CheckpointError, CheckpointReadError, ConfigError, CorruptCheckpointError

logger = logging.getLogger(__name__)

FORMAT = "elastic_ext.checkpoint"
FORMAT_VERSION = 1
DATA_FILE = "arrays.bin"
MANIFEST_FILE = "manifest.json"
ALIGN_BYTES = 64
CHUNK_BYTES = 64 << 20
SKIP_BYTES = 64 << 10
# At most 18 digits: any longer name is not ours, and int() of a huge one is slow or refused.
_NAME = re.compile(r"^ckpt-(\d{1,18})$")
_SAFE_KINDS = "biufc"  # bool, ints, floats, complex: dtypes that cannot hold objects
# What the writer records (``array.dtype.str``): byte order, kind, item size. Anything
# else is refused before numpy parses it.
_DTYPE_TEXT = re.compile(r"^[<>|=]?[biufc][0-9]{1,2}$")
_CRC_TEXT = re.compile(r"^[0-9a-f]{8}$")
# Deepest JSON nesting a manifest may have. The metadata skeletons of real
# optimizers nest about a dozen levels; the bound keeps every later walk of
# the manifest (checksum, consumers) far from Python's recursion limit.
MAX_JSON_DEPTH = 200
MAX_NDIM = 32  # numpy's own limit
# Reads of a checkpoint that fail with a storage error are tried this many
# times in all, waiting READ_RETRY_DELAY_S, then twice that, between tries.
READ_ATTEMPTS = 3
READ_RETRY_DELAY_S = 0.5


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
        """Creates ``path`` and missing parents; each new directory's entry is made durable."""
        if self.remote:
            self.fs.makedirs(path, exist_ok=True)
            return
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise
                continue  # created by someone else meanwhile: their fsync, not ours
            # A new directory's name lives in its parent: without this fsync a
            # power loss can drop the whole checkpoint directory, fsynced files and all.
            self.sync_dir(os.path.dirname(directory))

    def list_names(self) -> List[str]:
        """Names in the root; none if it does not exist yet.

        No exists()/isdir() first: both answer False for a permission or I/O
        error (fsspec's generic exists() swallows any exception), which would
        pass an unreadable directory off as an empty one: a fresh start.
        """
        try:
            if self.remote:
                return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.base, detail=False)]
            return os.listdir(self.base)
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        """True if ``path`` exists, False only if it does not; any other error is raised.

        (``os.path.exists`` and fsspec's generic ``exists`` answer False for a
        permission or I/O error too: retention would then take a complete
        checkpoint for a partial one and delete it.)
        """
        try:
            if self.remote:
                self.fs.info(path)
            else:
                os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

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
        """Deletes ``path`` (a file or a whole directory).

        Raises:
            OSError: it cannot be deleted, or it is a symbolic link: retention
                deletes only what it wrote, never what a link points at, and
                does not remove links someone placed on purpose.
        """
        if self.remote:
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        elif os.path.islink(path):
            raise OSError(errno.EPERM, f"it is a symbolic link (to {os.readlink(path)!r}); "
                          "retention only deletes directories it wrote", path)
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
                if not _DTYPE_TEXT.match(array.dtype.str) or array.dtype.kind not in _SAFE_KINDS:
                    raise CheckpointError(f"cannot write checkpoint {path}: {name}/{key} has dtype "
                                          f"{array.dtype.str!r}; only plain numeric dtypes can be checkpointed")
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
        depth = _json_depth(body)
        if depth > MAX_JSON_DEPTH:  # the reader would refuse it: fail now, loudly, not at resume time
            raise CheckpointError(f"cannot write checkpoint {path}: its manifest would nest {depth} levels deep "
                                  f"(object metadata too deep); the limit is {MAX_JSON_DEPTH}")
        body["manifest_crc32"] = Crc32(_canonical(body)).hexdigest()
        store.write(manifest_path, [memoryview(json.dumps(body, sort_keys=True).encode("utf-8"))])
        store.sync_dir(store.join(checkpoint_name(commit_id)))
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from exc
    return path


def read_checkpoint(path: str) -> Loaded:
    """Reads and verifies one checkpoint directory (local path or fsspec URL).

    Every manifest field is validated before it is used: whatever the two
    files hold, this returns the arrays the (checksummed) table points at in
    the (checksummed) data file, or raises one of the two errors below; it
    never allocates more than the data file's size for arrays.

    Raises:
        CorruptCheckpointError: the manifest is missing (a partial write), is
            not JSON, nests too deep, fails its checksum or a field check
            (types, commit id, dtype, shape, offsets, sizes); the data file is
            missing or has the wrong size or checksum.
        CheckpointReadError: the storage failed (permission, I/O error,
            service error): nothing is known about the checkpoint itself.
    """
    trimmed = path.rstrip("/")
    parent, name = trimmed.rpartition("/")[::2] if "://" in trimmed else os.path.split(trimmed)
    store = _io(path, "open the checkpoint directory", _Storage, parent)
    manifest_path = store.join(name, MANIFEST_FILE)
    # No exists() first: some fsspec backends answer False for a 403 as for a
    # missing key, which would pass a storage error off as a partial write.
    try:
        raw = _io(path, f"read {MANIFEST_FILE}", _read_all, store, manifest_path)
    except CheckpointReadError as exc:
        if not isinstance(exc.__cause__, FileNotFoundError):
            raise
        raise CorruptCheckpointError(f"{path} is partial: it has no {MANIFEST_FILE} (its write was cut "
                                     "before it finished)") from None
    manifest = _parse_manifest(path, raw)
    expected_id = _NAME.match(name)
    _check_manifest(path, manifest, None if expected_id is None else int(expected_id.group(1)))
    entries = _read_arrays(store, store.join(name, DATA_FILE), path, manifest)
    return Loaded(path=path, commit_id=manifest["commit_id"], manifest=manifest, entries=entries)


def _io(path: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs one storage call; any failure of the storage becomes a CheckpointReadError."""
    try:
        return fn(*args)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own types (botocore, aiohttp...)
        raise CheckpointReadError(f"cannot read checkpoint {path}: {what} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc


def _read_all(store: _Storage, file_path: str) -> bytes:
    with store.open_read(file_path) as handle:
        return handle.read()


def _parse_manifest(path: str, raw: bytes) -> dict:
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} ({len(raw)} bytes) nests deeper than the "
                                     f"JSON parser can follow; a manifest nests at most {MAX_JSON_DEPTH} "
                                     "levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} ({len(raw)} bytes) is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} holds a JSON {type(manifest).__name__}, not an "
                                     f"object: it is not an {FORMAT} manifest")
    depth = _json_depth(manifest)
    if depth > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} nests {depth} levels deep; the limit is "
                                     f"{MAX_JSON_DEPTH}")
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} format ({_quote(manifest.get('format'))}) must be "
                                     f"{FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION or isinstance(manifest.get("format_version"), bool):
        raise CorruptCheckpointError(f"{path}: format_version ({_quote(manifest.get('format_version'))}) must be "
                                     f"{FORMAT_VERSION}")
    recorded = manifest.pop("manifest_crc32", None)
    actual = Crc32(_canonical(manifest)).hexdigest()
    if recorded != actual:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_FILE} checksum ({actual}) does not match the "
                                     f"recorded one ({_quote(recorded)})")
    return manifest


def _json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion (1 for a flat object)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _quote(value: Any, limit: int = 80) -> str:
    """A bad value for an error message: repr, cut short (manifest values can be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def _is_count(value: Any) -> bool:
    """A JSON integer >= 0 (JSON true/false parse as bool, a subclass of int: refused)."""
    return type(value) is int and value >= 0


def _check_manifest(path: str, manifest: dict, expected_id: Optional[int]) -> None:
    """Validates every manifest field the loader or State uses; raises CorruptCheckpointError."""

    def bad(field: str, value: Any, rule: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: manifest field {field} ({_quote(value)}) {rule}")

    commit_id = manifest.get("commit_id")
    if not _is_count(commit_id):
        raise bad("commit_id", commit_id, "must be an integer >= 0")
    if expected_id is not None and commit_id != expected_id:
        raise bad("commit_id", commit_id, f"must match the directory name ({checkpoint_name(expected_id)})")
    for field in ("generation", "world_size"):
        if field in manifest and not _is_count(manifest[field]):
            raise bad(field, manifest[field], "must be an integer >= 0")
    files = manifest.get("files")
    record = files.get(DATA_FILE) if isinstance(files, dict) else None
    if not isinstance(record, dict):
        raise bad("files", files, f"must be an object with an object for {DATA_FILE}")
    if not _is_count(record.get("bytes")):
        raise bad(f"files.{DATA_FILE}.bytes", record.get("bytes"), "must be an integer >= 0")
    if not isinstance(record.get("crc32"), str) or not _CRC_TEXT.match(record["crc32"]):
        raise bad(f"files.{DATA_FILE}.crc32", record.get("crc32"), "must be 8 lowercase hex digits")
    objects = manifest.get("objects")
    if not isinstance(objects, dict) or not all(isinstance(o, dict) and "meta" in o for o in objects.values()):
        raise bad("objects", objects, 'must map each object name to {"meta": ...}')
    rows = manifest.get("arrays")
    if not isinstance(rows, list):
        raise bad("arrays", rows, "must be a list of [object, key, dtype, shape, offset, bytes] rows")
    seen, position = set(), 0
    for index, row in enumerate(rows):
        field = f"arrays[{index}]"
        if not isinstance(row, list) or len(row) != 6:
            raise bad(field, row, "must be a list of 6: [object, key, dtype, shape, offset, bytes]")
        name, key, dtype_text, shape, offset, nbytes = row
        if not isinstance(name, str) or name not in objects:
            raise bad(field, row, f"names object {_quote(name)}, which is not in objects")
        if not isinstance(key, str) or (name, key) in seen:
            raise bad(field, row, "must have a string key, once per object")
        seen.add((name, key))
        dtype = _safe_dtype(path, dtype_text)
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_count(d) for d in shape)):
            raise bad(field, row, f"shape must be a list of at most {MAX_NDIM} integers >= 0")
        # Python integers: a product cannot wrap around as an int64 one does.
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2 ** 62:
            raise bad(field, row, "shape is too large for any array")
        if not _is_count(nbytes) or math.prod(shape) * dtype.itemsize != nbytes:
            raise bad(field, row, f"bytes must be the shape's element count times the item size "
                                  f"({dtype.itemsize})")
        if not _is_count(offset) or offset < position:
            raise bad(field, row, f"offset must be an integer >= {position} (where the previous array ends)")
        if offset + nbytes > record["bytes"]:
            raise bad(field, row, f"ends at byte {offset + nbytes}, past the end of {DATA_FILE} "
                                  f"({record['bytes']} bytes)")
        position = offset + nbytes


def _safe_dtype(path: str, text: Any) -> np.dtype:
    dtype = None
    if isinstance(text, str) and _DTYPE_TEXT.match(text):
        try:
            dtype = np.dtype(text)
        except (TypeError, ValueError):  # e.g. '<f3': no such item size
            dtype = None
    if dtype is None or dtype.kind not in _SAFE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise CorruptCheckpointError(f"{path}: array dtype ({_quote(text)}) is not a plain numeric dtype such as "
                                     "'<f4'; refused (a checkpoint never holds objects)")
    return dtype


def _read_exact(handle: Any, view: memoryview) -> int:
    """Fills ``view`` from ``handle``; returns how many bytes it got (fewer only at end of file)."""
    got = 0
    while got < view.nbytes:
        count = handle.readinto(view[got:])
        if not count:
            break
        got += count
    return got


def _read_arrays(store: _Storage, data_path: str, path: str, manifest: dict) -> Dict[str, Entry]:
    """Reads the arrays of a validated manifest (see _check_manifest)."""
    record = manifest["files"][DATA_FILE]
    try:
        actual_size = _io(path, f"size {DATA_FILE}", store.size, data_path)
    except CheckpointReadError as exc:
        if not isinstance(exc.__cause__, FileNotFoundError):
            raise
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} is missing") from None
    if actual_size != record["bytes"]:
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} has {actual_size} bytes, the manifest records "
                                     f"{record['bytes']} (truncated or replaced)")
    entries = {name: Entry(arrays={}, meta=obj["meta"]) for name, obj in manifest["objects"].items()}
    digest, position = Crc32(), 0
    scratch = np.empty(SKIP_BYTES, dtype=np.uint8)  # reads the padding between arrays
    handle = _io(path, f"open {DATA_FILE}", store.open_read, data_path)
    try:
        def consume(view: memoryview, what: str) -> None:
            got = _io(path, f"read {DATA_FILE}", _read_exact, handle, view)
            if got != view.nbytes:
                raise CorruptCheckpointError(f"{path}: {DATA_FILE} ended early inside {what} (it is "
                                             f"{actual_size} bytes, as recorded: it changed while being read)")
            digest.update(view)

        def skip_to(end: int, what: str) -> None:
            nonlocal position
            while position < end:
                step = min(end - position, scratch.size)
                consume(memoryview(scratch[:step]), what)
                position += step

        for name, key, dtype_text, shape, offset, nbytes in manifest["arrays"]:
            skip_to(offset, f"the padding before {name}/{key}")
            try:
                array = np.empty(shape, dtype=np.dtype(dtype_text))
            except (ValueError, OverflowError) as exc:
                raise CorruptCheckpointError(f"{path}: array {name}/{key} of shape {shape} cannot be made: "
                                             f"{exc}") from None
            except MemoryError:  # the checkpoint may be fine: not a reason to fall back to an older one
                raise CheckpointError(f"cannot load checkpoint {path}: array {name}/{key} ({nbytes} bytes) "
                                      "does not fit in memory") from None
            flat = memoryview(array.reshape(-1).view(np.uint8))
            for start in range(0, nbytes, CHUNK_BYTES):
                consume(flat[start:start + CHUNK_BYTES], f"{name}/{key}")
            entries[name].arrays[key] = array
            position = offset + nbytes
        skip_to(actual_size, "the end of the file")
        if _io(path, f"read {DATA_FILE}", handle.read, 1):
            raise CorruptCheckpointError(f"{path}: {DATA_FILE} grew while it was read (it had {actual_size} bytes)")
    finally:
        try:
            handle.close()
        except Exception as exc:  # noqa: BLE001 - a failed close of a read handle loses nothing
            logger.debug("closing %s failed: %s", data_path, exc)
    if digest.hexdigest() != record["crc32"]:
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} checksum ({digest.hexdigest()}) does not match the "
                                     f"manifest ({record['crc32']})")
    return entries


# ------------------------------------------------------- listing, retention

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
        self._storage = _Storage(directory)
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
        return sorted((int(m.group(1)) for m in map(_NAME.match, names) if m), reverse=True)

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

    def apply_retention(self, newest: int, keep_last: int, keep_every: int = 0) -> List[int]:
        """Deletes checkpoints older than ``newest`` beyond the policy; returns the deleted ids.

        Kept: the newest ``keep_last`` complete checkpoints up to ``newest``,
        and those whose id is a multiple of ``keep_every``. Partial ones older
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
        if keep_every:
            keep |= {i for i in complete if i % keep_every == 0}
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

    def on_commit(self, commit_id: int, entries: Dict[str, Entry], info: Dict[str, Any],
                  force: bool = False) -> None:
        """Starts the background write of ``commit_id`` if one is due (called after the commit is agreed).

        ``force`` writes it even if not due (a leave or a resize makes the
        agreed commit durable), waiting for a running write first however long.
        """
        self._collect()
        if commit_id == self.last_written or (self._thread is not None and commit_id == self._result_id):
            return
        if not force and not self.due(commit_id):
            return
        if self._thread is not None:
            self.wait(None if force else self._config.checkpoint_wait_s)
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
        except Exception as exc:  # noqa: BLE001 - reported here and in the event; training goes on
            logger.error("checkpoint of commit %d failed: %s", commit_id, exc)
            self._emit("checkpoint_failed", commit_id=commit_id, error=str(exc)[:500])
            self._result = (commit_id, exc)
            return
        # The checkpoint is durable now. Retention is housekeeping: what it cannot
        # delete is logged (once) by the store, and never makes this write count as
        # failed, which would change the cadence (a full write at every commit).
        deleted = self.store.apply_retention(commit_id, self._config.checkpoint_keep_last,
                                             self._config.checkpoint_keep_every)
        nbytes = sum(int(a.nbytes) for e in entries.values() for a in e.arrays.values())
        self._emit("checkpoint", commit_id=commit_id, path=path, bytes=nbytes, deleted=deleted,
                   not_deleted=list(self.store.not_deleted), duration_s=time.perf_counter() - started)
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
