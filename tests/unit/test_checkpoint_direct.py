"""Checkpoint writes without the page-cache copy: page-aligned commit buffers,
page-aligned large arrays in the file, O_DIRECT where the filesystem allows
it (and the same bytes where it does not), XXH3-64 of the data, and
checkpoints of format version 1 (CRC-32) still read."""

import errno
import json
import mmap
import os
import zlib

import numpy as np
import pytest

from elastic_ext import checkpoint
from elastic_ext.state.snapshot import Entry
from elastic_ext.state.buffers import PAGE_BYTES, CommitBuffers, aligned_empty
from elastic_ext.checkpoint import direct, read_checkpoint, write_checkpoint
from elastic_ext.errors import CheckpointError, CorruptCheckpointError
from elastic_ext.state.snapshot import ArraySource, Capture

MIB = 1 << 20


def entries_with_large_arrays():
    rng = np.random.default_rng(3)
    return {"model": Entry(arrays={"big": rng.standard_normal((512, 513)).astype(np.float32),  # 1,050,624 bytes
                                   "small": rng.standard_normal(7),
                                   "huge": rng.integers(0, 255, size=3 * MIB + 5, dtype=np.uint8)},
                           meta={"epoch": 2})}


def is_page_aligned(array):
    return array.ctypes.data % PAGE_BYTES == 0


