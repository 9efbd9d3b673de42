"""Horovod given back after a test that made the launcher's or a worker's changes in this process.

The product makes its changes once per process (elastic_ext.launch.horovod_changes, elastic_ext.worker.horovod_changes;
elastic_ext.control.horovod_seam records each original) and never undoes
them; the unit tests run Horovod's own behaviour and the changed one side by side in one process, so
they put back every original the changes recorded, and forget what the changed modules learned.
"""

import signal

import pytest

from elastic_ext.control import horovod_seam, notice
from elastic_ext.launch import discovery_runs, horovod_changes, job_hosts, noticed_hosts, store_guard
from elastic_ext.worker import notices


def restore_horovod():
    for (owner, name), original in reversed(list(horovod_seam.REPLACED.items())):
        setattr(owner, name, original)
    horovod_seam.REPLACED.clear()
    horovod_changes.INSTALLED.clear()
    job_hosts.hosts.stop()
    job_hosts.hosts.forget()
    store_guard._refusals_logged.clear()
    noticed_hosts.noticed.clear()
    noticed_hosts._drivers.clear()
    noticed_hosts._job_notices.clear()
    notices._accepting.clear()
    discovery_runs._refused.clear()
    if signal.getsignal(notice.NOTICE_SIGNAL) is noticed_hosts.on_signal:
        signal.signal(notice.NOTICE_SIGNAL, signal.SIG_DFL)


@pytest.fixture
def changes():
    """``changes(*parts, resolver=None, host_keys=None)`` makes those launcher parts; Horovod is given back after."""
    try:
        yield lambda *parts, **kwargs: horovod_changes.install_launcher(parts=parts, **kwargs)
    finally:
        restore_horovod()
