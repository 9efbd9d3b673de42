"""Copying only the pages written since a buffer last equalled a large array.

A commit copies every tracked array into its host buffer, and a rollback
copies every buffer back, though a step may write only a small part of a
large array (an embedding table, of which each step updates a few rows).
Linux tells which pages a process wrote since it last asked: a
``userfaultfd`` registered for asynchronous write protection
(``UFFD_FEATURE_WP_ASYNC``, Linux 6.7) keeps a per-page flag that the
kernel clears at the first write, with no signal and no handler, and the
``PAGEMAP_SCAN`` ioctl on ``/proc/self/pagemap`` lists the written pages of
a range and protects them again in one call. A write by the kernel on the
process's behalf (``read()`` into the array) and a page dropped with
``MADV_DONTNEED`` count as written too.

:func:`copy` pairs an array's memory with the buffer it was copied to or
from. The pairing holds while the buffer equals the memory except in the
pages written since the last scan; then the next copy, either way, moves
only those pages (and the partial pages at both ends, which other
allocations may share). Anything else is a full copy that starts a new
pairing: the first copy, another buffer, a buffer changed by other code
(:func:`forget`, which ``CommitBuffers.load`` calls), memory freed and
mapped again (the kernel dropped its registration: the scan refuses it).

Only memory of at least :data:`MIN_BYTES` is watched: below that a full
copy costs a few milliseconds, and glibc gives allocations that large
mappings of their own, so a watched range never holds the small objects
malloc packs into its heap. Only private anonymous memory is: shared
memory is written by other processes, and a private mapping of a file
shows the file's changes, neither through this process's page tables. A
watched array of which more than :data:`DENSE_FRACTION` of the pages were
written between two copies (the parameters of a model under an optimizer)
is no longer protected and is copied whole for a while: each first write
to a page after a scan costs a fault (about 1.2 us here), which only pays
when most pages stay untouched. It is watched again after
:data:`DENSE_WAIT` whole copies, then after twice as many each time it is
found dense again, up to :data:`DENSE_WAIT_MAX`: a single bulk write (a
table loaded from a file after the first commit) does not make a sparse
array cost whole copies for the rest of the job, and a dense one pays its
faults in one interval out of up to 65. Where the kernel lacks the feature or the
syscall is refused, every copy is a full copy.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Callable, Optional

import numpy as np

from elastic_ext.state.write_protect import Watch

MIN_BYTES = 32 << 20     # smaller arrays are always copied whole
DENSE_FRACTION = 0.5     # more pages written than this between two scans: stop watching the array
DENSE_WAIT = 2           # whole copies of an array found dense before it is watched again
DENSE_WAIT_MAX = 64      # the wait doubles each time the array is found dense again, up to this
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

_watch: Optional[Watch] = None
_watch_lock = threading.Lock()


def _current() -> Watch:
    """This process's watch (a forked child opens its own: it inherits no registration)."""
    global _watch
    with _watch_lock:
        if _watch is None or _watch.pid != os.getpid():
            _watch = Watch()
        return _watch


def available() -> bool:
    """True if this kernel and process let :func:`copy` move only written pages."""
    return _current().available


def _private_anonymous(start: int, end: int) -> bool:
    """True if [start, end) lies in private anonymous mappings only (``/proc/self/maps``).

    Shared memory is written by other processes, and a private mapping of a
    file shows the file's changes in the pages it has not written; neither
    goes through this process's page tables, so neither is watched.
    """
    covered = start
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if high <= covered or low >= end:
                continue
            path = fields[5].strip() if len(fields) > 5 else ""
            if low > covered or fields[1][3] != "p" or fields[4] != "0" or path.startswith("/"):
                return False
            covered = high
            if covered >= end:
                return True
    return False


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of ``nbytes`` of memory at ``address``."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def forget(buffer: np.ndarray) -> None:
    """Drops every pairing with ``buffer``: code other than :func:`copy` is about to write it."""
    watch = _watch
    if watch is None:
        return
    with watch.lock:
        for key in [k for k, ref in watch.pairs.items() if ref() is buffer]:
            del watch.pairs[key]


