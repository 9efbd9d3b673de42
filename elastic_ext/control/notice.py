"""A preemption notice as the launcher's driver and its workers pass it: what each side reads and sends.

A worker's watchers (:mod:`elastic_ext.worker.notices`, the clouds' endpoints in
:mod:`elastic_ext.worker.metadata`) turn what an endpoint or a signal announced into a
:class:`Notice`. The driver, on :data:`NOTICE_SIGNAL` (Slurm's ``--signal``,
:mod:`elastic_ext.launch.noticed_hosts`), sends every worker a :class:`JobNotice`
through Horovod's authenticated notification service.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any, Dict, Mapping, Optional

NOTICE_SIGNAL = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class Notice:
    """What an endpoint (or Slurm's signal) announced: ``leave`` says whether this host goes away."""

    source: str                 # "aws", "gcp", "azure" or "slurm"
    kind: str                   # what announced it: "instance-action", "rebalance", "preempted", "Preempt", ...
    leave: bool                 # True: the host is taken away; False: advisory, only reported
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)  # the endpoint's answer, as documented

    def fields(self) -> Dict[str, Any]:
        """The notice as event fields."""
        return {"source": self.source, "kind": self.kind, "detail": self.detail}


class JobNotice:
    """A notice the driver passes to every worker (Slurm's signal reached it): sent over Horovod's
    authenticated notification service; the worker leaves at its next commit."""

    def __init__(self, source: str, kind: str, detail: Optional[Dict[str, Any]] = None) -> None:
        self.notice = Notice(source, kind, True, dict(detail or {}))


def signal_notice(environ: Optional[Mapping[str, str]] = None) -> Notice:
    """The notice :data:`NOTICE_SIGNAL` stands for: Slurm's ``--signal`` inside a Slurm job."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    return Notice("slurm" if job else "signal", "SIGUSR1", True, {"slurm_job_id": job} if job else {})


__all__ = ["NOTICE_SIGNAL", "JobNotice", "Notice", "signal_notice"]
