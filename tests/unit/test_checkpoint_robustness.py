"""Checkpoint loading under crafted input and faulty storage.

- Crafted or damaged manifests (and data files) never make the loader raise
  anything but a CheckpointError subclass, never make it allocate more than
  the data file holds, and never make it return bytes other than those the
  table points at: unit cases from issue 17, then a hypothesis fuzz test.
- A fresh job skips a crafted newest checkpoint and resumes from an older one;
  a checkpoint of a newer format version stops it instead.
- Storage faults, injected through an fsspec filesystem (faulty_fs.py): a
  read error stops the job with the path and the error, after bounded
  retries, and never falls back; retention that cannot delete is logged once
  and leaves the checkpoint cadence alone.
- New directories are fsynced into their parent.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import faulty_fs
from elastic_ext import checkpoint
from elastic_ext.state.snapshot import Entry
from elastic_ext.checkpoint import CheckpointStore, read_checkpoint, write_checkpoint
from elastic_ext.errors import (CheckpointError, CheckpointReadError, CorruptCheckpointError,
                                UnsupportedCheckpointError)
from faulty_fs import Fault
from test_checkpoint import Job, assert_entries_equal, sample_entries

NAME = checkpoint.checkpoint_name


def write(directory, commit_id, seed=None):
    entries = sample_entries(commit_id if seed is None else seed)
    write_checkpoint(str(directory), commit_id, entries, {"world_size": 4, "generation": 1})
    return entries


def manifest_of(path):
    return json.loads((path / "manifest.json").read_text())


def store_manifest(path, body, checksum=True):
    """Writes ``body`` as the manifest; with ``checksum`` its CRC is made valid (a crafted file)."""
    body = dict(body)
    body.pop("manifest_crc32", None)
    if checksum:
        body["manifest_crc32"] = checkpoint.Crc32(checkpoint.format.canonical(body)).hexdigest()
    (path / "manifest.json").write_text(json.dumps(body))


def nested(depth):
    return "[" * depth + "]" * depth


# ------------------------------------------------ crafted manifests, one by one

def _row(index, value):
    def mutate(body):
        body["arrays"][0][index] = value
    return mutate


def _set(key, value):
    def mutate(body):
        body[key] = value
    return mutate


def _pop(key):
    def mutate(body):
        body.pop(key)
    return mutate


def _shape_and_bytes(shape, nbytes):
    def mutate(body):
        body["arrays"][0][3] = shape
        body["arrays"][0][5] = nbytes
    return mutate


# (case, mutation of a valid manifest with its checksum recomputed, what the error must quote)
CRAFTED = [
    ("shape 2**70", _row(3, [2 ** 70]), "1180591620717411303424"),
    ("shape wrapping int64 to 0 bytes", _shape_and_bytes([2 ** 32, 2 ** 32], 0), "too large"),
    ("negative shape", _shape_and_bytes([-2, -3], 24), "integers >= 0"),
    ("bool in shape", _row(3, [True]), "integers >= 0"),
    ("33 dimensions", _shape_and_bytes([1] * 33, 0), "at most 32"),
    ("missing commit_id", _pop("commit_id"), "commit_id (None) must be an integer >= 0"),
    ("commit_id 'x'", _set("commit_id", "x"), "commit_id ('x') must be an integer >= 0"),
    ("commit_id of another checkpoint", _set("commit_id", 99), "must match the directory name"),
    ("generation 'x'", _set("generation", "x"), "generation ('x') must be an integer >= 0"),
    ("unknown dtype", _row(2, "<f3"), "'<f3'"),
    ("string dtype", _row(2, "|S8"), "'|S8'"),
    ("offset past the file", _row(4, 10 ** 9), "past the end of arrays.bin"),
    ("negative offset", _row(4, -64), "offset must be an integer >= 0"),
    ("float offset", _row(4, 0.0), "offset must be an integer"),
    ("length past the file", _shape_and_bytes([10 ** 6], 8 * 10 ** 6), "past the end of arrays.bin"),
    ("bytes not matching the shape", _row(5, 7), "element count times the item size"),
    ("short row", _set("arrays", [["model"]]), "must be a list of 6"),
    ("unknown object", _row(0, "ghost"), "'ghost', which is not in objects"),
    ("objects not a map", _set("objects", []), "objects ([])"),
    ("files not a map", _set("files", "x"), "files ('x')"),
    ("data size as text", lambda b: b["files"]["arrays.bin"].__setitem__("bytes", "99"), "bytes ('99')"),
    ("checksum as int", lambda b: b["files"]["arrays.bin"].__setitem__("xxh3_64", 5), "xxh3_64 (5)"),
    ("checksum too short", lambda b: b["files"]["arrays.bin"].__setitem__("xxh3_64", "0123abcd"),
     "xxh3_64 ('0123abcd') must be 16 lowercase hex digits"),
    ("a version-1 checksum in a version-2 manifest", lambda b: b["files"]["arrays.bin"].update(
        {"crc32": "0123abcd", "xxh3_64": None}), "xxh3_64 (None)"),
    ("unknown format version", _set("format_version", 0), "format_version (0) must be one of [1, 2]"),
    ("format version as bool", _set("format_version", True), "format_version (True)"),
    ("nested too deep for the limit", _set("extra", json.loads(nested(300))), "nests 301 levels deep"),
]


@pytest.mark.parametrize("case, mutate, quoted", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_manifest_is_corrupt_quotes_the_value_and_is_skipped(tmp_path, caplog, case, mutate, quoted):
    older = write(tmp_path, 4)
    write(tmp_path, 8)
    newest = tmp_path / NAME(8)
    body = manifest_of(newest)
    mutate(body)
    store_manifest(newest, body)
    with pytest.raises(CorruptCheckpointError) as caught:
        read_checkpoint(str(newest))
    assert quoted in str(caught.value) and str(newest) in str(caught.value)
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        loaded = CheckpointStore(str(tmp_path)).load_newest()
    assert loaded.commit_id == 4
    assert_entries_equal(older, loaded.entries)


def test_a_newer_format_version_stops_the_load_instead_of_falling_back(tmp_path):
    """Before (audit M3), it counted as corrupt: skipped, and the job resumed from ckpt-4 and later overwrote it."""
    write(tmp_path, 4)
    write(tmp_path, 8)
    newest = tmp_path / NAME(8)
    body = manifest_of(newest)
    body["format_version"] = 3
    store_manifest(newest, body)
    listing = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(UnsupportedCheckpointError, match="newer format_version 3") as caught:
        CheckpointStore(str(tmp_path)).load_newest()
    assert str(newest) in str(caught.value) and "checkpoint_fresh_start" in str(caught.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == listing
    assert CheckpointStore(str(tmp_path)).load_newest(fresh_start=True).commit_id == 4


@pytest.mark.parametrize("raw, reason", [
    (nested(100_000).encode(), "nests deeper than the JSON parser can follow"),
    (b"[1, 2, 3]", "holds a JSON list"),
    (b"42", "holds a JSON int"),
    (b"null", "holds a JSON NoneType"),
    (b'"manifest"', "holds a JSON str"),
    (b'{"x": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"", "not valid JSON"),
])
def test_manifest_that_is_not_a_json_object_is_corrupt(tmp_path, raw, reason):
    write(tmp_path, 3)
    path = tmp_path / NAME(3)
    (path / "manifest.json").write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=reason):
        read_checkpoint(str(path))


def test_a_fresh_job_skips_crafted_newest_checkpoints_and_resumes_from_a_valid_one(tmp_path, caplog):
    """The reproduction from issue 17: before, sync() died with RecursionError on rank 0."""
    first = Job(tmp_path)
    first.state.sync()
    first.steps(3)
    assert first.state.wait_for_checkpoint() == 3
    (tmp_path / NAME(3) / "manifest.json").write_text(nested(100_000))     # newest: deeply nested
    body = manifest_of(tmp_path / NAME(2))
    body["arrays"][0][3] = [2 ** 70]                                      # second: huge shape, valid CRC
    store_manifest(tmp_path / NAME(2), body)
    second = Job(tmp_path, seed=77)
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        second.state.sync()
    assert second.state.commit_id == 1 and second.state.step == 1
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 2 and NAME(3) in skipped[0] and NAME(2) in skipped[1]


def test_a_manifest_the_reader_would_refuse_is_not_written(tmp_path):
    entries = {"model": Entry(arrays={}, meta=json.loads(nested(checkpoint.MAX_JSON_DEPTH + 5)))}
    with pytest.raises(CheckpointError, match=r"would nest \d+ levels deep"):
        write_checkpoint(str(tmp_path), 1, entries, {})
    entries = {"model": Entry(arrays={"t": np.array(["a"])}, meta=None)}
    with pytest.raises(CheckpointError, match="'<U1'"):
        write_checkpoint(str(tmp_path), 2, entries, {})


# ------------------------------------------------------------ the fuzz test

SMALL_ENTRIES = {
    "model": Entry(arrays={"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                           "b": np.array([1.5, -2.0]), "flags": np.array([True, False, True])},
                   meta={"__map__": [["w", {"__ndarray__": "w"}]]}),
    "step": Entry(arrays={}, meta=7),
}

JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.integers() | st.sampled_from([2 ** 70, 2 ** 63, 2 ** 32, -1, 0, 1, 64, "<f4", "|b1", "<f8"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=24)

# Where a mutation lands in a valid manifest: a top-level field, or a cell of the array table.
TARGETS = (["commit_id", "files", "objects", "arrays", "generation", "world_size", "format",
            "format_version"]
           + [("arrays", row, col) for row in range(3) for col in range(6)]
           + [("files", "arrays.bin", "bytes"), ("files", "arrays.bin", "xxh3_64"), ("objects", "model")])


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """One valid checkpoint: its directory, manifest, and data bytes (restored before each example)."""
    root = tmp_path_factory.mktemp("fuzz")
    write_checkpoint(str(root), 5, SMALL_ENTRIES, {"world_size": 2, "generation": 3})
    path = root / NAME(5)
    return path, (path / "manifest.json").read_bytes(), (path / "arrays.bin").read_bytes()


def load_checked(path, data):
    """read_checkpoint under the three invariants; returns the Loaded or the CheckpointError."""
    tracemalloc.start()
    try:
        loaded = read_checkpoint(str(path))
    except CheckpointError as exc:  # anything else fails the test
        loaded = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    manifest_bytes = os.path.getsize(path / "manifest.json") if (path / "manifest.json").exists() else 0
    # Arrays are at most the data file; parsing JSON costs a bounded multiple of its size.
    assert peak <= len(data) + 64 * manifest_bytes + (1 << 20), (peak, len(data), manifest_bytes)
    if isinstance(loaded, checkpoint.Loaded):
        for name, key, dtype, shape, offset, nbytes in loaded.manifest["arrays"]:
            array = loaded.entries[name].arrays[key]
            assert (array.dtype.str, list(array.shape)) == (dtype, shape)
            assert array.tobytes() == data[offset:offset + nbytes], "returned bytes the table does not point at"
    return loaded


FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(raw=st.binary(max_size=400) | JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzz_any_bytes_or_json_value_as_manifest(template, raw):
    path, manifest, data = template
    (path / "arrays.bin").write_bytes(data)
    (path / "manifest.json").write_bytes(raw)
    result = load_checked(path, data)
    assert isinstance(result, CorruptCheckpointError), result


@FUZZ
@given(target=st.sampled_from(TARGETS), value=JSON, checksum=st.booleans())
def test_fuzz_a_field_of_a_valid_manifest_replaced_by_any_json_value(template, target, value, checksum):
    path, manifest, data = template
    (path / "arrays.bin").write_bytes(data)
    body = json.loads(manifest)
    if isinstance(target, str):
        body[target] = value
    else:
        holder = body
        for step in target[:-1]:
            holder = holder[step]
        holder[target[-1]] = value
    store_manifest(path, body, checksum=checksum)
    result = load_checked(path, data)
    if not isinstance(result, CheckpointError):
        assert checksum, "a manifest whose checksum does not match was loaded"
    elif type(body.get("format_version")) is int and body["format_version"] > checkpoint.FORMAT_VERSION:
        assert isinstance(result, UnsupportedCheckpointError), result
    else:
        assert isinstance(result, CorruptCheckpointError), result


@FUZZ
@given(data=st.data())
def test_fuzz_truncated_bit_flipped_or_replaced_data_file(template, data):
    path, manifest, original = template
    (path / "manifest.json").write_bytes(manifest)
    kind = data.draw(st.sampled_from(["truncate", "flip", "replace"]))
    if kind == "truncate":
        damaged = original[:data.draw(st.integers(0, len(original) - 1))]
    elif kind == "flip":
        # XXH3-64 misses a given random change with probability 2^-64.
        bits = data.draw(st.lists(st.integers(0, 8 * len(original) - 1), min_size=1, max_size=3, unique=True))
        buffer = bytearray(original)
        for bit in bits:
            buffer[bit // 8] ^= 1 << (bit % 8)
        damaged = bytes(buffer)
    else:
        damaged = data.draw(st.binary(min_size=len(original) - 1, max_size=len(original) + 1))
    (path / "arrays.bin").write_bytes(damaged)
    result = load_checked(path, damaged)
    if damaged != original:
        assert isinstance(result, CorruptCheckpointError), result
    (path / "arrays.bin").write_bytes(original)
    assert_entries_equal(SMALL_ENTRIES, load_checked(path, original).entries)


# ---------------------------------------------------------- storage faults

@pytest.fixture
def no_retry_wait(monkeypatch):
    monkeypatch.setattr(checkpoint.store, "READ_RETRY_DELAY_S", 0.0)


@pytest.fixture
def three(tmp_path, no_retry_wait):
    for commit_id in (1, 2, 3):
        write(tmp_path, commit_id)
    yield tmp_path
    faulty_fs.install()  # no faults for whoever comes next


@pytest.mark.parametrize("fault, said", [
    (Fault("open", f"{NAME(3)}/manifest.json", faulty_fs.eio, mode="r"), "Input/output error"),
    (Fault("open", f"{NAME(3)}/arrays.bin", faulty_fs.denied, mode="r"), "Access Denied"),
    # fsspec backends raise their own types too (an HTTP 503 from an object store).
    (Fault("open", f"{NAME(3)}/manifest.json", lambda p: RuntimeError(f"503 SlowDown: {p}"), mode="r"),
     "RuntimeError: 503 SlowDown"),
    (Fault("info", f"{NAME(3)}/arrays.bin", faulty_fs.denied), "Access Denied"),
])
def test_a_read_error_stops_the_load_naming_path_and_error_and_never_falls_back(three, caplog, fault, said):
    faulty_fs.install(fault)
    store = CheckpointStore(faulty_fs.url(three))
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        with pytest.raises(CheckpointReadError) as caught:
            store.load_newest()
    message = str(caught.value)
    assert faulty_fs.url(three / NAME(3)) in message and said in message
    assert "tried 3 time(s)" in message and "does not fall back" in message
    assert fault.fired == checkpoint.READ_ATTEMPTS
    assert not [c for c in faulty_fs.FaultyFileSystem.calls if NAME(2) in c[1]], "an older checkpoint was read"
    assert not any("skipping" in r.getMessage() for r in caplog.records)


def test_listing_error_is_a_read_error(three):
    faulty_fs.install(Fault("ls", str(three), faulty_fs.eio))
    with pytest.raises(CheckpointReadError, match=r"cannot list checkpoints in faulty://.*Input/output error"):
        CheckpointStore(faulty_fs.url(three)).load_newest()


def test_an_unreadable_root_is_not_taken_for_an_empty_one(three):
    """Only a missing root means no checkpoint; exists()-style checks would hide a 403 (see faulty_fs)."""
    faulty_fs.install(Fault("ls", str(three), faulty_fs.denied, exact=True))
    with pytest.raises(CheckpointReadError, match="Access Denied"):
        CheckpointStore(faulty_fs.url(three)).load_newest()
    assert CheckpointStore(faulty_fs.url(three / "not-yet")).load_newest() is None


def test_a_transient_read_error_is_retried_and_the_newest_checkpoint_loads(three, caplog):
    fault = Fault("open", f"{NAME(3)}/arrays.bin", faulty_fs.eio, times=2, mode="r")
    faulty_fs.install(fault)
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        loaded = CheckpointStore(faulty_fs.url(three)).load_newest()
    assert loaded.commit_id == 3 and fault.fired == 2
    assert_entries_equal(sample_entries(3), loaded.entries)
    assert [r.getMessage().split(" failed")[0] for r in caplog.records] == [f"reading {faulty_fs.url(three / NAME(3))}"] * 2


def test_a_corrupt_checkpoint_still_falls_back_through_fsspec(three):
    (three / NAME(3) / "arrays.bin").write_bytes(b"\0" * 10)
    faulty_fs.install()
    assert CheckpointStore(faulty_fs.url(three)).load_newest().commit_id == 2


def test_a_fresh_job_stops_on_every_rank_with_the_path_and_the_error(tmp_path, no_retry_wait):
    faulty_fs.install()
    first = Job(faulty_fs.url(tmp_path))
    first.state.sync()
    first.steps(2)
    assert first.state.wait_for_checkpoint() == 2
    faulty_fs.install(Fault("open", f"{NAME(2)}/manifest.json", faulty_fs.eio, mode="r"))
    try:
        second = Job(faulty_fs.url(tmp_path), seed=3)
        with pytest.raises(CheckpointError) as caught:
            second.state.sync()
    finally:
        faulty_fs.install()
    message = str(caught.value)
    assert faulty_fs.url(tmp_path / NAME(2)) in message and "[Errno 5] Input/output error" in message
    assert second.state.commit_id == 0, "it must not have resumed from the older checkpoint"


def test_retention_that_cannot_delete_a_symlink_is_logged_once_and_keeps_the_cadence(tmp_path, caplog):
    target = tmp_path / "archived"
    target.mkdir()
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    os.symlink(target, ckpts / NAME(1))
    job = Job(ckpts, checkpoint_every=3, checkpoint_keep_last=1)
    job.state.sync()
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        for _ in range(12):
            job.steps(1)
            job.state.wait_for_checkpoint()
    history = job.state.events.history
    assert [e["commit_id"] for e in history if e["event"] == "checkpoint"] == [3, 6, 9, 12]
    assert not [e for e in history if e["event"] == "checkpoint_failed"]
    warnings = [r.getMessage() for r in caplog.records if "retention cannot delete" in r.getMessage()
                and NAME(1) in r.getMessage()]
    assert len(warnings) == 1 and "symbolic link" in warnings[0]
    assert os.path.islink(ckpts / NAME(1)) and target.is_dir()
    assert sorted(os.listdir(ckpts)) == [checkpoint.LOCK_FILE, NAME(1), NAME(12), checkpoint.OWNER_FILE]


def test_retention_permission_errors_are_logged_once_each_and_keep_the_cadence(tmp_path, caplog):
    faulty_fs.install(Fault("rm", "ckpt-", faulty_fs.denied))
    try:
        job = Job(faulty_fs.url(tmp_path), checkpoint_every=2, checkpoint_keep_last=1)
        job.state.sync()
        with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
            for _ in range(8):
                job.steps(1)
                job.state.wait_for_checkpoint()
    finally:
        faulty_fs.install()
    history = job.state.events.history
    assert [e["commit_id"] for e in history if e["event"] == "checkpoint"] == [2, 4, 6, 8]
    assert [e["not_deleted"] for e in history if e["event"] == "checkpoint"] == [[], [2], [4, 2], [6, 4, 2]]
    warned = [r.getMessage() for r in caplog.records if "retention cannot delete" in r.getMessage()]
    assert len(warned) == 3 and all("Access Denied" in w for w in warned)
    assert sorted(os.listdir(tmp_path)) == [NAME(2), NAME(4), NAME(6), NAME(8)]


def test_retention_never_takes_an_unreadable_checkpoint_for_a_partial_one(three, caplog):
    """Before, exists() answered False for the 403 and retention deleted the complete ckpt-2."""
    faulty_fs.install(Fault("info", f"{NAME(2)}/manifest.json", faulty_fs.denied))
    store = CheckpointStore(faulty_fs.url(three))
    with caplog.at_level(logging.WARNING, logger="elastic_ext.checkpoint"):
        assert store.apply_retention(3, keep_last=2) == []
    assert store.commit_ids() == [3, 2, 1]
    assert any("Access Denied" in r.getMessage() for r in caplog.records)
    faulty_fs.install()
    assert store.apply_retention(3, keep_last=2) == [1]


def test_retention_deletes_again_once_storage_allows_it(tmp_path):
    store = CheckpointStore(faulty_fs.url(tmp_path))
    faulty_fs.install(Fault("rm", NAME(1), faulty_fs.denied, times=1))
    try:
        for commit_id in (1, 2, 3):
            write(faulty_fs.url(tmp_path), commit_id)
        assert store.apply_retention(2, keep_last=1) == [] and store.not_deleted == [1]
        assert store.apply_retention(3, keep_last=1) == [2, 1] and store.not_deleted == []
    finally:
        faulty_fs.install()
    assert store.commit_ids() == [3]


# ------------------------------------------------------------------ fsync

def test_new_directories_are_fsynced_into_their_parent(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def recording(fd):
        synced.append(os.fstat(fd).st_ino)
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    root = tmp_path / "job" / "ckpts"
    write_checkpoint(str(root), 1, SMALL_ENTRIES, {})
    for directory in (tmp_path, tmp_path / "job", root):
        assert os.stat(directory).st_ino in synced, f"{directory} was not fsynced after an entry was made in it"
    synced.clear()
    write_checkpoint(str(root), 2, SMALL_ENTRIES, {})
    assert os.stat(root).st_ino in synced and os.stat(tmp_path / "job").st_ino not in synced


def test_eio_while_writing_is_a_failed_write_not_a_crash(tmp_path):
    faulty_fs.install(Fault("open", "arrays.bin", lambda p: OSError(errno.ENOSPC, "No space left", p), mode="w"))
    try:
        with pytest.raises(CheckpointError, match="No space left"):
            write_checkpoint(faulty_fs.url(tmp_path), 1, SMALL_ENTRIES, {})
    finally:
        faulty_fs.install()
    assert CheckpointStore(str(tmp_path)).load_newest() is None  # left partial: never loaded
