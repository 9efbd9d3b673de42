"""A worker's side of the launcher: its entry (``python -m elastic_ext.worker.entry SCRIPT``) and what it installs.

The entry (:mod:`~elastic_ext.worker.entry`) runs before the user's script:
the job's secret, the keeper that restarts a worker in place, Horovod's
changes in a worker (:mod:`~elastic_ext.worker.horovod_changes`: the
newcomer's early start around ``hvd.init()``, the collective wait), Gloo's
first timeout, SIGTERM as a leave, preemption notices, huge pages. What it
installs runs later in the same process, called by the run loop
(:mod:`elastic_ext.runtime`): the early start of newcomers on the survivors
(:mod:`~elastic_ext.worker.prestart`), the round watch, Gloo's timeout at a
reset, the newcomer's join. Nothing here runs in the driver's process.
"""
