"""Writing and reading one checkpoint directory (see :mod:`elastic_ext.checkpoint.format`).

Each file is written to a temporary name of its own (see
:mod:`~elastic_ext.checkpoint.storage`), flushed, fsynced and renamed into
place, then the directory is fsynced (on object stores, the manifest written
last is what makes a checkpoint valid); a directory without a manifest is a
*partial* checkpoint (the write was cut) and is never loaded. Reading
validates the manifest before using it and reads raw bytes into fresh
buffers of numeric dtypes only. A checkpoint that fails any check raises
:class:`CorruptCheckpointError` (:class:`PartialCheckpointError` without a
manifest), one of a newer format :class:`UnsupportedCheckpointError`;
storage that cannot be read (permission denied, EIO, a 503) raises
:class:`CheckpointReadError`: that says nothing about the checkpoint itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Tuple

import numpy as np

from elastic_ext.state.buffers import aligned_empty
from elastic_ext.checkpoint.format import (CHUNK_BYTES, DATA_DIGESTS, DATA_FILE, DTYPE_TEXT, FORMAT, FORMAT_VERSION,
                                           MANIFEST_FILE, MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, NAME_PATTERN, SAFE_KINDS,
                                           SKIP_BYTES, Crc32, Loaded, array_offset, canonical, check_manifest,
                                           checkpoint_name, data_digest, json_depth, parse_manifest, versions)
from elastic_ext.checkpoint.storage import Storage, open_storage
from elastic_ext.errors import (CheckpointError, CheckpointReadError, CorruptCheckpointError,
                                PartialCheckpointError)
from elastic_ext.state.snapshot import Entry

logger = logging.getLogger(__name__)

VERIFY_CHUNK_BYTES = 8 << 20


def _array_chunks(arrays: List[np.ndarray]) -> Iterable[memoryview]:
    offset = 0
    for array in arrays:
        pad = array_offset(offset, array.nbytes) - offset
        if pad:
            yield memoryview(bytes(pad))
            offset += pad
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        for start in range(0, flat.size, CHUNK_BYTES):
            yield memoryview(flat[start:start + CHUNK_BYTES])
        offset += flat.size


def write_checkpoint(directory: str, commit_id: int, entries: Dict[str, Entry], info: Dict[str, Any]) -> str:
    """Writes the entries as checkpoint ``commit_id`` under ``directory``; returns its path.

    ``info`` adds fields to the manifest (world size, generation, data
    cursor...). An existing checkpoint with the same id is invalidated first
    (its manifest removed), then replaced.

    Raises:
        CheckpointError: the write failed (the checkpoint stays partial).
    """
    store = open_storage(directory)
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
                if not DTYPE_TEXT.match(array.dtype.str) or array.dtype.kind not in SAFE_KINDS:
                    raise CheckpointError(f"cannot write checkpoint {path}: {name}/{key} has dtype "
                                          f"{array.dtype.str!r}; only plain numeric dtypes can be checkpointed")
                offset = array_offset(offset, int(array.nbytes))
                table.append([name, key, array.dtype.str, list(array.shape), offset, int(array.nbytes)])
                ordered.append(array)
                offset += int(array.nbytes)
        size, checksum = store.write(store.join(checkpoint_name(commit_id), DATA_FILE), _array_chunks(ordered))
        body = dict(info)
        body.update({"format": FORMAT, "format_version": FORMAT_VERSION, "commit_id": int(commit_id),
                     "written_time": time.time(), "versions": versions(), "arrays": table,
                     "objects": {name: {"meta": entries[name].meta} for name in sorted(entries)},
                     "files": {DATA_FILE: {"bytes": size, DATA_DIGESTS[FORMAT_VERSION][0]: checksum}}})
        depth = json_depth(body)
        if depth > MAX_JSON_DEPTH:  # the reader would refuse it: fail now, loudly, not at resume time
            raise CheckpointError(f"cannot write checkpoint {path}: its manifest would nest {depth} levels deep "
                                  f"(object metadata too deep); the limit is {MAX_JSON_DEPTH}")
        body["manifest_crc32"] = Crc32(canonical(body)).hexdigest()
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
        CorruptCheckpointError: the manifest is missing (a partial write:
            :class:`PartialCheckpointError`), is not JSON, is over
            ``MAX_MANIFEST_BYTES``, nests too deep, fails its checksum or a
            field check (types, commit id, dtype, shape, offsets, sizes); the
            data file is missing or has the wrong size or checksum.
        UnsupportedCheckpointError: the manifest's ``format_version`` is
            newer than this elastic_ext's.
        CheckpointReadError: the storage failed (permission, I/O error,
            service error): nothing is known about the checkpoint itself.
    """
    store, name, manifest = _manifest(path)
    entries = _read_arrays(store, store.join(name, DATA_FILE), path, manifest)
    return Loaded(path=path, commit_id=manifest["commit_id"], manifest=manifest, entries=entries)


