"""Copies of large arrays that move only the pages written since (elastic_ext.state.written).

Every test checks the bytes: after each copy the buffer (commit) or the
memory (restore) equals the other side exactly. Where this kernel tracks
writes (``written.available()``), the tests also check that only the
written pages moved; where it does not, that every copy is whole.
"""

import ctypes
import json
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from elastic_ext.state import written
from elastic_ext.state.adapters import NumpyArrayAdapter
from elastic_ext.state.snapshot import Entry
from elastic_ext.torch.adapters import ModuleAdapter, TensorAdapter, TorchSource, TorchStatefulAdapter

SIZE = written.MIN_BYTES * 2
PAGE = written.PAGE_BYTES
TRACKS = written.available()


def big(fill=1.0):
    return np.full(SIZE // 4, fill, dtype=np.float32)


def commit(array, buffer):
    return written.copy(array.ctypes.data, array.nbytes, buffer, to_buffer=True)


def restore(array, buffer):
    return written.copy(array.ctypes.data, array.nbytes, buffer, to_buffer=False)


def small_or_whole(copied, written_bytes):
    """Few bytes where the kernel tracks writes (the written pages plus the partial pages at both ends)."""
    if TRACKS:
        assert copied <= written_bytes + 4 * PAGE, copied
    else:
        assert copied == SIZE, copied


def test_the_first_copy_is_whole_and_later_ones_move_only_written_pages_both_ways():
    live, buffer = big(), np.empty(SIZE // 4, np.float32)
    assert commit(live, buffer) == SIZE
    assert np.array_equal(live, buffer)
    live[1000:1000 + 3 * PAGE // 4] = 7.0  # three pages' worth
    small_or_whole(commit(live, buffer), 4 * PAGE)
    assert np.array_equal(live, buffer)
    live[SIZE // 8:SIZE // 8 + 10] = -1.0  # a step after the commit: the rollback undoes it
    live[-5:] = 3.0  # in the partial last page
    small_or_whole(restore(live, buffer), 2 * PAGE)
    assert np.array_equal(live, buffer) and live[SIZE // 8] == 1.0
    assert np.all(live[-5:] == 1.0)
    # the restore's own writes are not taken for the step's: the next commit moves nothing new
    small_or_whole(commit(live, buffer), 0)
    assert np.array_equal(live, buffer)


def test_another_buffer_or_a_forgotten_one_gets_a_whole_copy():
    live, first, second = big(), np.empty(SIZE // 4, np.float32), np.empty(SIZE // 4, np.float32)
    commit(live, first)
    live[0] = 5.0
    assert commit(live, second) == SIZE  # not paired with this memory
    assert np.array_equal(live, second)
    live[1] = 6.0
    assert commit(live, first) == SIZE  # the pairing moved to the second buffer
    assert np.array_equal(live, first)
    written.forget(first)
    first[:] = 0.0  # what CommitBuffers.load does after forget()
    assert commit(live, first) == SIZE
    assert np.array_equal(live, first)


def test_a_write_by_the_kernel_into_the_memory_counts():
    live, buffer = big(), np.empty(SIZE // 4, np.float32)
    commit(live, buffer)
    read, write = os.pipe()
    os.write(write, b"\x00" * PAGE)
    offset = 100 * PAGE
    os.readv(read, [memoryview(live).cast("B")[offset:offset + PAGE]])
    os.close(read), os.close(write)
    assert live[offset // 4] == 0.0
    small_or_whole(commit(live, buffer), 2 * PAGE)
    assert np.array_equal(live, buffer)


def test_an_array_mostly_written_between_copies_is_copied_whole_then_watched_again():
    live, buffer = big(), np.empty(SIZE // 4, np.float32)
    commit(live, buffer)
    live += 1.0  # a bulk write: a table loaded after the first commit
    assert commit(live, buffer) == SIZE
    assert np.array_equal(live, buffer)
    for step in range(written.DENSE_WAIT + 1):  # no longer watched, then watched again by a whole copy
        live[step] = 9.0
        assert commit(live, buffer) == SIZE, step
        assert np.array_equal(live, buffer)
    live[SIZE // 8] = 5.0  # sparse writes from here on: only their pages move again
    small_or_whole(commit(live, buffer), 2 * PAGE)
    assert np.array_equal(live, buffer)
    live[-1] = 5.0
    small_or_whole(restore(live, buffer), 2 * PAGE)
    assert np.array_equal(live, buffer) and live[-1] == 2.0


def test_an_array_found_dense_again_waits_twice_as_long_up_to_the_limit():
    live, buffer = big(), np.empty(SIZE // 4, np.float32)
    commit(live, buffer)
    whole = []
    for _ in range(14):  # an optimizer step over a whole model between commits
        live += 1.0
        whole.append(commit(live, buffer) == SIZE)
        assert np.array_equal(live, buffer)
    assert all(whole)  # a dense array is copied whole every time, watched or not
    if TRACKS:
        key = (live.ctypes.data, live.nbytes)
        # found dense at commits 1, 5 and 11: each time after its wait (2, then 4) and the whole
        # copy that watches it again; commits 12 to 14 used 3 of the third wait (8)
        assert written.DENSE_WAIT == 2 and written.DENSE_WAIT_MAX >= 16
        assert written._current().waits[key] == 16
        assert written._current().dense[key] == 8 - 3


def test_two_overlapping_views_each_see_every_write():
    live = big()
    head = live[:SIZE // 4 - 1024]  # a view sharing all but the last pages
    whole_buffer, head_buffer = np.empty_like(live), np.empty_like(head)
    commit(live, whole_buffer)
    commit(head, head_buffer)
    live[500] = 4.0
    commit(live, whole_buffer)  # protects page 0 again: the head's pairing must not miss the write
    commit(head, head_buffer)
    assert np.array_equal(live, whole_buffer) and np.array_equal(head, head_buffer)
    assert head_buffer[500] == 4.0


def test_shared_memory_is_never_watched():
    shared = mmap.mmap(-1, SIZE)  # MAP_SHARED: another process may write it
    live = np.frombuffer(shared, dtype=np.float32)
    live[:] = 1.0
    buffer = np.empty_like(live)
    assert commit(live, buffer) == SIZE
    live[3] = 2.0
    assert commit(live, buffer) == SIZE
    assert np.array_equal(live, buffer)
    del live
    shared.close()


def test_memory_mapped_again_at_the_same_address_is_copied_whole():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    prot, flags, fixed = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, 0x10
    address = libc.mmap(None, SIZE, prot, flags, -1, 0)
    memory = np.ctypeslib.as_array((ctypes.c_uint8 * SIZE).from_address(address))
    memory[:] = 1
    buffer = np.empty(SIZE, np.uint8)
    written.copy(address, SIZE, buffer, to_buffer=True)
    assert libc.mmap(address, SIZE, prot, flags | fixed, -1, 0) == address  # new zero pages, same address
    assert memory[0] == 0
    assert written.copy(address, SIZE, buffer, to_buffer=True) == SIZE
    assert not buffer.any()
    libc.munmap(address, SIZE)


def test_a_forked_child_tracks_its_own_writes():
    live, buffer = big(), np.empty(SIZE // 4, np.float32)
    commit(live, buffer)
    pid = os.fork()
    if pid == 0:  # the child inherits the pairing's buffer but not the registration
        live[7] = 8.0
        ok = commit(live, buffer) and np.array_equal(live, buffer) and buffer[7] == 8.0
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    live[9] = 3.0
    small_or_whole(commit(live, buffer), PAGE)
    assert np.array_equal(live, buffer) and buffer[7] == 1.0


def test_a_buffer_of_another_size_is_refused_with_both_sizes():
    live = big()
    with pytest.raises(ValueError, match=f"buffer of 16 bytes .*cannot hold {SIZE} bytes"):
        commit(live, np.empty(4, np.float32))


def test_numpy_and_torch_adapters_roll_a_large_table_back_exactly():
    """A module with a large embedding, a bare tensor, Adam's moments and a numpy array, through
    the adapters: commit, a step that writes a few rows, rollback; the bytes are the commit's."""
    torch.manual_seed(0)
    rows = SIZE // (4 * 64)
    model = torch.nn.Embedding(rows, 64)
    table = torch.randn(rows, 64)
    array = big(2.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.tensor([0, 5])).sum().backward()
    optimizer.step()
    adapters = {"model": ModuleAdapter(), "table": TensorAdapter(), "optimizer": TorchStatefulAdapter(),
                "array": NumpyArrayAdapter()}
    objects = {"model": model, "table": table, "optimizer": optimizer, "array": array}
    entries = {}
    for _ in range(2):  # the second commit is the incremental one
        for name, adapter in adapters.items():
            capture = adapter.capture(objects[name])
            previous = entries.get(name)
            arrays = {key: previous.arrays[key] if previous else np.empty(source.shape, source.dtype)
                      for key, source in capture.arrays.items()}
            for key, source in capture.arrays.items():
                source.copy_into(arrays[key])
            entries[name] = Entry(arrays=arrays, meta=capture.meta)
        model.weight.data[3] += 1.0
    expected = {name: {k: a.copy() for k, a in entry.arrays.items()} for name, entry in entries.items()}
    weight_ptr = model.weight.data_ptr()
    with torch.no_grad():
        model.weight[rows // 2] = 5.0
        table[10:20] = -3.0
    array[100] = 0.0
    model(torch.tensor([1, rows - 1])).sum().backward()
    optimizer.step()
    for name, adapter in adapters.items():
        objects[name] = adapter.apply(objects[name], entries[name])
    assert model.weight.data_ptr() == weight_ptr  # restored in place
    assert np.array_equal(model.weight.detach().numpy(), expected["model"]["weight"])
    assert np.array_equal(table.numpy(), expected["table"]["tensor"])
    assert np.array_equal(array, expected["array"]["array"])
    moments = optimizer.state_dict()["state"][0]
    captured = TorchStatefulAdapter().capture(optimizer).arrays
    for key, source in captured.items():
        assert np.array_equal(source.tensor.numpy(), expected["optimizer"][key]), key
    assert moments["exp_avg"].abs().sum() > 0



HUGE_PAGES_CHILD = """
import json, sys, numpy as np, torch
from elastic_ext.state import written
size = int(sys.argv[1])
tensor = torch.zeros(size // 4)
tensor.add_(1.0)
start = tensor.data_ptr()
huge_kb = 0
with open("/proc/self/smaps") as smaps:  # the huge pages of the mapping that holds the tensor
    inside = False
    for line in smaps:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif inside and head == "AnonHugePages:":
            huge_kb = int(line.split()[1])
buffer = np.empty(size // 4, np.float32)
copies, equal = [], []
def copy(to_buffer):
    copies.append(written.copy(start, size, buffer, to_buffer=to_buffer))
    equal.append(bool(np.array_equal(buffer, tensor.numpy())))
copy(True)
tensor[1000:1000 + 3 * written.PAGE_BYTES // 4] = 7.0
copy(True)
tensor[size // 8:size // 8 + 10] = -1.0
copy(False)
print(json.dumps({"huge_kb": huge_kb, "copies": copies, "equal": equal, "rolled_back": float(tensor[size // 8])}))
"""


def test_a_torch_tensor_in_huge_pages_moves_only_its_written_pages():
    """PyTorch allocates it in huge pages, as under the launcher's worker entry (THP_MEM_ALLOC_ENABLE=1,
    elastic_ext.worker.torch_pages): the copies are exact and, where the kernel tracks writes, per 4 KiB page."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1", PYTHONPATH=repo)
    done = subprocess.run([sys.executable, "-c", HUGE_PAGES_CHILD, str(SIZE)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["equal"] == [True, True, True] and found["rolled_back"] == 1.0, found
    assert found["copies"][0] == SIZE, found
    small_or_whole(found["copies"][1], 4 * PAGE)
    small_or_whole(found["copies"][2], 2 * PAGE)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
        if "[never]" not in mode.read():  # where the kernel has huge pages, PyTorch put the tensor in them
            assert found["huge_kb"] >= SIZE // 2 // 1024, found


def test_a_dense_array_committed_into_alternating_buffers_stops_being_watched_too():
    """Two buffer sets: no pairing ever holds, yet a mostly written array must stop faulting."""
    live = big()
    buffers = [np.empty_like(live), np.empty_like(live)]
    commit(live, buffers[0])
    live += 1.0
    assert commit(live, buffers[1]) == SIZE
    assert np.array_equal(live, buffers[1])
    if TRACKS:
        start = -(-live.ctypes.data // PAGE) * PAGE
        end = (live.ctypes.data + live.nbytes) // PAGE * PAGE
        assert (live.ctypes.data, live.nbytes) in written._current().dense  # copied whole, unprotected
        assert written._current().registered(start, end)  # still told apart from memory mapped there later
    live[1] = 3.0
    assert commit(live, buffers[0]) == SIZE
    assert np.array_equal(live, buffers[0])
