"""The development kit: what the tests, the benchmarks and the demo need, never shipped.

``setup.py`` packages ``elastic_ext`` only, so nothing here is in the wheel;
it is imported from a checkout (the repository root on ``sys.path``:
``tests/conftest.py``, ``python -m bench.x`` from the root, and the
``PYTHONPATH`` that :func:`devkit.launch.base_env` gives every launched job).

- :mod:`~devkit.launch` and :mod:`~devkit.analysis`: launching real
  ``horovodrun`` jobs with a hard timeout, and reading what their workers
  wrote (``psutil``, the ``test`` extra).
- :mod:`~devkit.faults`: faults declared up front (:class:`~devkit.faults.FaultSchedule`,
  :class:`~devkit.faults.CommitFaultProbe`, :func:`~devkit.faults.flip_bit`) and scripted
  resizes (:class:`~devkit.faults.HostFileSchedule`).
- :mod:`~devkit.ledger`: the sample ledger that proves exactly-once.
- :mod:`~devkit.metadata_server` and :mod:`~devkit.notice_job`: a fake cloud
  metadata server and the preemption-notice jobs run against it.
- :mod:`~devkit.watched`: an example run as its users run it, with the
  faults, the sample ledger and the pacing put on from outside its code
  (``python -m devkit.watched ... -- SCRIPT ARGS``).

The public test helpers a user may want for their own code (a one-rank
binding, ranks as threads) stay in :mod:`elastic_ext.testing`.
"""
