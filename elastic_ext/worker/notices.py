"""Preemption notices: each worker watches for them and leaves at the next commit, before the machine goes.

Spot capacity warns before it takes a machine back (AWS about two minutes
ahead, GCP and Azure at least 30 s), and Slurm sends ``--signal`` before a
time limit. SIGTERM comes at the last moment or not at all, so acting on the
notice is what turns a lost machine into a resize without a rollback.

Under ``elastic-horovodrun`` the workers' entry module (:mod:`elastic_ext.worker.entry`)
calls :func:`install` before the script runs:

- a :class:`Watcher` thread asks the cloud's documented metadata endpoint
  (:mod:`elastic_ext.worker.metadata`); the cloud is detected from the
  machine's DMI data (:func:`cloud_from_dmi`), or named by
  ``ELASTIC_EXT_NOTICE_ENDPOINT`` (:func:`elastic_ext.config.notice_endpoints`).
  Polls are aligned to the wall clock, so the workers of one host see a
  notice within milliseconds of each other and leave at the same commit;
- :data:`NOTICE_SIGNAL` (SIGUSR1, Slurm's ``--signal=USR1@...``) means the same;
- the driver can pass a notice for the whole job on (:class:`JobNotice`,
  through each worker's Horovod notification service), see
  :mod:`elastic_ext.launch.noticed_hosts`.

A notice that takes the host away (:meth:`act`) asks this worker to leave at
its next commit (``cause`` ``"preemption"``, the same graceful leave as a
SIGTERM: every rank agrees at that commit, rank 0 makes it durable first,
no rollback) and tells the driver, whose discovery then drops the host for
good. An advisory one (AWS's rebalance recommendation, an Azure Reboot) is
logged only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import urllib.parse
from typing import Any, Callable, List, Mapping, Optional

from elastic_ext.config import ElasticConfig, elastic_horovodrun, notice_endpoints
from elastic_ext.errors import ConfigError
from elastic_ext.control import store
from elastic_ext.control.notice import NOTICE_SIGNAL, JobNotice, Notice, signal_notice
from elastic_ext.worker.metadata import CLIENTS
from elastic_ext.worker.round_watch import store_url
from elastic_ext.worker.sigterm import Relay
from elastic_ext.liveness import LIVENESS, Liveness

logger = logging.getLogger(__name__)

_accepting: list = []  # (config, liveness) once install() ran: the driver's JobNotice is taken

CAUSE = "preemption"
NOTICE_SCOPE = store.NOTICE_SCOPE    # the driver's store: one key per host with a notice
RETRY_S = 30.0                       # after an endpoint failed: ask again this much later
DMI_DIR = "/sys/class/dmi/id"
HYPERVISOR_UUID = "/sys/hypervisor/uuid"
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"  # every Azure VM's chassis asset tag


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""  # no such file (not that hypervisor) or not readable (a container): not this cloud


def cloud_from_dmi(dmi_dir: str = DMI_DIR, hypervisor_uuid: str = HYPERVISOR_UUID) -> Optional[str]:
    """The cloud this machine runs in, from what its firmware says (as cloud-init tells them), or None."""
    vendors = {_read(os.path.join(dmi_dir, name)) for name in ("sys_vendor", "board_vendor")}
    if "Amazon EC2" in vendors or _read(hypervisor_uuid).lower().startswith("ec2"):
        return "aws"
    if "Google" in vendors or _read(os.path.join(dmi_dir, "product_name")) == "Google Compute Engine":
        return "gcp"
    if _read(os.path.join(dmi_dir, "chassis_asset_tag")) == AZURE_ASSET_TAG:
        return "azure"
    return None


def clients(environ: Optional[Mapping[str, str]] = None, dmi_dir: str = DMI_DIR) -> List[Any]:
    """The metadata clients to watch: those ``ELASTIC_EXT_NOTICE_ENDPOINT`` names, else the detected cloud's.

    Raises:
        ConfigError: ``ELASTIC_EXT_NOTICE_ENDPOINT`` does not parse.
    """
    env = os.environ if environ is None else environ
    endpoints = notice_endpoints(env)
    if endpoints is None:
        cloud = cloud_from_dmi(dmi_dir)
        endpoints = [] if cloud is None else [(cloud, None)]
    host = urllib.parse.quote(env.get("HOROVOD_HOSTNAME", ""), safe="")
    return [CLIENTS[cloud](url.replace("{host}", host) if url else None) for cloud, url in endpoints]


class Watcher(threading.Thread):
    """Asks one endpoint until it announces that this host goes away; then calls ``on_notice`` once.

    Polls fall on multiples of the client's ``POLL_S`` of the wall clock, the
    same instants on every worker of a host. An endpoint that fails is asked
    again after :data:`RETRY_S` (the first failure is a warning, the later
    ones debug lines): a machine whose endpoint cannot be reached behaves as
    one without notices. Any answer at all (garbled HTTP, a wrongly shaped
    document, a body over the cap) counts as such a failure: it never ends
    the thread, so a bad answer cannot switch notices off.
    """

    def __init__(self, client: Any, on_notice: Any, stop: Optional[threading.Event] = None,
                 retry_s: Optional[float] = None) -> None:
        super().__init__(name=f"elastic_ext-notices-{client.source}", daemon=True)
        self.client, self.on_notice = client, on_notice
        self.stop = stop or threading.Event()
        self.retry_s = retry_s  # None: RETRY_S, read at each failure
        self.failures = 0

    def _retry_s(self) -> float:
        return RETRY_S if self.retry_s is None else self.retry_s

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                notice = self.client.check()
            except Exception as exc:  # noqa: BLE001 - whatever an endpoint answers, the watch goes on
                self.failures += 1
                (logger.warning if self.failures == 1 else logger.debug)(
                    "preemption notices: %s at %s failed (%s: %s); asking again in %.0fs", self.client.source,
                    self.client.base_url, type(exc).__name__, exc, self._retry_s())
                self.stop.wait(self._retry_s())
                continue
            if notice is not None:
                self.on_notice(notice)
                if notice.leave:
                    return
            period = self.client.POLL_S
            if period > 0:
                self.stop.wait(period - time.time() % period)


def act(notice: Notice, config: ElasticConfig, liveness: Optional[Liveness] = None,
        environ: Optional[Mapping[str, str]] = None, report: bool = True) -> bool:
    """What a worker does with a notice: leave at the next commit and tell the driver, or only log it.

    Returns True when this call asked the worker to leave (False: advisory, or already leaving).
    """
    live = liveness or LIVENESS
    if not notice.leave:
        logger.warning("preemption notices: %s %s (advisory, not acted on): %s", notice.source, notice.kind,
                       notice.detail)
        return False
    if live.leaving():
        return False
    live.ask_to_leave(config.term_grace_s, cause=CAUSE, notice={**notice.fields(), "seen": time.time()})
    logger.warning("preemption notice from %s (%s: %s): leaving at the next commit", notice.source, notice.kind,
                   notice.detail)
    if report:  # in a thread: the driver may be slow to answer
        threading.Thread(target=report_host, args=(environ,), name="elastic_ext-notice-report", daemon=True).start()
    return True


def report_host(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Tells ``elastic-horovodrun``'s driver that this host has a notice (its discovery drops the host).

    Returns whether the driver's store took it; outside an elastic job there is nobody to tell.
    """
    env = os.environ if environ is None else environ
    url, host = store_url(env), env.get("HOROVOD_HOSTNAME")
    if url is None or not host:
        return False
    try:  # with the job's secret: the driver takes a notice from its host's addresses or with the secret
        status = store.put(f"{url}/{NOTICE_SCOPE}/{urllib.parse.quote(host, safe='')}")
    except OSError as exc:
        logger.error("cannot tell the driver at %s that host %s has a preemption notice: %s", url, host, exc)
        return False
    return status == 200


