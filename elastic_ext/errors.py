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


class PartialCheckpointError(CorruptCheckpointError):
    """A checkpoint has no manifest: its write was cut before it finished (a leftover, not damage)."""


class UnsupportedCheckpointError(CheckpointError):
    """A checkpoint of a newer format version than this elastic_ext reads.

    Not corruption: the job stops rather than fall back to an older
    checkpoint or its initial state (``checkpoint_fresh_start`` overrides).
    """


class CheckpointReadError(CheckpointError):
    """Checkpoint storage could not be read (permission denied, I/O error, service unavailable).

    Not corruption: nothing says the checkpoint is bad, so a job never falls
    back to an older one (or to its initial state) because of it.
    """


class RollbackLimitError(ElasticExtError):
    """Too many consecutive rollbacks happened without a new commit."""


class NumericFaultError(ElasticExtError):
    """A step's loss or gradient is non-finite or spiked; every rank raises it together.

    A signal for the ``run`` decorator (roll back, skip the step's samples,
    continue), like Horovod's ``HorovodInternalError`` for a failed
    collective. ``step`` is the global step, ``reason`` one of
    ``elastic_ext.policies.guard.REASONS``, ``verdict`` the full ``elastic_ext.policies.guard.Verdict``;
    ``skips`` the sample ranges ``(sampler name, epoch, start, stop)`` the
    step would have consumed (filled by ``State.guard_step``).
    """

    def __init__(self, verdict) -> None:
        super().__init__(verdict.describe())
        self.verdict = verdict
        self.step = verdict.step
        self.reason = verdict.reason
        self.skips: list = []


class ReplicaMismatchError(ElasticExtError):
    """The replica check found ranks whose committed states differ; every rank raises it together.

    A signal for the ``run`` decorator, like :class:`NumericFaultError`: every
    rank goes back to ``back_to``, the last commit on which all agreed (kept
    in host memory), and trains again to ``commit_id``, where the check tells
    a transient fault (all agree now) from a deterministic divergence (the
    same ranks differ again: :class:`StateDivergenceError`). ``wrong_ranks``
    and ``first_difference`` are what the check found.
    """

    def __init__(self, commit_id: int, back_to: int, wrong_ranks: list, first_difference) -> None:
        super().__init__(f"replica check at commit {commit_id}: ranks {wrong_ranks} differ (first difference: "
                         f"{first_difference}); replaying from commit {back_to}, the last on which every rank agreed")
        self.commit_id = commit_id
        self.back_to = back_to
        self.wrong_ranks = wrong_ranks
        self.first_difference = first_difference


class NumericRollbackLimitError(RollbackLimitError):
    """More numeric rollbacks in a row than ``ElasticConfig.rollback_limit`` without a new commit.

    The training itself is broken (diverged, a learning rate too high, a
    poisoned dataset), not one batch: skipping more steps would only lose data.
    """


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
    "PartialCheckpointError",
    "UnsupportedCheckpointError",
    "CheckpointReadError",
    "RollbackLimitError",
    "NumericFaultError",
    "NumericRollbackLimitError",
    "ReplicaMismatchError",
]


# Event fields quote an exception's message up to this many characters (a Gloo
# error can carry a whole stack of peers; events are one JSON line each).
ERROR_DETAIL_CHARS = 500


def error_detail(exc: BaseException) -> str:
    """An exception's message as an event field: ``str(exc)`` cut at :data:`ERROR_DETAIL_CHARS`."""
    return str(exc)[:ERROR_DETAIL_CHARS]
