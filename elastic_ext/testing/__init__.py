"""Every test seam of elastic_ext, public so tests and benchmarks share them.

- :mod:`~elastic_ext.testing.solo`: :class:`SoloBinding`, a world of one rank,
  and :func:`state_on`, a :class:`~elastic_ext.State` whose collectives go
  through a given binding instead of Horovod.
- :mod:`~elastic_ext.testing.faults`: faults declared up front
  (:class:`FaultSchedule`, :class:`CommitFaultProbe`) and scripted resizes
  (:class:`HostFileSchedule`).
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

from elastic_ext.testing.faults import HOW, WHERE, CommitFaultProbe, Fault, FaultSchedule, HostFileSchedule
from elastic_ext.testing.instrument import Instrument
from elastic_ext.testing.solo import SoloBinding, state_on

__all__ = ["HOW", "WHERE", "CommitFaultProbe", "Fault", "FaultSchedule", "HostFileSchedule", "Instrument",
           "SoloBinding", "state_on"]
