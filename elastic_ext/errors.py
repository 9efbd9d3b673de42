"""The whole exception hierarchy of elastic_ext, discovery's included.

Every error raised on purpose by this package derives from
:class:`ElasticExtError`. The discovery kinds below each map to one
documented exit code of the discovery scripts (``elastic_ext.discovery.cli``). Horovod's own control-flow exceptions
(``HorovodInternalError``, ``HostsUpdatedInterrupt``) are not wrapped: they
are signals that drive rollback and resize, not errors.

Messages quote the bad value and the rule it broke, e.g.
``min_np (6) must be <= max_np (4)``.
"""

from __future__ import annotations


class ElasticExtError(Exception):
    """Base class of every error raised by elastic_ext."""


class ConfigError(ElasticExtError, ValueError):
    """A bad argument or environment variable, raised at construction."""


class DiscoveryError(ElasticExtError):
    """Host discovery could not produce a host list (scheduler, cloud or file)."""


class DiscoveryInputError(DiscoveryError, ValueError):
    """Bad input or configuration: a malformed nodelist, host file or slot value,
    a missing region, a missing Python dependency. Retrying will not help."""


class DiscoveryUnavailableError(DiscoveryError):
    """The scheduler or cloud API is unreachable, missing, or answered with an error."""


class DiscoveryTimeoutError(DiscoveryUnavailableError):
    """A scheduler or cloud call, or the whole discovery run, exceeded its time bound."""


class PartitionError(ElasticExtError, ValueError):
    """Inputs to data re-partitioning are inconsistent (bad cursor, world size, ...)."""


class StateError(ElasticExtError):
    """Committed state cannot be committed, restored or synced."""


class NotCommittedError(StateError):
    """``restore()`` was called before any ``commit()``."""


class StateDivergenceError(StateError):
    """Ranks disagree on what they committed (commit id, cursor or structure)."""


class CheckpointError(ElasticExtError):
    """A durable checkpoint cannot be written or read."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification (checksum, size or manifest); it is never loaded."""


class CheckpointReadError(CheckpointError):
    """Checkpoint storage could not be read (permission denied, I/O error, service unavailable).

    Not corruption: nothing says the checkpoint is bad, so a job never falls
    back to an older one (or to its initial state) because of it.
    """


class RollbackLimitError(ElasticExtError):
    """Too many consecutive rollbacks happened without a new commit."""


__all__ = [
    "ElasticExtError",
    "ConfigError",
    "DiscoveryError",
    "DiscoveryInputError",
    "DiscoveryUnavailableError",
    "DiscoveryTimeoutError",
    "PartitionError",
    "StateError",
    "NotCommittedError",
    "StateDivergenceError",
    "CheckpointError",
    "CorruptCheckpointError",
    "CheckpointReadError",
    "RollbackLimitError",
]
