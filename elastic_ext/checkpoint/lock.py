"""Which job owns a checkpoint directory: a lock file the kernel releases, and the owner's identity.

Two jobs writing one directory (two ``supervise`` runs, a job relaunched
while the old one lingers) resume from the same checkpoint, count the same
commit ids, replace each other's checkpoints and delete each other's in
retention, until nothing verifies. So a local directory belongs to one job:

- ``<dir>/.lock`` is held with ``flock(LOCK_EX)`` by the process that writes
  (rank 0's, and ``supervise`` for its whole life). The kernel releases it
  when that process ends however it ends, so a lock left by a dead job is
  free and is taken over (with a warning naming the job it was).
- ``<dir>/owner.json`` says who holds it: ``job_id``, ``host``, ``pid``,
  ``started`` (Unix time). A process that finds the lock held reads it: the
  same ``job_id`` is the same job (rank 0 moved to another process, or the
  job runs under ``supervise``), which goes on and tries to take the lock
  again at its next write; another job id is refused with a
  :class:`~elastic_ext.errors.CheckpointError` naming the holder.

A filesystem without locks (``flock`` answers ENOLCK or EOPNOTSUPP) is
treated as an object store, with a warning. The job id is horovodrun's rendezvous server (:func:`job_id`): every
worker of one job names the same one, and no two jobs running at once
share it; outside horovodrun (a single process, ``mpirun``, whose rank 0
never moves) each process is its own job. A lingering process of an
earlier job (a run ``supervise`` restarted) is thus another job: the new run
is refused until it has gone, and ``supervise`` restarts it. Object stores
(fsspec URLs) have no lock: there a directory's permissions and one job at
a time are the user's to keep.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import secrets
import socket
import time
import weakref
from typing import Any, Dict, Optional

from elastic_ext.checkpoint.storage import LocalStorage
from elastic_ext.config import horovod_rendezvous
from elastic_ext.errors import CheckpointError

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
OWNER_FILE = "owner.json"
MAX_OWNER_BYTES = 4096  # the identity is a handful of fields: anything larger is not ours


def job_id() -> Optional[str]:
    """This process's job: ``horovodrun@ADDR:PORT`` of its rendezvous server, or None outside horovodrun."""
    rendezvous = horovod_rendezvous()
    return None if rendezvous is None else f"horovodrun@{rendezvous[0]}:{rendezvous[1]}"


def describe(owner: Dict[str, Any]) -> str:
    """An owner record as a message names it."""
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"job {owner.get('job_id')!r} (host {owner.get('host')!r}, pid {owner.get('pid')!r}, started {when})"


def read_owner(directory: str) -> Dict[str, Any]:
    """The owner record of ``directory``; ``{}`` if there is none or it is not one (never raises for its content)."""
    try:
        fd = os.open(os.path.join(directory, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        raw = os.read(fd, MAX_OWNER_BYTES + 1)
    except OSError as exc:
        logger.warning("cannot read %s: %s", os.path.join(directory, OWNER_FILE), exc)
        return {}
    finally:
        os.close(fd)
    try:
        owner = json.loads(raw.decode("utf-8")) if len(raw) <= MAX_OWNER_BYTES else None
    except (UnicodeDecodeError, ValueError):
        owner = None
    return owner if isinstance(owner, dict) else {}


class DirectoryLock:
    """The lock on one checkpoint directory, for the job ``job_id`` (None: this process is the job).

    :meth:`acquire` is called before each resume and each write; it is cheap
    once held (the descriptor stays open for the process's life).
    """

    def __init__(self, directory: str, job_id: Optional[str]) -> None:
        self.directory = directory
        self.local = "://" not in directory
        self.path = os.path.abspath(directory) if self.local else directory
        self.identity = {"job_id": job_id or f"{socket.gethostname()}:{os.getpid()}",
                         "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Holds the directory for this job (see the module docstring).

        Raises:
            CheckpointError: another job holds it (the message names that
                job's id, host, pid and start), or the lock file cannot be made.
        """
        if self._fd is not None or not self.local:
            return
        try:
            LocalStorage(self.path).makedirs(self.path)
            fd = os.open(os.path.join(self.path, LOCK_FILE),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CheckpointError(f"cannot lock checkpoint directory {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            owner = read_owner(self.path)
            if owner.get("job_id") == self.identity["job_id"]:
                logger.debug("%s is held by another process of this job (%s)", self.path, describe(owner))
                return
            raise CheckpointError(
                f"checkpoint directory {self.path} is in use by {describe(owner) if owner else 'another process'}"
                f" ({exc.strerror}); two jobs writing one directory destroy each other's checkpoints: stop that "
                f"job, or give this one another checkpoint_dir") from None
        except OSError as exc:  # ENOLCK, EOPNOTSUPP...: this filesystem has no locks, as an object store
            os.close(fd)
            self.local = False
            logger.warning("checkpoint directory %s cannot be locked (%s): one job at a time on it is up to you",
                           self.path, exc)
            return
        previous = read_owner(self.path)
        if previous and previous.get("job_id") != self.identity["job_id"]:
            logger.warning("taking over checkpoint directory %s from %s: no process of it holds the lock any more",
                           self.path, describe(previous))
        try:
            self._write_owner()
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(f"cannot record the owner of checkpoint directory {self.path}: {exc}") from exc
        self._fd = fd
        # A forked child (a data loader worker) would share the lock and keep it after this process
        # died; it closes its copy at once, so the lock lives exactly as long as this process.
        os.register_at_fork(after_in_child=functools.partial(_close_in_child, weakref.ref(self)))

    def _write_owner(self) -> None:
        target = os.path.join(self.path, OWNER_FILE)
        temporary = f"{target}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(self.identity, sort_keys=True).encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)

    def release(self) -> None:
        """Gives the directory up (the kernel does the same when the process ends)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:
        self.release()


def _close_in_child(ref: "weakref.ref[DirectoryLock]") -> None:
    lock = ref()
    if lock is not None and lock._fd is not None:
        fd, lock._fd = lock._fd, None
        os.close(fd)
