"""Every test seam of elastic_ext, public so tests and benchmarks share them.

- :mod:`~elastic_ext.testing.solo`: :class:`SoloBinding`, a world of one rank,
  and :func:`state_on`, a :class:`~elastic_ext.State` whose collectives go
  through a given binding instead of Horovod.
- :mod:`~elastic_ext.testing.faults`: faults declared up front
  (:class:`FaultSchedule`, :class:`CommitFaultProbe`, :func:`flip_bit`) and
  scripted resizes (:class:`HostFileSchedule`).
- :mod:`~elastic_ext.testing.ledger`: the sample ledger that proves
  exactly-once.
- :mod:`~elastic_ext.testing.instrument`: :class:`Instrument`, the one hook
  through which the demo and the tests watch an example (faults, ledger).
- :mod:`~elastic_ext.testing.launch` and :mod:`~elastic_ext.testing.analysis`:
  launching real ``horovodrun`` jobs with a hard timeout, and reading what
  their workers wrote. They need ``psutil`` (the ``test`` extra) and are
  imported explicitly, not from here.

Training code never needs these: an example that demonstrates faults builds
its :class:`Instrument` outside the training loop.
"""

from elastic_ext.testing.faults import HOW, WHERE, CommitFaultProbe, Fault, FaultSchedule, HostFileSchedule, flip_bit
from elastic_ext.testing.instrument import Instrument
from elastic_ext.testing.solo import SoloBinding, state_on

__all__ = ["HOW", "WHERE", "CommitFaultProbe", "Fault", "FaultSchedule", "HostFileSchedule", "Instrument",
           "SoloBinding", "flip_bit", "heartbeat_period", "state_on"]


def heartbeat_period(seconds: float) -> None:
    """Sets how often this process's workers beat (for the watchdogs started after this call).

    The tests of the stall check's races tick faster than the default
    :data:`elastic_ext.config.HEARTBEAT_PERIOD_S`, which is not a setting.
    """
    from elastic_ext import config
    if not seconds > 0:
        raise ValueError(f"heartbeat period ({seconds!r}) must be > 0")
    config.HEARTBEAT_PERIOD_S = float(seconds)
