"""Writing one local file, its page-aligned spans with ``O_DIRECT``.

Large commit buffers start on a page (:func:`elastic_ext.state.buffers.aligned_empty`)
and the format starts large arrays on a page of ``arrays.bin``, so most of
a checkpoint goes from the commit buffers to the disk without the kernel
copying it into the page cache first: that copy was about half of the
background writer's CPU time, which training loses when every core trains.
What is not aligned (padding, small arrays, the tail of an array) goes
through the page cache as before, and so does everything where the
filesystem refuses ``O_DIRECT`` (tmpfs, some network filesystems).
"""

from __future__ import annotations

import errno
import os
from typing import Optional

import numpy as np

from elastic_ext.state.buffers import PAGE_BYTES

O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every byte is written through the page cache


def address(view: memoryview) -> int:
    """The memory address where ``view`` starts."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class DirectFile:
    """A new file at ``path``, written sequentially through :meth:`write`, then :meth:`sync`.

    The file must not exist: it is created with ``O_EXCL|O_NOFOLLOW`` and
    mode 0600, so a name planted beforehand (a symbolic link to another
    file, someone else's file) fails the write instead of being followed or
    truncated. The ``O_DIRECT`` descriptor reopens the file through this
    process's own descriptor (``/proc/self/fd``), never through the path,
    which could have been swapped meanwhile.

    ``direct_bytes`` counts the bytes that bypassed the page cache.
    """

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.direct: Optional[int] = None
        if O_DIRECT:
            try:
                self.direct = self._open_direct()
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOENT):  # no O_DIRECT here, or no /proc
                    os.close(self.fd)
                    raise
        self.offset = 0
        self.direct_bytes = 0

    def _open_direct(self) -> Optional[int]:
        direct = os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | os.O_CLOEXEC | O_DIRECT)
        mine, other = os.fstat(self.fd), os.fstat(direct)
        if (mine.st_dev, mine.st_ino) != (other.st_dev, other.st_ino):  # cannot happen through /proc; checked anyway
            os.close(direct)
            return None
        return direct

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def write(self, chunk: memoryview) -> None:
        """Appends ``chunk``: its page-aligned whole pages directly, the rest through the page cache."""
        view = memoryview(chunk).cast("B")
        whole = view.nbytes - view.nbytes % PAGE_BYTES
        if self.direct is not None and whole and self.offset % PAGE_BYTES == 0 and address(view) % PAGE_BYTES == 0:
            view = view[self._write_direct(view[:whole]):]
        while view.nbytes:
            count = os.pwrite(self.fd, view, self.offset)
            self.offset += count
            view = view[count:]

    def _write_direct(self, view: memoryview) -> int:
        """Writes whole pages of ``view`` with O_DIRECT; returns how many bytes it wrote (all, normally)."""
        written = 0
        while written < view.nbytes:
            try:
                count = os.pwrite(self.direct, view[written:], self.offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._close_direct()  # refused after all (e.g. the device's block is larger): page cache from now
                break
            written += count
            self.offset += count
            self.direct_bytes += count
            if count % PAGE_BYTES:  # a short write off a page boundary: the rest goes through the page cache
                break
        return written

    def sync(self) -> None:
        """Makes the whole file durable, then drops its pages from the page cache."""
        os.fsync(self.fd)
        if hasattr(os, "posix_fadvise"):
            # Hundreds of MB per checkpoint would otherwise push the training's data out of the cache.
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _close_direct(self) -> None:
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None

    def close(self) -> None:
        self._close_direct()
        os.close(self.fd)
