"""Where checkpoint files live: one protocol, a local and an fsspec implementation.

The format needs a handful of file operations. :class:`LocalStorage` makes
each one durable the POSIX way (write to a temporary name of this write
alone, ``<name>.<pid>.<random>.tmp`` created with ``O_EXCL|O_NOFOLLOW`` and
mode 0600, fsync, rename, fsync the directory; directories are made 0700); :class:`FsspecStorage` serves URLs (``s3://``, ``memory://``...),
where there is no rename and the manifest written last is what makes a
checkpoint valid. :func:`open_storage` picks one from the path.

Neither implementation asks ``exists()`` before listing or reading: both
``os.path.exists`` and fsspec's generic ``exists`` answer False for a
permission or I/O error, which would pass an unreadable checkpoint off as a
missing one.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from typing import IO, Iterable, List, Protocol, Tuple

from elastic_ext.checkpoint.direct import DirectFile
from elastic_ext.checkpoint.format import Xxh3


class Storage(Protocol):
    """The file operations the checkpoint format needs, under one root."""

    root: str

    def join(self, *parts: str) -> str:
        """A path under the root, as this storage's own calls take it."""

    def address(self, *parts: str) -> str:
        """What a user passes back in: the URL for fsspec, the path otherwise."""

    def makedirs(self, path: str) -> None:
        """Creates ``path`` and missing parents (durably where the storage can)."""

    def list_names(self) -> List[str]:
        """Names in the root; none if it does not exist yet (other errors are raised)."""

    def exists(self, path: str) -> bool:
        """True if ``path`` exists, False only if it does not; any other error is raised."""

    def size(self, path: str) -> int:
        """Size of a file in bytes."""

    def open_read(self, path: str) -> IO[bytes]:
        """A binary read handle."""

    def write(self, path: str, chunks: Iterable[memoryview]) -> Tuple[int, str]:
        """Writes ``chunks`` durably at ``path``; returns (bytes, XXH3-64 hex)."""

    def remove(self, path: str) -> None:
        """Deletes ``path`` (a file or a whole directory); raises OSError if it cannot."""

    def sync_dir(self, path: str) -> None:
        """Makes renames in ``path`` durable (a no-op where there is no rename)."""


def open_storage(root: str) -> Storage:
    """The storage for ``root``: fsspec for a URL (``scheme://``), the local filesystem otherwise."""
    return FsspecStorage(root) if "://" in root else LocalStorage(root)


def _copy_chunks(handle: "IO[bytes] | DirectFile", chunks: Iterable[memoryview]) -> Tuple[int, str]:
    digest, total = Xxh3(), 0
    for chunk in chunks:
        digest.update(chunk)  # xxhash and write both release the GIL on large buffers
        handle.write(chunk)
        total += chunk.nbytes
    return total, digest.hexdigest()


class LocalStorage:
    """A local directory; every write is atomic (``.tmp`` + rename) and fsynced."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"
        self.base = os.path.abspath(root)

    def join(self, *parts: str) -> str:
        return os.path.join(self.base, *parts)

    def address(self, *parts: str) -> str:
        return self.join(*parts)

    def makedirs(self, path: str) -> None:
        """Creates ``path`` (mode 0700) and its missing parents; a symbolic link below the root is refused.

        Raises:
            OSError: it cannot be created, or an existing directory below the
                root is a symbolic link (a planted ``ckpt-N`` would send the
                write elsewhere).
        """
        below = os.path.relpath(os.path.abspath(path), self.base)
        if not below.startswith(os.pardir):
            current = self.base
            for part in () if below == os.curdir else below.split(os.sep):
                current = os.path.join(current, part)
                if os.path.islink(current):
                    raise OSError(errno.ELOOP, "a symbolic link inside the checkpoint directory is not "
                                  "followed", current)
        missing = []
        while not os.path.isdir(path):
            missing.append(path)
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o700)  # checkpoints hold a job's weights: its user's alone
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise
                continue  # created by someone else meanwhile: their fsync, not ours
            # A new directory's name lives in its parent: without this fsync a
            # power loss can drop the whole checkpoint directory, fsynced files and all.
            self.sync_dir(os.path.dirname(directory))

    def list_names(self) -> List[str]:
        try:
            return os.listdir(self.base)
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    def write(self, path: str, chunks: Iterable[memoryview]) -> Tuple[int, str]:
        # A name of this write alone: two writers (or a leftover) never share a temporary file,
        # and DirectFile refuses one that exists (O_EXCL), a planted link included.
        target = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with DirectFile(target) as handle:  # O_DIRECT where it can: no copy into the page cache
                result = _copy_chunks(handle, chunks)
                handle.sync()
            os.replace(target, path)
        except BaseException:
            _remove_quietly(target)  # a failed write leaves no partial file of gigabytes behind
            raise
        return result

    def remove(self, path: str) -> None:
        """Deletes ``path``.

        Raises:
            OSError: it cannot be deleted, or it is a symbolic link: retention
                deletes only what it wrote, never what a link points at, and
                does not remove links someone placed on purpose.
        """
        if os.path.islink(path):
            raise OSError(errno.EPERM, f"it is a symbolic link (to {os.readlink(path)!r}); "
                          "retention only deletes directories it wrote", path)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the write's own error is the one that matters
        logging.getLogger(__name__).warning("cannot remove the partial file %s: %s", path, exc)


class FsspecStorage:
    """A URL served by fsspec (object stores, ``memory://``, test filesystems).

    Writes go straight to their final name: object stores have no rename,
    and a checkpoint counts only once its manifest, written last, exists.
    """

    def __init__(self, root: str) -> None:
        import fsspec  # only for URLs
        self.root = root.rstrip("/") or "/"
        self.fs, self.base = fsspec.core.url_to_fs(root)

    def join(self, *parts: str) -> str:
        return "/".join((self.base,) + parts)

    def address(self, *parts: str) -> str:
        return "/".join((self.root,) + parts)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def list_names(self) -> List[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.base, detail=False)]
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        try:
            self.fs.info(path)  # not fs.exists(): it answers False for any error
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def open_read(self, path: str) -> IO[bytes]:
        return self.fs.open(path, "rb")

    def write(self, path: str, chunks: Iterable[memoryview]) -> Tuple[int, str]:
        with self.fs.open(path, "wb") as handle:
            return _copy_chunks(handle, chunks)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def sync_dir(self, path: str) -> None:
        return None  # nothing is renamed on an object store
