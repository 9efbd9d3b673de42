"""Asking Linux which pages this process wrote: a ``userfaultfd`` with asynchronous write protection.

:class:`Watch` is this process's ``userfaultfd`` (``UFFD_FEATURE_WP_ASYNC``,
Linux 6.7) and ``/proc/self/pagemap``: it registers ranges, stops their
faults, and lists (and protects again) the pages written since the last
scan with the ``PAGEMAP_SCAN`` ioctl; and it holds the pairings of watched
memory with buffers that :mod:`elastic_ext.state.written` keeps. Where the
kernel lacks the feature or the syscall is refused it is not
:attr:`~Watch.available`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import platform
import struct
import threading
import weakref
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

log = logging.getLogger(__name__)

_SYSCALL_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_UFFD_FEATURE_WP_UNPOPULATED = 1 << 13
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_API = 0xC018AA3F          # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00     # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_WRITEPROTECT = 0xC018AA06  # _IOWR(0xAA, 0x06, struct uffdio_writeprotect)
_UFFDIO_REGISTER_MODE_WP = 1 << 1
_PAGEMAP_SCAN = 0xC0606610        # _IOWR('f', 16, struct pm_scan_arg)
_PM_SCAN_WP_MATCHING = 1 << 0     # protect the pages it reports again
_PM_SCAN_CHECK_WPASYNC = 1 << 1   # refuse (EPERM) memory not registered for asynchronous protection
_PAGE_IS_WRITTEN = 1 << 1
_REGIONS = 1024                   # page_region entries read per ioctl


class Watch:
    """This process's userfaultfd and the pairings of watched memory with buffers."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.pairs: Dict[Tuple[int, int], "weakref.ReferenceType[np.ndarray]"] = {}
        self.dense: Dict[Tuple[int, int], int] = {}  # registered, unprotected: whole copies left
        self.waits: Dict[Tuple[int, int], int] = {}  # the wait of the next dense finding
        self.refused: Set[Tuple[int, int]] = set()  # shared, mapped from a file, or refused by the kernel
        self.uffd = -1
        self.pagemap = -1
        self._regions = (ctypes.c_uint64 * (3 * _REGIONS))()
        try:
            self._open()
        except OSError as exc:
            log.debug("no write tracking (%s): every commit and restore copies whole arrays", exc)
            self.close()

    def _open(self) -> None:
        if _SYSCALL_USERFAULTFD is None:
            raise OSError(errno.ENOSYS, f"userfaultfd's syscall number is unknown on {platform.machine()}")
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(_SYSCALL_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"userfaultfd: {os.strerror(code)}")
        self.uffd = fd
        api = bytearray(struct.pack("QQQ", _UFFD_API, _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED, 0))
        fcntl.ioctl(self.uffd, _UFFDIO_API, api)  # EINVAL before Linux 6.7 (no asynchronous protection)
        self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)

    @property
    def available(self) -> bool:
        return self.uffd >= 0 and self.pagemap >= 0

    def close(self) -> None:
        for fd in (self.uffd, self.pagemap):
            if fd >= 0:
                os.close(fd)
        self.uffd = self.pagemap = -1

    def register(self, start: int, end: int) -> bool:
        """Watches pages [start, end); False if the kernel refuses (memory mapped from a file...)."""
        try:
            fcntl.ioctl(self.uffd, _UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", start, end - start,
                                                                            _UFFDIO_REGISTER_MODE_WP, 0)))
        except OSError as exc:
            log.debug("cannot watch %#x-%#x for writes (%s); it is copied whole", start, end, exc)
            return False
        return True

    def unprotect(self, start: int, end: int) -> None:
        """Stops the faults on [start, end), which stays registered (:meth:`registered` tells it
        from memory mapped there later)."""
        fcntl.ioctl(self.uffd, _UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", start, end - start, 0)))

    def registered(self, start: int, end: int) -> bool:
        """True if [start, end) is still the memory this watch registered."""
        vec = self._regions
        arg = bytearray(struct.pack("12Q", 96, _PM_SCAN_CHECK_WPASYNC, start, end, 0, ctypes.addressof(vec),
                                    _REGIONS, 1, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN))
        try:
            fcntl.ioctl(self.pagemap, _PAGEMAP_SCAN, arg)
        except OSError as exc:
            if exc.errno == errno.EPERM:
                return False
            raise
        return True

    def scan(self, start: int, end: int, protect: bool) -> Optional[List[Tuple[int, int]]]:
        """The written pages of [start, end) as address ranges (``protect``: protected again);
        None if the range is not watched."""
        found: List[Tuple[int, int]] = []
        vec = self._regions
        flags = _PM_SCAN_CHECK_WPASYNC | (_PM_SCAN_WP_MATCHING if protect else 0)
        at = start
        while at < end:
            arg = bytearray(struct.pack("12Q", 96, flags, at, end, 0,
                                        ctypes.addressof(vec), _REGIONS, 0, 0, _PAGE_IS_WRITTEN, 0,
                                        _PAGE_IS_WRITTEN))
            try:
                count = fcntl.ioctl(self.pagemap, _PAGEMAP_SCAN, arg)
            except OSError as exc:
                if exc.errno == errno.EPERM:  # not registered: never watched, or freed and mapped again
                    return None
                raise
            found.extend((vec[3 * i], vec[3 * i + 1]) for i in range(count))
            walk_end = struct.unpack_from("Q", arg, 32)[0]
            if walk_end <= at:  # no progress: the list may be partial, so the caller copies everything
                return None
            at = walk_end
        return found
