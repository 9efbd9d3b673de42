"""The driver's side of preemption notices: a host with a notice leaves discovery; Slurm's signal reaches every worker.

``elastic-horovodrun`` makes these changes in its driver (:func:`changes`, and its driver class,
:mod:`elastic_ext.launch.driver`):

1. **A host with a notice is dropped from discovery for good.** A worker
   whose host has a notice (:mod:`elastic_ext.worker.notices`) writes the
   host's name into the driver's rendezvous store (scope
   :data:`~elastic_ext.worker.notices.NOTICE_SCOPE`, with the job's secret
   or from the host's own address, :mod:`elastic_ext.launch.store_guard`);
   the driver records it (for a host its discovery has listed) and
   leaves it out of every host list its discovery returns, whichever
   script (``host_discovery/*.py``, a user's own, fixed hosts) produced it.
   Otherwise a host whose workers left would still be listed until the
   cloud takes it: Horovod would start new workers on it (when only some of
   its workers had left) or take it back after a blacklist cooldown. The
   store itself is cleared at every round; the record is kept here. No
   shared file system is needed, as an exclude file would.
2. **Slurm's signal for the whole job.** ``sbatch --signal=B:USR1@SECONDS``
   signals the batch script, which ``exec elastic-horovodrun ...`` makes this
   driver; its workers on other nodes, started over ssh, are in no job step.
   On :data:`~elastic_ext.control.notice.NOTICE_SIGNAL` the driver sends a
   :class:`~elastic_ext.control.notice.JobNotice` to every worker through
   Horovod's notification service (authenticated with each worker's key),
   and to each worker that registers its service later (one that was
   still starting): every worker leaves at the next commit, rank 0 first
   makes it durable. With no worker left, Horovod's driver ends the job
   ("failure count == N"); a requeued job resumes from that commit.
"""

from __future__ import annotations

import logging
import signal
import threading
import urllib.parse
from typing import Any, Dict, List, Set

from elastic_ext.launch import job_hosts
from elastic_ext.control.notice import NOTICE_SIGNAL, JobNotice, signal_notice
from elastic_ext.control.store import NOTICE_SCOPE
from elastic_ext.control.horovod_seam import Change

logger = logging.getLogger(__name__)

MAX_HOST_LEN = 253

noticed: Set[str] = set()              # hosts with a notice, dropped from discovery for the job's life
_drivers: list = []                    # the driver of this process, once Horovod created it
_job_notices: list = []                # the JobNotice of this job, once the signal came


def note(host: str) -> bool:
    """Records that ``host`` has a notice; False (logged) for a host the job's discovery never listed.

    The name only ever filters discovered hosts (it is never started or
    run); recording only listed ones bounds :data:`noticed` by the job's hosts.
    """
    if not host or len(host) > MAX_HOST_LEN or any(c.isspace() or c == ":" for c in host):
        logger.error("elastic_ext: ignoring a preemption notice for host %r: not a host name", host[:MAX_HOST_LEN])
        return False
    if not job_hosts.hosts.was_listed(host):
        logger.error("elastic_ext: ignoring a preemption notice for host %r: the job's discovery never listed it",
                     host)
        return False
    if host not in noticed:
        noticed.add(host)
        logger.warning("elastic_ext: host %s has a preemption notice: its workers leave at their next commit, "
                       "and discovery leaves it out from now on", host)
    return True


class WithoutNoticed:
    """A Horovod discovery whose answers leave out the hosts with a notice."""

    def __init__(self, discovery: Any) -> None:
        self.discovery = discovery

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        found = self.discovery.find_available_hosts_and_slots()
        job_hosts.hosts.listed(found)  # whom the store serves, and the hosts a notice may name
        return {host: slots for host, slots in found.items() if host not in noticed}


def _send(client: Any, job_notice: JobNotice, host: str, local_rank: int) -> bool:
    try:
        client._send(job_notice)
        return True
    except Exception as exc:  # noqa: BLE001 - a worker that is gone already: the others still get it
        logger.warning("elastic_ext: could not pass the notice to %s[%s]: %s", host, local_rank, exc)
        return False


def notify_every_worker(driver: Any, job_notice: JobNotice) -> int:
    """Sends ``job_notice`` to every worker that registered its notification service; returns how many took it."""
    clients = list(getattr(driver, "_worker_clients", {}).items())
    return sum(_send(client, job_notice, host, local_rank) for (host, local_rank), client in clients)


def on_signal(signum: int, frame: Any) -> None:
    """The driver's handler of NOTICE_SIGNAL: every worker leaves at its next commit."""
    notice = signal_notice()
    logger.warning("elastic_ext: %s received (%s notice): every worker leaves at its next commit", 
                   signal.Signals(signum).name, notice.source)

    job_notice = JobNotice(notice.source, notice.kind, notice.detail)
    _job_notices[:] = [job_notice]  # workers that register from now on get it when they do

    def relay() -> None:
        if _drivers:
            taken = notify_every_worker(_drivers[0], job_notice)
            logger.warning("elastic_ext: %d workers took the notice", taken)

    threading.Thread(target=relay, name="elastic_ext-job-notice", daemon=True).start()


def driver_built(driver: Any) -> None:
    """The launcher's driver (:func:`elastic_ext.launch.driver.driver_class`) was built: the signal's relay uses it."""
    _drivers[:] = [driver]


def worker_registered(driver: Any, host: str, local_rank: int) -> None:
    """A worker registered its notification service: a worker that was starting when the signal came gets
    the job's notice now."""
    if _job_notices:
        client = driver._worker_clients[(host, local_rank)]
        threading.Thread(target=_send, args=(client, _job_notices[0], host, local_rank), daemon=True,
                         name="elastic_ext-job-notice-late").start()


def changes() -> List[Change]:
    """In this (the driver's) process: Slurm's signal for the whole job (installed now), and the store's
    reading of notices, for :func:`elastic_ext.launch.horovod_changes.install_launcher` to make. The
    driver's part (:class:`WithoutNoticed`, :func:`driver_built`, :func:`worker_registered`) is in the
    launcher's driver."""
    from horovod.runner.http.http_server import KVStoreHandler

    original_put = KVStoreHandler._put_value

    def put_value(self: Any, scope: str, key: str, value: bytes) -> None:
        if scope == NOTICE_SCOPE:
            note(urllib.parse.unquote(key))
        original_put(self, scope, key, value)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(NOTICE_SIGNAL) is signal.SIG_DFL:
        signal.signal(NOTICE_SIGNAL, on_signal)
    return [(KVStoreHandler, "_put_value", put_value)]


__all__ = ["noticed", "note", "WithoutNoticed", "changes", "driver_built", "notify_every_worker", "on_signal",
           "worker_registered"]