@pytest.mark.parametrize("shape, dtype", [((MIB // 4,), np.float32), ((600, 700), np.float64), ((3 * MIB + 1,), np.uint8)])
def test_buffers_of_a_mib_or_more_start_on_a_page(shape, dtype):
    for _ in range(5):  # whatever offset the allocator returns
        array = aligned_empty(shape, np.dtype(dtype))
        assert array.shape == shape and array.dtype == dtype and array.flags.c_contiguous and array.flags.writeable
        assert is_page_aligned(array)
        array[...] = 1
        assert array.sum() == array.size


def test_commit_buffers_of_large_arrays_are_page_aligned_and_small_ones_are_plain():
    class Source(ArraySource):
        def __init__(self, value):
            self.value, self.shape, self.dtype = value, value.shape, value.dtype

        def copy_into(self, buffer):
            np.copyto(buffer, self.value)

    buffers = CommitBuffers(1)
    large, small = np.arange(MIB, dtype=np.float32), np.arange(5.0)
    buffers.copy({"model": Capture(arrays={"large": Source(large), "small": Source(small)}, meta=None)})
    committed = buffers.entries["model"].arrays
    assert is_page_aligned(committed["large"]) and np.array_equal(committed["large"], large)
    assert committed["small"].nbytes < MIB and np.array_equal(committed["small"], small)


def test_large_arrays_start_on_a_page_of_the_file_and_come_back_bitwise_and_aligned(tmp_path):
    entries = entries_with_large_arrays()
    path = write_checkpoint(str(tmp_path), 5, entries, {})
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    offsets = {row[1]: row[4] for row in manifest["arrays"]}
    assert offsets["big"] % PAGE_BYTES == 0 and offsets["huge"] % PAGE_BYTES == 0
    loaded = read_checkpoint(path).entries["model"]
    for key, array in entries["model"].arrays.items():
        assert np.array_equal(loaded.arrays[key], array) and loaded.arrays[key].dtype == array.dtype
    # After a resume the loaded arrays are the commit buffers: the next checkpoint can write them directly.
    assert is_page_aligned(loaded.arrays["big"]) and is_page_aligned(loaded.arrays["huge"])


def chunks_of_every_kind():
    """Chunks with aligned and unaligned memory, offsets and lengths, as the format's writer yields them."""
    aligned = np.frombuffer(mmap.mmap(-1, 3 * PAGE_BYTES + 100), dtype=np.uint8)  # starts on a page
    aligned[:] = np.arange(aligned.size) % 251
    unaligned = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)[1:]
    return [memoryview(aligned),                     # offset 0: 3 pages directly, a 100-byte tail through the cache
            memoryview(bytes(PAGE_BYTES - 100)),     # padding to the next page
            memoryview(aligned[:2 * PAGE_BYTES]),    # 2 pages directly
            memoryview(unaligned),                   # unaligned memory: through the cache
            memoryview(bytes(-(6 * PAGE_BYTES + unaligned.size) % PAGE_BYTES)),
            memoryview(aligned)]                     # 3 pages directly again


def write_all(out, path, chunks):
    """Writes ``chunks`` through ``out``, syncs and closes it; True if the file holds exactly them."""
    with out:
        for chunk in chunks:
            out.write(chunk)
        out.sync()
    return open(path, "rb").read() == b"".join(bytes(c) for c in chunks)


def test_direct_file_writes_the_same_bytes_and_bypasses_the_cache_for_whole_aligned_pages(tmp_path):
    path = str(tmp_path / "out.bin")
    out = direct.DirectFile(path)
    refused = out.direct is None
    assert write_all(out, path, chunks_of_every_kind())
    # Where this filesystem has O_DIRECT, exactly the 8 whole aligned pages went around the page cache.
    assert out.direct_bytes == (0 if refused else 8 * PAGE_BYTES)


def test_a_filesystem_without_o_direct_gets_the_same_bytes_through_the_cache(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", no_direct)
    path = str(tmp_path / "out.bin")
    out = direct.DirectFile(path)
    assert write_all(out, path, chunks_of_every_kind())
    assert out.direct is None and out.direct_bytes == 0


def test_a_direct_write_refused_midway_goes_on_through_the_cache(tmp_path, monkeypatch):
    real_pwrite, calls = os.pwrite, []

    def refuse_second_direct(fd, data, offset):
        if fd == out.direct:
            calls.append(offset)
            if len(calls) == 2:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    path = str(tmp_path / "out.bin")
    out = direct.DirectFile(path)
    monkeypatch.setattr(direct.os, "pwrite", refuse_second_direct)
    assert write_all(out, path, chunks_of_every_kind())
    assert out.direct is None  # closed after the refusal
    assert out.direct_bytes == (3 * PAGE_BYTES if calls else 0)


def test_a_failing_disk_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    def eio(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(direct.os, "pwrite", eio)
    with pytest.raises(CheckpointError, match="Input/output error"):
        write_checkpoint(str(tmp_path), 1, entries_with_large_arrays(), {})
    assert not os.path.exists(tmp_path / checkpoint.checkpoint_name(1) / "manifest.json")  # partial: never loaded


def as_version_1(path):
    """Rewrites a checkpoint written now as format version 1 wrote it: CRC-32 of arrays.bin."""
    manifest_path = os.path.join(path, "manifest.json")
    body = json.loads(open(manifest_path).read())
    data = open(os.path.join(path, "arrays.bin"), "rb").read()
    body.pop("manifest_crc32")
    body["format_version"] = 1
    body["files"]["arrays.bin"] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    body["manifest_crc32"] = checkpoint.Crc32(checkpoint.format.canonical(body)).hexdigest()
    open(manifest_path, "w").write(json.dumps(body))


def test_a_version_1_checkpoint_still_loads_and_its_crc_still_catches_a_flip(tmp_path):
    entries = entries_with_large_arrays()
    path = write_checkpoint(str(tmp_path), 3, entries, {})
    as_version_1(path)
    loaded = read_checkpoint(path)
    assert loaded.manifest["format_version"] == 1
    for key, array in entries["model"].arrays.items():
        assert np.array_equal(loaded.entries["model"].arrays[key], array)
    with open(os.path.join(path, "arrays.bin"), "r+b") as handle:
        handle.seek(MIB)
        byte = handle.read(1)
        handle.seek(MIB)
        handle.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match="arrays.bin checksum"):
        read_checkpoint(path)