def copy(address: int, nbytes: int, buffer: np.ndarray, to_buffer: bool,
         move: Callable[[np.ndarray, np.ndarray], None] = np.copyto) -> int:
    """Copies ``nbytes`` of memory at ``address`` into ``buffer`` (``to_buffer``) or back.

    ``buffer`` is C-contiguous with ``nbytes`` bytes. Only the pages written
    since the last copy between this memory and this buffer move, when the
    pairing holds (module docstring); otherwise all of them. ``move(dst,
    src)`` copies between two uint8 arrays (a framework's copy may use
    several threads). The caller guarantees that nothing else writes the
    memory or the buffer during the call.

    Returns:
        the number of bytes copied.

    Raises:
        ValueError: ``buffer`` is not a C-contiguous array of ``nbytes`` bytes.
    """
    if not buffer.flags.c_contiguous or buffer.nbytes != nbytes:
        raise ValueError(f"buffer of {buffer.nbytes} bytes (contiguous: {buffer.flags.c_contiguous}) cannot "
                         f"hold {nbytes} bytes of memory; expected a C-contiguous array of exactly that size")
    memory = _bytes_at(address, nbytes)
    raw = buffer.reshape(-1).view(np.uint8)
    src, dst = (memory, raw) if to_buffer else (raw, memory)
    start = -(-address // PAGE_BYTES) * PAGE_BYTES
    end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    key = (address, nbytes)
    watch = _current() if nbytes >= MIN_BYTES and end > start else None
    if watch is None or not watch.available or key in watch.refused:
        move(dst, src)
        return nbytes
    with watch.lock:
        watched_again = False
        if key in watch.dense:
            if not watch.registered(start, end):  # freed, and other memory mapped there since
                del watch.dense[key]
                watch.waits.pop(key, None)
            elif watch.dense[key] > 0:
                watch.dense[key] -= 1
                move(dst, src)
                return nbytes
            else:  # watched again: the scan below protects every page, and this copy is whole
                del watch.dense[key]
                watched_again = True
        ref = watch.pairs.pop(key, None)
        # A scan that protects pages again does so for every pairing that covers them (two views
        # of one tensor): those others would miss the writes it reports.
        for other in [k for k in watch.pairs if k[0] < address + nbytes and address < k[0] + k[1]]:
            del watch.pairs[other]
        # A commit protects the pages it is about to read; a restore lists the pages to write back
        # and protects them once they are written, or each write would fault.
        written = watch.scan(start, end, protect=to_buffer)
        if written is None:  # not watched yet (or its mapping was replaced): start now
            if _private_anonymous(start, end) and watch.register(start, end):
                watch.scan(start, end, protect=to_buffer)
            else:
                watch.refused.add(key)
            watch.waits.pop(key, None)  # other memory than the one found dense, if any
            ref = None
        elif watched_again:  # every page unprotected so far reads as written
            ref = None
        elif sum(b - a for a, b in written) > DENSE_FRACTION * (end - start):
            # Decided on the writes alone, paired or not: with two buffer sets no pairing holds,
            # and a dense array would fault at every interval for nothing.
            watch.unprotect(start, end)
            wait = watch.waits.get(key, DENSE_WAIT)
            watch.dense[key] = wait
            watch.waits[key] = min(2 * wait, DENSE_WAIT_MAX)
            move(dst, src)
            return nbytes
        else:
            watch.waits.pop(key, None)  # sparse again: a later dense finding waits the least
        if ref is None or ref() is not buffer:
            move(dst, src)
            copied = nbytes
        else:
            copied = 0
            for a, b in [(address, start), *written, (end, address + nbytes)]:
                lo, hi = a - address, b - address
                if hi > lo:
                    move(dst[lo:hi], src[lo:hi])
                    copied += hi - lo
        if key not in watch.refused:
            if not to_buffer:
                watch.scan(start, end, protect=True)  # the memory equals the buffer again
            watch.pairs[key] = weakref.ref(buffer)
        return copied
