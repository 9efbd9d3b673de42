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
silent, publishes the failure (:mod:`elastic_ext.launch.round_watch`), and
the survivors go on without it (:mod:`elastic_ext.runtime.driver_watch`).

A healthy host answers at once (sshd answers, not the worker), so a busy
worker is never mistaken for a dead one; a slow link only has to carry one
small packet each way within the bound. These options on the command line
win over the user's ``~/.ssh/config``.
"""

from __future__ import annotations

ALIVE_INTERVAL_S = 5
ALIVE_COUNT_MAX = 3
DETECTION_S = ALIVE_INTERVAL_S * (ALIVE_COUNT_MAX + 1)  # the last answer came just before the silence began
OPTIONS = f"-o ServerAliveInterval={ALIVE_INTERVAL_S} -o ServerAliveCountMax={ALIVE_COUNT_MAX}"


def install() -> None:
    """Adds :data:`OPTIONS` to the ssh command of Horovod's driver (this process); idempotent."""
    from horovod.runner.util import remote

    if OPTIONS not in remote.SSH_COMMAND_PREFIX:
        remote.SSH_COMMAND_PREFIX = f"{remote.SSH_COMMAND_PREFIX} {OPTIONS}"
