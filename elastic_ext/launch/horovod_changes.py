"""The launcher's half of the seam: every change the driver's process makes to Horovod, and their order.

:mod:`elastic_ext.control.horovod_seam` checks, before this module runs,
that the installed Horovod has every attribute listed there, and records
every change made (:data:`~elastic_ext.control.horovod_seam.REPLACED`).
Each module that changes Horovod's behaviour in the driver says what it
would change (a function returning
:data:`~elastic_ext.control.horovod_seam.Change` tuples, or a subclass of
Horovod's own class), and :func:`install_launcher` makes those changes in
the order of :data:`LAUNCHER_PARTS`:

1. ``store_guard``: the store serves the job's hosts only, loads no pickle,
   takes the launcher's keys only with the job's secret.
2. ``store_serving``: a listen queue for bursts; one loop serves every request.
3. ``noticed_hosts``: preemption notices reach the driver through its store.
4. ``driver``: Horovod's elastic Gloo run builds the launcher's driver
   (:func:`elastic_ext.launch.driver.driver_class`, one subclass of
   ``ElasticDriver``; its discovery and its clients of the workers'
   services are the launcher's too).
5. ``worker_runs``: each worker's command a plain child of the driver.
6. ``ssh_keepalive``: keepalives and the ``ssh_host_keys`` check in ssh.
7. ``build_check``: Horovod's build checks answered from a cache.
8. ``worker_entry``: every worker starts through the worker entry.

A worker's changes are :mod:`elastic_ext.worker.horovod_changes`. Nothing
here is undone by the product: a process installs once, for its life.
"""

from __future__ import annotations

from typing import Callable, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from elastic_ext.control.horovod_seam import Change, make

#: The parts of :data:`LAUNCHER_PARTS` installed in this process.
INSTALLED: Set[str] = set()

LAUNCHER_PARTS: Tuple[str, ...] = ("store_guard", "store_serving", "noticed_hosts", "driver", "worker_runs",
                                   "ssh_keepalive", "build_check", "worker_entry")


def _launcher_changes(part: str, resolver: Optional[Callable[[str], FrozenSet[str]]],
                      host_keys: Optional[str]) -> List[Change]:
    from horovod.runner import gloo_run

    from elastic_ext.launch import (build_check, command_line, driver, noticed_hosts, ssh_keepalive, store_guard,
                                    store_serving, worker_runs)

    made: Mapping[str, Callable[[], List[Change]]] = {
        "store_guard": lambda: store_guard.changes(resolver),
        "store_serving": store_serving.changes,
        "noticed_hosts": noticed_hosts.changes,
        "driver": lambda: [(gloo_run, "ElasticDriver", driver.driver_class())],  # where Horovod builds its driver
        "worker_runs": worker_runs.changes,
        "ssh_keepalive": lambda: ssh_keepalive.changes(host_keys),
        "build_check": build_check.changes,
        "worker_entry": command_line.worker_entry_changes,
    }
    return made[part]()


def install_launcher(parts: Sequence[str] = LAUNCHER_PARTS,
                     resolver: Optional[Callable[[str], FrozenSet[str]]] = None,
                     host_keys: Optional[str] = None) -> None:
    """Makes the launcher's changes in this (the driver's) process, in the order of :data:`LAUNCHER_PARTS`;
    a part already installed is left as it is.

    ``parts``: which (tests make only those they test); ``resolver``: host name -> addresses for the
    store guard (default: DNS); ``host_keys``: the ssh host key check (default: the ``ssh_host_keys``
    setting).

    Raises:
        ValueError: an unknown part.
        ConfigError: the ``ssh_host_keys`` setting, or another ``ELASTIC_EXT_*`` variable, is bad.
    """
    unknown = sorted(set(parts) - set(LAUNCHER_PARTS))
    if unknown:
        raise ValueError(f"parts {unknown}: expected some of {list(LAUNCHER_PARTS)}")
    for part in LAUNCHER_PARTS:
        if part in parts and part not in INSTALLED:
            make(_launcher_changes(part, resolver, host_keys))
            INSTALLED.add(part)


__all__ = ["INSTALLED", "LAUNCHER_PARTS", "install_launcher"]
