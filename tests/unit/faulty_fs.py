"""Fault injection into the checkpoint storage layer through fsspec.

``faulty:///some/dir`` is the local filesystem (fsspec's own
``LocalFileSystem``, real files under a test's tmp_path) except that chosen
calls raise: e.g. every ``open`` for reading of a path containing
``manifest.json`` raises ``OSError(EIO)``, or ``rm`` raises
``PermissionError``. The checkpoint code reaches it exactly as it reaches
``s3://`` or ``gs://``: by URL, through ``fsspec.core.url_to_fs``.

Faults are declared up front and fire a bounded number of times.
"""

from __future__ import annotations

import dataclasses
import errno
from typing import Callable, List, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faulty"


def eio(path: str) -> OSError:
    return OSError(errno.EIO, "Input/output error (injected)", path)


def denied(path: str) -> PermissionError:
    return PermissionError(errno.EACCES, "Access Denied (injected, like an S3 403)", path)


@dataclasses.dataclass
class Fault:
    """``method`` on a path containing ``match`` raises ``error(path)``, ``times`` times (None: always).

    Note that fsspec's generic ``exists()`` calls ``info()`` and answers False
    on any exception: an ``info`` fault shows what such backends do with a 403.

    ``mode`` restricts ``open`` faults to reads ("r") or writes ("w").
    """

    method: str
    match: str
    error: Callable[[str], BaseException]
    times: Optional[int] = None
    mode: Optional[str] = None
    exact: bool = False  # the path must be ``match`` itself, not merely contain it
    fired: int = 0


class FaultyFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)
    faults: List[Fault] = []
    calls: List[tuple] = []

    def _check(self, method: str, path: str, mode: str = "") -> None:
        path = str(path)
        FaultyFileSystem.calls.append((method, path, mode))
        for fault in FaultyFileSystem.faults:
            if fault.method != method or fault.match not in path or (fault.exact and fault.match != path):
                continue
            if fault.mode is not None and fault.mode not in mode:
                continue
            if fault.times is not None and fault.fired >= fault.times:
                continue
            fault.fired += 1
            raise fault.error(path)

    def _open(self, path, mode="rb", *args, **kwargs):
        self._check("open", path, mode)
        return super()._open(path, mode, *args, **kwargs)

    def ls(self, path, *args, **kwargs):
        self._check("ls", path)
        return super().ls(path, *args, **kwargs)

    def info(self, path, *args, **kwargs):
        self._check("info", path)
        return super().info(path, *args, **kwargs)

    def exists(self, path, *args, **kwargs):
        # Like s3fs: a 403 or 503 is raised, only a missing key answers False.
        self._check("exists", path)
        return super().exists(path, *args, **kwargs)

    def rm(self, path, *args, **kwargs):
        self._check("rm", path)
        return super().rm(path, *args, **kwargs)

    def makedirs(self, path, *args, **kwargs):
        self._check("makedirs", path)
        return super().makedirs(path, *args, **kwargs)


def install(*faults: Fault) -> None:
    """Registers the ``faulty://`` protocol and replaces the declared faults."""
    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
    FaultyFileSystem.faults = list(faults)
    FaultyFileSystem.calls = []


def url(path) -> str:
    return f"{PROTOCOL}://{path}"
