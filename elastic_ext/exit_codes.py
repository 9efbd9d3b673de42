"""The exit statuses a worker of elastic_ext gives itself, and what each means to the launcher's driver.

A leaf: it imports nothing of the project, so the driver, the worker before
the user's script and the worker during training all name one table. Each
is distinct from a crash (Python's 1), from a signal's ``128 + n`` (except
:data:`LEAVE`, which is one on purpose) and from each other, so the driver
and a reader of the job's log tell them apart. ``docs/architecture.md``
("Failures") shows which detector ends a worker with which.

Horovod's driver counts every non-zero exit as the failure of its slot and
shrinks the job (it ends the job only when every worker exited 0); the
launcher's driver (:mod:`elastic_ext.launch.driver`) also reads
:data:`PEERS_FAILED` and :data:`DISMISSED`, below.
"""

from __future__ import annotations

from typing import Dict

#: A worker that could not reach its driver for ``FENCE_S`` (the driver watch,
#: :mod:`elastic_ext.runtime.driver_watch`) exits rather than train cut off from its
#: job. EX_TEMPFAIL: not a crash of the worker, not the leave code.
FENCED = 75

#: A worker that waited in a collective whose every connection was closed ended
#: itself because its round's peers failed (:mod:`elastic_ext.runtime.closed_links`):
#: the launcher's driver does not count it as a failure of its host.
PEERS_FAILED = 76

#: A starting worker the launcher's driver dismissed (its ``dismissed_key`` in the
#: store, read by :mod:`elastic_ext.worker.newcomer`): its slot comes back later, its
#: host is not blacklisted for it.
DISMISSED = 77

#: A worker that leaves at a commit (SIGTERM, a preemption notice, a straggler
#: eviction, a rank left out of the next world; :mod:`elastic_ext.worker.sigterm`,
#: :mod:`elastic_ext.runtime.recovery`). 128 + SIGTERM: non-zero, so Horovod's driver
#: shrinks the job instead of ending it.
LEAVE = 143

#: Each code and its meaning, for logs and docs.
MEANINGS: Dict[int, str] = {
    FENCED: "fenced: cut off from its driver",
    PEERS_FAILED: "ended itself: its round's peers failed",
    DISMISSED: "dismissed by the driver while starting",
    LEAVE: "left at a commit (SIGTERM, notice, eviction)",
}
