"""Keepalives on the ssh that Horovod's driver starts each remote worker through.

Horovod's driver runs a remote worker as ``ssh HOST 'cd ...; env ... python ...'``
and learns of the worker's end from that ssh's end. A host that dies
without a TCP reset (power lost, a kernel panic, a cut cable, a network
partition) leaves that ssh waiting: an idle TCP connection does not time
out, and ssh's own ``TCPKeepAlive`` waits for the kernel's keepalive (two
hours and more by default), so the driver does not record the failure
nor re-form the job for that long. With ``ServerAliveInterval`` and ``ServerAliveCountMax`` the ssh client
asks the host for an answer after :data:`ALIVE_INTERVAL_S` of silence and
gives up (exit 255) after :data:`ALIVE_COUNT_MAX` unanswered asks: the
driver sees the worker fail :data:`DETECTION_S` at most after its host went
silent, publishes the failure (:mod:`elastic_ext.worker.round_watch`), and
the survivors go on without it (:mod:`elastic_ext.runtime.driver_watch`).

A healthy host answers at once (sshd answers, not the worker), so a busy
worker is never mistaken for a dead one; a slow link only has to carry one
small packet each way within the bound. These options on the command line
win over the user's ``~/.ssh/config``.

Host keys: Horovod's prefix says ``StrictHostKeyChecking=no``, so a machine in
the middle would receive each worker's command line (the rendezvous address
included). :func:`changes` replace it with the ``ssh_host_keys`` setting
(``accept-new`` by default: a first contact still works, a changed key is refused).
"""

from __future__ import annotations

import re
from typing import List, Optional

from elastic_ext.config import SSH_HOST_KEYS, ElasticConfig
from elastic_ext.control.horovod_seam import Change

ALIVE_INTERVAL_S = 5
ALIVE_COUNT_MAX = 3
DETECTION_S = ALIVE_INTERVAL_S * (ALIVE_COUNT_MAX + 1)  # the last answer came just before the silence began
OPTIONS = f"-o ServerAliveInterval={ALIVE_INTERVAL_S} -o ServerAliveCountMax={ALIVE_COUNT_MAX}"


HOST_KEY_OPTION = re.compile(r"-o\s*StrictHostKeyChecking[= ]\S+", re.IGNORECASE)


def changes(host_keys: Optional[str] = None) -> List[Change]:
    """The ssh command of Horovod's driver (this process) with :data:`OPTIONS` and its host key check set to
    ``host_keys`` (None: the ``ssh_host_keys`` setting), for
    :func:`elastic_ext.launch.horovod_changes.install_launcher` to make.

    Raises:
        ConfigError: the setting (or any ``ELASTIC_EXT_*`` variable) is bad.
    """
    from horovod.runner.util import remote

    config = ElasticConfig.from_env() if host_keys is None else ElasticConfig(ssh_host_keys=host_keys)
    check = f"-o StrictHostKeyChecking={SSH_HOST_KEYS[config.ssh_host_keys]}"
    prefix = HOST_KEY_OPTION.sub("", remote.SSH_COMMAND_PREFIX)
    prefix = " ".join(part for part in prefix.split(" ") if part)  # the removed option leaves a double space
    if OPTIONS not in prefix:
        prefix = f"{prefix} {OPTIONS}"
    return [(remote, "SSH_COMMAND_PREFIX", f"{prefix} {check}")]