def install(environ: Optional[Mapping[str, str]] = None, liveness: Optional[Liveness] = None,
            dmi_dir: str = DMI_DIR) -> List[Watcher]:
    """In a worker of ``elastic-horovodrun``, before its script: the watchers, the signal, the driver's notices.

    Nothing outside an elastic ``horovodrun``. Returns the watchers started.
    """
    env = os.environ if environ is None else environ
    if not elastic_horovodrun(env):
        return []
    try:
        config = ElasticConfig.from_env(env)
        watched = clients(env, dmi_dir)
    except ConfigError as exc:
        logger.error("preemption notices are off: %s", exc)
        return []
    live = liveness or LIVENESS
    _install_signal(config, live, env)
    _accept_job_notices(config, live)
    watchers = [Watcher(client, lambda notice: act(notice, config, live, env)) for client in watched]
    for watcher in watchers:
        watcher.start()
    return watchers


def _install_signal(config: ElasticConfig, liveness: Liveness, environ: Mapping[str, str]) -> None:
    """SIGUSR1 is a notice for this worker, unless the script's process already handles it."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(NOTICE_SIGNAL) is not signal.SIG_DFL:
        return
    notice = signal_notice(environ)
    relay = Relay(lambda: act(notice, config, liveness, environ), "elastic_ext-notice-signal")
    signal.signal(NOTICE_SIGNAL, lambda signum, frame: relay.ring())  # act() logs, sets an Event, starts a
    # thread: in a handler that could deadlock the main thread (worker/sigterm.py), so the relay's thread acts


def _accept_job_notices(config: ElasticConfig, liveness: Liveness) -> None:
    """Lets this worker's Horovod notification service take a :class:`JobNotice` from the driver
    (:func:`job_notice_handler`, installed by :func:`elastic_ext.worker.horovod_changes.install_worker`)."""
    _accepting[:] = [(config, liveness)]


def job_notice_handler(original: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``WorkerNotificationService._handle`` (``original``) that also takes a :class:`JobNotice`
    once :func:`install` has run in this worker; before that, or without it, Horovod's alone."""
    from horovod.runner.common.util.network import AckResponse

    def handle(self: Any, req: Any, client_address: Any) -> Any:
        if isinstance(req, JobNotice) and _accepting:
            config, liveness = _accepting[0]
            act(req.notice, config, liveness, report=False)
            return AckResponse()
        return original(self, req, client_address)

    return handle


__all__ = ["CAUSE", "NOTICE_SCOPE", "Watcher", "act", "clients", "cloud_from_dmi", "install", "job_notice_handler",
           "report_host"]