def verify_checkpoint(path: str) -> int:
    """Checks one checkpoint as :func:`read_checkpoint` does, without building its arrays; returns its commit id.

    The data file is streamed through its checksum in bounded memory, so
    retention can verify a checkpoint of any size.

    Raises:
        CorruptCheckpointError, CheckpointReadError, UnsupportedCheckpointError: as :func:`read_checkpoint`.
    """
    store, name, manifest = _manifest(path)
    record, data_path = manifest["files"][DATA_FILE], store.join(name, DATA_FILE)
    (field, digest), size = data_digest(manifest), 0
    handle = _io(path, f"open {DATA_FILE}", store.open_read, data_path)
    try:
        while True:
            chunk = _io(path, f"read {DATA_FILE}", handle.read, VERIFY_CHUNK_BYTES)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    finally:
        handle.close()
    if size != record["bytes"] or digest.hexdigest() != record[field]:
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} ({size} bytes, {field} {digest.hexdigest()}) does not "
                                     f"match the manifest ({record['bytes']} bytes, {record[field]})")
    return manifest["commit_id"]


def _manifest(path: str) -> Tuple[Storage, str, dict]:
    """The storage, directory name and validated manifest of checkpoint ``path``."""
    trimmed = path.rstrip("/")
    parent, name = trimmed.rpartition("/")[::2] if "://" in trimmed else os.path.split(trimmed)
    store = _io(path, "open the checkpoint directory", open_storage, parent)
    manifest_path = store.join(name, MANIFEST_FILE)
    # No exists() first: some fsspec backends answer False for a 403 as for a
    # missing key, which would pass a storage error off as a partial write.
    try:
        raw = _io(path, f"read {MANIFEST_FILE}", _read_all, store, manifest_path)
    except CheckpointReadError as exc:
        if not isinstance(exc.__cause__, FileNotFoundError):
            raise
        raise PartialCheckpointError(f"{path} is partial: it has no {MANIFEST_FILE} (its write was cut "
                                     "before it finished)") from None
    manifest = parse_manifest(path, raw)
    expected_id = NAME_PATTERN.match(name)
    check_manifest(path, manifest, None if expected_id is None else int(expected_id.group(1)))
    return store, name, manifest


def _io(path: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Runs one storage call; any failure of the storage becomes a CheckpointReadError."""
    try:
        return fn(*args)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own types (botocore, aiohttp...)
        raise CheckpointReadError(f"cannot read checkpoint {path}: {what} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc


def _read_all(store: Storage, file_path: str) -> bytes:
    parts, size = [], 0
    with store.open_read(file_path) as handle:
        while size <= MAX_MANIFEST_BYTES:  # in pieces: read(n) would allocate n bytes up front
            part = handle.read(SKIP_BYTES)
            if not part:
                return b"".join(parts)
            parts.append(part)
            size += len(part)
    raise CorruptCheckpointError(f"{file_path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")


def _read_exact(handle: Any, view: memoryview) -> int:
    """Fills ``view`` from ``handle``; returns how many bytes it got (fewer only at end of file)."""
    got = 0
    while got < view.nbytes:
        count = handle.readinto(view[got:])
        if not count:
            break
        got += count
    return got


def _read_arrays(store: Storage, data_path: str, path: str, manifest: dict) -> Dict[str, Entry]:
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
    (field, digest), position = data_digest(manifest), 0
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
                array = aligned_empty(shape, np.dtype(dtype_text))  # commit buffers after a resume
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
    if digest.hexdigest() != record[field]:
        raise CorruptCheckpointError(f"{path}: {DATA_FILE} checksum ({digest.hexdigest()}) does not match the "
                                     f"manifest ({record[field]})")
    return entries
