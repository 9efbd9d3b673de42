"""Test helpers for your own State code: collectives without Horovod.

- :mod:`~elastic_ext.testing.solo`: :class:`SoloBinding`, a world of one rank,
  and :func:`state_on`, a :class:`~elastic_ext.State` whose collectives go
  through a given binding instead of Horovod.
- :mod:`~elastic_ext.testing.threads`: :class:`ThreadWorld`, N ranks as N
  threads, each with a binding that checks every rank entered the same
  collective (where Horovod would hang).
- :func:`heartbeat_period`: a faster heartbeat for tests of the stall check.

Job launchers, the fake metadata server, fault schedules, the sample
ledger and the watch through which the demo and the tests run the examples
(``devkit/watched.py``) are development tools, not part of the package: they live in the
repository's ``devkit/``.
"""

from elastic_ext.testing.solo import SoloBinding, state_on
from elastic_ext.testing.threads import CollectiveMismatch, ThreadWorld

__all__ = ["CollectiveMismatch", "SoloBinding", "ThreadWorld", "heartbeat_period", "state_on"]


def heartbeat_period(seconds: float) -> None:
    """Sets how often this process's workers beat (for the watchdogs started after this call).

    The tests of the stall check's races tick faster than the default
    :data:`elastic_ext.config.HEARTBEAT_PERIOD_S`, which is not a setting.
    """
    from elastic_ext import config
    if not seconds > 0:
        raise ValueError(f"heartbeat period ({seconds!r}) must be > 0")
    config.HEARTBEAT_PERIOD_S = float(seconds)
