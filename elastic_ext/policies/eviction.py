"""Straggler eviction inside a job: the timer, the table on the commit's allreduce, the decision.

:mod:`elastic_ext.policies.straggler` holds the rules (pure arithmetic); this module
connects them to :class:`~elastic_ext.State`:

- ``state.step_timer`` (a :class:`~elastic_ext.policies.step_timer.StepTimer`) is what
  the training loop wraps around its own compute (forward, backward), not
  around what waits for the others::

      with state.step_timer:
          loss = model(x); loss.backward()
      optimizer.step()            # waits for the gradient allreduce

- At every commit, :meth:`StragglerWatch.slots` puts this rank's median compute
  time per step, its samples per step (its share of the global batch, so an
  uneven share assigned on purpose is not "slow") and the number of steps
  measured into the commit's max-allreduce: no collective of its own.
- :meth:`StragglerWatch.decide` reads the agreed table (:class:`StragglerAtCommit`
  is the watch's part in the commit, :mod:`elastic_ext.state.commit_slots`); every rank gets the same
  answer. The rank to evict is asked to leave through the graceful-leave
  path (no rollback, its commit made durable, exit 143 so Horovod's driver
  drops its host), writes a ``straggler`` event, and appends its host name
  to ``ElasticConfig.exclude_file`` when one is set, for a discovery
  script's exclude list (``host_discovery/static.py --exclude-file``).

Every reset (resize, rollback, numeric rollback) discards what the timer
measured and starts the warm-up again: replayed steps and newcomers'
first steps are not compared.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from typing import Any, Iterable, Optional

import numpy as np

from elastic_ext.data import partition
from elastic_ext.discovery.static import read_exclude_file
from elastic_ext.errors import ConfigError, DiscoveryInputError
from elastic_ext.events import STRAGGLER
from elastic_ext.policies.step_timer import StepTimer, pack_slots, unpack_slots
from elastic_ext.policies.straggler import StragglerPolicy, StragglerTracker
from elastic_ext.state.commit_slots import CommitPoint

logger = logging.getLogger(__name__)


def host_name() -> str:
    """The name Horovod's driver knows this worker's host by (``HOROVOD_HOSTNAME``), else the machine's."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


class StragglerWatch:
    """One rank's straggler monitor: its timer, the tracker every rank keeps alike, the verdict.

    Args:
        policy: the rules; None makes every method a no-op that adds nothing
            to the commit's allreduce.
        exclude_file: where the evicted rank appends its host (None: nowhere).
    """

    def __init__(self, policy: Optional[StragglerPolicy], exclude_file: Optional[str] = None) -> None:
        if policy is not None and not isinstance(policy, StragglerPolicy):
            raise ConfigError(f"straggler ({policy!r}) must be an elastic_ext.StragglerPolicy or None")
        self.policy = policy
        self.exclude_file = exclude_file
        self.timer = StepTimer()
        self._tracker = StragglerTracker(policy) if policy is not None else None
        self._steps = 0  # steps observed since the start (replays count: the clock never goes back)

    @property
    def enabled(self) -> bool:
        return self.policy is not None

    def reset(self) -> None:
        """After a resize or a rollback: forget the measurements, warm up again."""
        self.timer.discard()
        if self._tracker is not None:
            self._tracker.reset(self._steps)

    def slots(self, rank: int, size: int, objects: Iterable[Any], local_size: int = 1) -> Optional[np.ndarray]:
        """This rank's part of the commit's max-allreduce, or None when off: ``2 * size`` slots of
        the table, then the steps measured and the ranks on this rank's host (both: maximum)."""
        if not self.enabled:
            return None
        step_s, steps = self.timer.report()
        vector = np.zeros(2 * size + 2, dtype=np.int64)
        vector[:2 * size] = pack_slots(rank, size, step_s, samples_per_step(objects, rank, size))
        vector[-2] = steps
        vector[-1] = local_size
        return vector

    def decide(self, reduced: np.ndarray, size: int):
        """The :class:`~elastic_ext.policies.straggler.Eviction` agreed from the reduced slots, or None.

        None also when evicting would leave fewer than ``policy.min_size``
        ranks (the evicted rank's host goes with it; the largest host counts).
        """
        reduced = np.asarray(reduced)
        compute_s, samples = unpack_slots(reduced[:2 * size], size)
        self._steps += int(reduced[-2])
        decision = self._tracker.observe(self._steps, compute_s, samples)
        if decision is not None and size - max(1, int(reduced[-1])) < self.policy.min_size:
            logger.warning("rank %d is a straggler (%.1fx the others) but evicting it would leave fewer than "
                           "min_size (%d) of %d ranks: it stays", decision.rank, decision.ratio,
                           self.policy.min_size, size)
            return None
        return decision

    def exclude(self, host: str) -> None:
        """Appends ``host`` to the exclude file (if any), once, under a lock."""
        exclude_host(self.exclude_file, host, "evicted as a straggler")


class StragglerAtCommit:
    """The watch's part in the commit (a :class:`~elastic_ext.state.commit_slots.CommitContribution`):
    its table rides on the commit's collective; an eviction agreed from it makes the evicted rank leave."""

    blocking = False  # where commits overlap, an eviction may act one commit later

    def __init__(self, watch: StragglerWatch) -> None:
        self.watch = watch
        self._evicted = None  # this commit's Eviction, once a table named one

    def row(self, at: CommitPoint) -> Optional[np.ndarray]:
        self._evicted = None
        local_size = getattr(at.binding, "local_size", None)
        return self.watch.slots(at.rank, at.size, at.objects,
                                local_size() if local_size is not None and self.watch.enabled else 1)

    def check(self, columns: np.ndarray, at: CommitPoint) -> None:
        """Nothing to check on this commit's own table: it is observed with the others."""

    def observe(self, columns: Optional[np.ndarray], at: CommitPoint) -> bool:
        if columns is not None and self._evicted is None:
            self._evicted = self.watch.decide(columns, at.size)
        return self._evicted is not None

    def enact(self, at: CommitPoint) -> bool:
        """Every rank decided alike: a removal at this commit, like a SIGTERM leave."""
        evicted, self._evicted = self._evicted, None
        if evicted is None:
            return False
        fields = evicted.fields()
        if evicted.rank == at.rank:
            host = host_name()
            self.watch.exclude(host)
            fields["host"] = host
            at.liveness.ask_to_leave(at.term_grace_s, cause="straggler")
        at.events.emit(STRAGGLER, commit_id=at.commit_id, **fields)
        return True


def exclude_host(path: Optional[str], host: str, why: str) -> None:
    """Appends ``host`` to the exclude file ``path`` (None: no file) once, under a lock, with ``why``
    as a comment; a discovery script's ``--exclude-file`` then keeps it out of the job."""
    if not path:
        return
    try:
        with open(path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            # Read as the discovery script reads it, so both agree on what is listed.
            if host not in read_exclude_file(path):
                handle.write(f"{host}  # {why} by elastic_ext\n")
    except (OSError, DiscoveryInputError) as exc:
        logger.error("cannot add host %r (%s) to exclude file %r: %s", host, why, path, exc)


def samples_per_step(objects: Iterable[Any], rank: int, size: int) -> int:
    """This rank's samples per step: its share of a tracked partitioner's global batch, else 1."""
    for obj in objects:
        global_batch = getattr(obj, "global_batch", None)
        if isinstance(global_batch, int) and hasattr(obj, "record_step") and global_batch >= size:
            return partition.share(global_batch, size, rank)[1]
    return 1


__all__ = ["StragglerAtCommit", "StragglerWatch", "exclude_host", "host_name", "samples_per_step"]
